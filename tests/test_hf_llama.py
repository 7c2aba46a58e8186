"""Hugging Face Llama weights in the tensor-parallel GPT give Llama's own logits at tp 1, 2, 4
(tp 4 > 2 KV heads: each KV head replicated on two ranks), from a state dict or from a
`save_pretrained` directory by slices; a tpedu Llama exports to transformers and back
unchanged; what tpedu cannot express is refused. Nothing is downloaded: a tiny, randomly
initialised LlamaForCausalLM is built locally.

transformers runs two pieces of a Llama in float32 even in a float64 model: RMSNorm (it casts
the activations to float32) and the RoPE angles (inv_freq and cos/sin in float32). `hf64` swaps
those two forwards for the same formulas in the input's dtype, so that the comparisons can be
float64-tight: what remains is only summation order (tpedu's fused QKV, its TP partial sums),
~1e-16 relative per reduction, hence rtol = atol = 1e-12 on logits of size ~0.5. Unpatched,
the float32 islands alone differ by ~3e-8 (checked at 1e-6).
"""

from contextlib import contextmanager, nullcontext

import pytest
import torch
import transformers
from transformers.models.llama import modeling_llama

from tests.helpers import check_sliced, sliced_load, transformers_greedy
from tpedu import launch
from tpedu.checkpoint import hf, hf_llama
from tpedu.model.config import GPTConfig
from tpedu.model.dense import DenseGPT
from tpedu.model.gpt import TPGPT

TIGHT = {"rtol": 1e-12, "atol": 1e-12}  # float64, reordered sums only


def _rmsnorm64(self, x):
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _rotary64(self, x, position_ids):
    d = 2 * self.inv_freq.shape[0]
    theta = self.config.rope_parameters["rope_theta"]
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = position_ids[..., None].double() * inv_freq
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


@contextmanager
def hf64():
    """transformers' Llama with RMSNorm and RoPE in the input's dtype (see the module doc)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(modeling_llama.LlamaRMSNorm, "forward", _rmsnorm64)
        mp.setattr(modeling_llama.LlamaRotaryEmbedding, "forward", _rotary64)
        yield


def tiny_llama(seed: int = 0, **overrides) -> transformers.LlamaConfig:
    fields = {
        "vocab_size": 50,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "intermediate_size": 48,
        "max_position_embeddings": 16,
        "rope_theta": 500.0,  # not the default: a dropped theta would show
        "rms_norm_eps": 1e-5,
    }
    return transformers.LlamaConfig(**{**fields, **overrides})


def logits_of(model: transformers.PreTrainedModel, ids: torch.Tensor, exact: bool = True):
    with torch.no_grad(), hf64() if exact else nullcontext():
        return model(ids).logits


def scramble(model: torch.nn.Module) -> None:
    """Every bit of float64 in use (both libraries draw float32), and norm weights not all 1."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.add_(1e-3 * torch.randn_like(p))


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_llama()).double().eval()
    scramble(model)
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(1))
    return model, ids, logits_of(model, ids)


def tp_logits(config, state, ids):
    torch.set_default_dtype(torch.float64)  # built in float64: no float32 copy of the weights
    model = TPGPT.from_state_dict(config, state).eval()
    with torch.no_grad():
        return model.full_logits(ids)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_llama_weights_give_llama_logits(llama, tp):
    model, ids, expected = llama
    config = hf.config_from_hf(model.config)
    assert (config.kv_heads, config.rope_theta, config.tie_embeddings) == (2, 500.0, False)
    state = hf.state_from_hf(model.state_dict(), config)
    for logits in launch(tp_logits, tp, config, state, ids):
        assert logits.shape == (2, 12, 50)
        torch.testing.assert_close(logits, expected, **TIGHT)


def test_transformers_float32_islands_are_all_that_differ(llama):
    """Unpatched transformers (float32 RMSNorm and RoPE angles) is within float32 rounding."""
    model, ids, expected = llama
    config = hf.config_from_hf(model.config)
    dense = DenseGPT(config).double().eval()
    dense.load_state_dict(hf.state_from_hf(model.state_dict(), config))
    with torch.no_grad():
        torch.testing.assert_close(dense(ids), expected, **TIGHT)
        torch.testing.assert_close(
            dense(ids), logits_of(model, ids, exact=False), rtol=0, atol=1e-6
        )


def test_export_round_trips_into_transformers(llama):
    """HF -> tpedu -> HF gives back every tensor bit for bit, and a model with identical logits."""
    model, ids, expected = llama
    config = hf.config_from_hf(model.config)
    theirs = hf.state_to_hf(hf.state_from_hf(model.state_dict(), config), config)
    ours = model.state_dict()
    assert theirs.keys() == ours.keys()
    for key, value in ours.items():
        assert torch.equal(theirs[key], value), key
    exported = transformers.LlamaForCausalLM(hf.hf_config(config)).double().eval()
    exported.load_state_dict(theirs)
    assert torch.equal(logits_of(exported, ids), expected)


@pytest.mark.parametrize("tied", [False, True])
def test_tpedu_llama_runs_in_transformers(tied):
    """A tpedu-initialised Llama-style model, exported, computes tpedu's logits in transformers
    (and a tied one comes back tied: transformers shares the head with the embedding)."""
    torch.manual_seed(0)
    shape = {"seq_len": 16, "n_layers": 2, "hidden": 32, "ffn_hidden": 48, "rope_theta": 300.0}
    config = GPTConfig.llama_like(40, tie_embeddings=tied, **shape)
    dense = DenseGPT(config).double().eval()
    scramble(dense)
    ids = torch.randint(0, 40, (2, 10))
    cfg = hf.hf_config(config)
    exported = transformers.LlamaForCausalLM(cfg).double().eval()
    exported.load_state_dict(hf.state_to_hf(dense.state_dict(), config))
    assert hf.config_from_hf(cfg) == config
    assert (exported.lm_head.weight is exported.model.embed_tokens.weight) == tied
    with torch.no_grad():
        torch.testing.assert_close(logits_of(exported, ids), dense(ids), **TIGHT)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_llama_directory_loads_by_slices(llama, tmp_path, tp):
    """Each rank reads only its heads' rows of q_proj, k_proj, v_proj (one KV head's, also
    where two ranks share it), its columns of o_proj / down_proj, its vocabulary rows."""
    model, ids, expected = llama
    model.save_pretrained(tmp_path)
    total = sum(v.numel() * v.element_size() for v in model.state_dict().values())
    results = launch(sliced_load, tp, tmp_path, model.state_dict(), ids)
    check_sliced(results, expected, total, tp)


def test_sharded_directory_loads_by_slices(llama, tmp_path):
    """A checkpoint split over several files (model.safetensors.index.json) loads the same."""
    model, ids, expected = llama
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    total = sum(v.numel() * v.element_size() for v in model.state_dict().values())
    check_sliced(launch(sliced_load, 2, tmp_path, model.state_dict(), ids), expected, total, 2)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_type 'linear'"),
        ({"attention_bias": True}, "attention_bias=True"),
        ({"mlp_bias": True}, "mlp_bias=True"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"head_dim": 16}, "head_dim 16"),
    ],
)
def test_what_tpedu_cannot_express_is_refused(overrides, message):
    with pytest.raises(ValueError, match=message) as e:
        hf.config_from_hf(tiny_llama(**overrides))
    assert "\n" not in str(e.value)


def test_unknown_families_and_shapes_are_refused():
    with pytest.raises(ValueError, match="model_type 'bert' is not supported"):
        hf.config_from_hf(transformers.BertConfig())
    with pytest.raises(ValueError, match="Llama needs norm='rmsnorm'"):
        hf_llama.hf_config(GPTConfig(100, position="rope"))
    with pytest.raises(ValueError, match="config.json is missing"):
        hf.load_hf_sharded("/nonexistent")


def test_directories_without_safetensors_are_refused(tmp_path):
    tiny_llama().save_pretrained(tmp_path)  # config.json only, as if the weights were .bin
    with pytest.raises(ValueError, match="has no model.safetensors"):
        hf.load_hf_sharded(tmp_path)


def test_llama_checkpoint_exports_to_a_transformers_directory(tmp_path):
    """`tpedu reshard --to hf` for a Llama-shaped checkpoint (untied head kept): transformers
    loads the directory and computes tpedu's logits."""
    from tpedu import checkpoint
    from tpedu.parallel.config import ParallelConfig

    torch.manual_seed(0)
    config = GPTConfig.llama_like(40, seq_len=16, n_layers=2, hidden=32, n_kv_heads=2)
    dense = DenseGPT(config).double().eval()
    scramble(dense)
    ck = checkpoint.write_sharded(tmp_path / "c", config, dense.state_dict(), 3, ParallelConfig(2))
    out = checkpoint.export_hf(ck, tmp_path / "hf")
    theirs = transformers.LlamaForCausalLM.from_pretrained(out).double().eval()
    ids = torch.randint(0, 40, (2, 10))
    with hf64(), torch.no_grad():
        torch.testing.assert_close(logits_of(theirs, ids), dense(ids), **TIGHT)


def _greedy(config, state, prompts, steps):
    from tpedu.serve.generate import Sampling, generate_batch

    torch.set_default_dtype(torch.float64)
    model = TPGPT.from_state_dict(config, state).eval()
    return generate_batch(model, prompts, steps, Sampling(greedy=True))


@pytest.mark.parametrize("tp", [1, 4])
def test_greedy_tokens_equal_transformers_cached_generate(llama, tp):
    """tpedu's KV-cache decoding of HF Llama weights (tp 4: KV heads replicated) picks the
    greedy tokens of `LlamaForCausalLM.generate(do_sample=False, use_cache=True)`, RMSNorm and
    RoPE in float64 on both sides (hf64), for prompts of different lengths in one batch."""
    model, _, _ = llama
    prompts, steps = [[5, 17, 3, 42, 8, 1], [33, 2, 49]], 8
    with hf64():
        expected = transformers_greedy(model, prompts, steps)
    config = hf.config_from_hf(model.config)
    state = hf.state_from_hf(model.state_dict(), config)
    for got in launch(_greedy, tp, config, state, prompts, steps):
        assert got == expected
    assert len(set(expected[0][len(prompts[0]) :])) > 2  # not one token repeated
