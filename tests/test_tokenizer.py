"""The tokenizer cache: concurrent builders (ranks under torchrun) each write a temporary file of
their own, so neither loses its rename; a failed write leaves no temporary file behind. And
`unknown`: the characters a tokenizer cannot encode (the CLI refuses such a prompt)."""

import os

import pytest

from tpedu.data import tokenizer

TEXT = "满纸荒唐言，一把辛酸泪。都云作者痴，谁解其中味？\n"


def test_two_builders_at_once_both_succeed(tmp_path, monkeypatch):
    real = os.replace
    calls = []

    def replace_after_another_builder(src, dst):
        calls.append(str(src))
        if len(calls) == 1:  # the first builder is about to rename: a second one runs meanwhile
            tokenizer.build(TEXT, "char", cache_dir=tmp_path)
        real(src, dst)

    monkeypatch.setattr(os, "replace", replace_after_another_builder)
    tok = tokenizer.build(TEXT, "char", cache_dir=tmp_path)
    assert len(calls) == 2 and calls[0] != calls[1], calls  # one temporary name per builder
    (cached,) = tmp_path.iterdir()  # the cache file only: no temporary file left behind
    assert cached.suffix == ".json"
    assert tokenizer.load(cached).encode(TEXT) == tok.encode(TEXT)


def test_a_failed_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(OSError, match="No space left"):
        tokenizer.build(TEXT, "char", cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_unknown_characters_are_the_ones_encode_turns_into_unk():
    tok = tokenizer.CharTokenizer.train(TEXT + "ello word")
    assert tok.unknown("Hello, world €") == ["H", ",", "€"]  # each once, in order
    assert tok.unknown("Hello, Hello €€") == ["H", ",", "€"]
    assert tok.unknown(TEXT) == [] and tok.unknown("") == []
    unk = tok.stoi[tokenizer.UNK]
    for c in "Hello, world €" + TEXT:  # unknown exactly where encode gives <unk>
        assert (c in tok.unknown(c)) == (tok.encode(c) == [unk]), c
    assert tok.unknown("<unk>") == ["<", "u", "n", "k", ">"]  # the specials' names are not text


def test_byte_level_bpe_knows_every_character():
    tok = tokenizer.BPETokenizer.train(TEXT, 300)
    text = "Hello, world € 🙂 \x00"
    assert tok.unknown(text) == []
    assert tok.decode(tok.encode(text)) == text
