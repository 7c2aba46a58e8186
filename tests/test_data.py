"""The novel corpus, the two tokenizers and the batch makers."""

import pytest
import torch

from tpedu.data import corpus, tokenizer
from tpedu.data.batches import IGNORE, packed_batch, padded_batch


@pytest.fixture(scope="module")
def novel():
    return corpus.load_novel()


def test_corpus_is_the_80_chapter_novel_without_commentary(novel):
    parts = corpus.chapters(novel)
    assert len(parts) == 80
    assert parts[0].startswith("第一回") and parts[-1].startswith("第八十回")
    assert "【" not in novel and "】" not in novel
    assert 580_000 < len(novel) < 600_000  # ≈0.59 M characters of prose
    raw = corpus.load_novel(commentary=True)
    assert raw.count("【") > 4000


def test_validation_chapters_are_held_out(novel):
    train, val = corpus.train_val_split(novel, val_chapters=8)
    assert train + val == novel
    assert val.startswith("第七十三回")
    with pytest.raises(ValueError, match="val_chapters must be between 1 and 79"):
        corpus.train_val_split(novel, 80)


def test_char_tokenizer_round_trip_and_unknowns(novel, tmp_path):
    train, val = corpus.train_val_split(novel)
    tok = tokenizer.CharTokenizer.train(train)
    assert tok.decode(tok.encode(train[:500])) == train[:500]
    unknown = [c for c in val if c not in tok.stoi]
    assert unknown, "the held-out chapters use characters the training chapters never do"
    assert tok.encode(unknown[0]) == [1]  # <unk>
    tok.save(tmp_path / "t.json")
    assert tokenizer.load(tmp_path / "t.json").encode(val[:300]) == tok.encode(val[:300])


def test_bpe_tokenizer_never_has_unknowns_and_is_cached(novel, tmp_path):
    text = novel[:30_000]
    tok = tokenizer.build(text, "bpe", 600, tmp_path)
    assert tok.vocab_size == 600
    sample = novel[-2000:]  # text it was not trained on
    assert tok.decode(tok.encode(sample)) == sample
    assert len(tok.encode(sample)) < len(sample.encode("utf-8"))  # merges beat raw bytes
    assert len(list(tmp_path.glob("bpe-*.json"))) == 1
    again = tokenizer.build(text, "bpe", 600, tmp_path)  # loaded from the cache
    assert again.encode(sample) == tok.encode(sample)
    with pytest.raises(ValueError, match="must be 'char' or 'bpe'"):
        tokenizer.build(text, "word")


def test_packed_batches_are_reproducible_and_split_over_dp():
    tokens = torch.arange(1000)
    x, y = packed_batch(tokens, batch=4, seq=16, step=3, seed=1)
    assert x.shape == y.shape == (4, 16)
    assert torch.equal(y, x + 1)  # next-token targets
    x2, _ = packed_batch(tokens, 4, 16, step=3, seed=1)
    assert torch.equal(x, x2)  # every TP rank draws the same batch
    assert not torch.equal(x, packed_batch(tokens, 4, 16, step=4, seed=1)[0])
    both = packed_batch(tokens, 8, 16, step=3, seed=1, dp_rank=0, dp_size=1)[0]
    halves = [packed_batch(tokens, 4, 16, step=3, seed=1, dp_rank=r, dp_size=2)[0] for r in (0, 1)]
    assert torch.equal(torch.cat(halves), both)  # dp ranks get disjoint slices of one batch
    with pytest.raises(ValueError, match="shorter than seq"):
        packed_batch(torch.arange(10), 1, 16, 0)


def test_padded_batch_masks_padding():
    x, y = padded_batch([[5, 6, 7, 8], [9, 10]], pad_id=0)
    assert x.tolist() == [[5, 6, 7], [9, 0, 0]]
    assert y.tolist() == [[6, 7, 8], [10, IGNORE, IGNORE]]
    x, y = padded_batch([[1, 2, 3, 4, 5, 6]], pad_id=0, max_len=3)
    assert x.tolist() == [[1, 2, 3]] and y.tolist() == [[2, 3, 4]]
    with pytest.raises(ValueError, match="at least 2 tokens"):
        padded_batch([[1]], 0)
