"""Hugging Face GPT-2 weights in the tensor-parallel GPT give GPT-2's own logits, at tp 1, 2, 4,
with GPT-2's real vocabulary size 50257 (padded at tp > 1), loaded from a state dict or from a
`save_pretrained` directory by slices (each rank reads exactly its shards' bytes). Nothing is
downloaded: a small, randomly initialised GPT2LMHeadModel is built locally."""

import pytest
import torch
import transformers

from tests.helpers import check_sliced, sliced_load
from tpedu import launch
from tpedu.checkpoint import hf
from tpedu.model.dense import DenseGPT
from tpedu.model.gpt import TPGPT


@pytest.fixture(scope="module")
def gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=50257, n_positions=16, n_embd=32, n_layer=2, n_head=4)
    model = transformers.GPT2LMHeadModel(cfg).double().eval()
    ids = torch.randint(0, 50257, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits
    return model, ids, logits


def tp_logits(config, state, ids):
    model = TPGPT.from_state_dict(config, state).double().eval()
    with torch.no_grad():
        return model.full_logits(ids)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gpt2_weights_give_gpt2_logits(gpt2, tp):
    model, ids, expected = gpt2
    config = hf.config_from_hf(model.config)
    state = hf.state_from_hf(model.state_dict(), config)
    for logits in launch(tp_logits, tp, config, state, ids):
        assert logits.shape == (2, 12, 50257)  # the padding never reaches the logits
        # float64; only reordered sums differ (≈1e-16 relative per reduction)
        torch.testing.assert_close(logits, expected, rtol=1e-10, atol=1e-10)


def test_export_round_trips_into_transformers(gpt2):
    model, ids, expected = gpt2
    config = hf.config_from_hf(model.config)
    dense = DenseGPT(config).double().eval()
    dense.load_state_dict(hf.state_from_hf(model.state_dict(), config))
    exported = transformers.GPT2LMHeadModel(hf.hf_config(config)).double().eval()
    exported.load_state_dict(hf.state_to_hf(dense.state_dict(), config))
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(dense(ids), expected, rtol=1e-10, atol=1e-10)


def test_configs_neither_family_expresses_cannot_be_exported():
    """Learned positions make a config GPT-2's; GPT-2 then refuses what else it cannot do."""
    from tpedu.model.config import GPTConfig

    with pytest.raises(ValueError, match="GPT-2 needs norm='layernorm'"):
        hf.state_to_hf({}, GPTConfig.llama_like(100, position="learned"))


@pytest.mark.parametrize("vocab", [4334, 50257])
def test_exported_config_token_ids_are_in_the_vocabulary(vocab):
    """A small vocabulary has no GPT-2 <|endoftext|> (50256): the ids are None, not out of range;
    GPT-2's own vocabulary keeps them."""
    from tpedu.model.config import GPTConfig

    config = GPTConfig.gpt2_like(vocab, seq_len=8, n_layers=1, hidden=16, n_heads=2)
    cfg = hf.hf_config(config)
    for name in ("bos_token_id", "eos_token_id"):
        value = getattr(cfg, name)
        assert value is None or 0 <= value < vocab, f"{name} = {value}, vocabulary {vocab}"
    if vocab == 50257:
        assert cfg.bos_token_id == cfg.eos_token_id == 50256


@pytest.mark.parametrize("tp", [2, 4])
def test_gpt2_directory_loads_by_slices(gpt2, tmp_path, tp):
    """save_pretrained stores the Conv1D weights [in, out] and drops the tied lm_head: the
    ranks read transposed column blocks of them, and padding rows of the vocabulary."""
    model, ids, expected = gpt2
    model.save_pretrained(tmp_path)
    total = sum(v.numel() * v.element_size() for v in model.state_dict().values())
    total -= model.lm_head.weight.numel() * 8  # tied: stored once
    results = launch(sliced_load, tp, tmp_path, model.state_dict(), ids)
    check_sliced(results, expected, total, tp)
