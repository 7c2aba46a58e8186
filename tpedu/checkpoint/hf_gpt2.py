"""Lesson 14: Hugging Face GPT-2 <-> tpedu: load GPT2LMHeadModel weights into the tensor-parallel
GPT, and export a trained GPT-2-shaped tpedu model so `transformers` can use it.

GPT-2 stores its linear layers as `Conv1D` (y = x·W + b with W [in, out]); tpedu uses nn.Linear
(W [out, in]), so every matrix is transposed. GPT-2's fused `c_attn` produces [q | k | v] with
the heads of each contiguous, which is exactly tpedu's fused QKV layout; `ParallelAttention`
then picks each rank's heads out of it. GPT-2's vocabulary (50257) is prime-ish: at tp > 1 the
vocab-parallel embedding pads it, and the padding never reaches the logits.
"""

from __future__ import annotations

import torch

from tpedu.checkpoint.hf_map import Part, Table, pack, require, unpack
from tpedu.model.config import GPTConfig

_TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_NAMES = {  # tpedu block key -> GPT-2 block key
    "norm1.weight": "ln_1.weight",
    "norm1.bias": "ln_1.bias",
    "attn.qkv.weight": "attn.c_attn.weight",
    "attn.qkv.bias": "attn.c_attn.bias",
    "attn.out.weight": "attn.c_proj.weight",
    "attn.out.bias": "attn.c_proj.bias",
    "norm2.weight": "ln_2.weight",
    "norm2.bias": "ln_2.bias",
    "mlp.fc1.weight": "mlp.c_fc.weight",
    "mlp.fc1.bias": "mlp.c_fc.bias",
    "mlp.fc2.weight": "mlp.c_proj.weight",
    "mlp.fc2.bias": "mlp.c_proj.bias",
}


def table(config: GPTConfig) -> Table:
    """DenseGPT key -> its GPT2LMHeadModel tensor (one each; the Conv1D weights transposed)."""
    out = {
        "tok_emb.weight": [Part("transformer.wte.weight")],
        "pos_emb.weight": [Part("transformer.wpe.weight")],
    }
    for i in range(config.n_layers):
        for ours, theirs in _NAMES.items():
            out[f"blocks.{i}.{ours}"] = [
                Part(f"transformer.h.{i}.{theirs}", None, theirs in _TRANSPOSED)
            ]
    out["norm_f.weight"] = [Part("transformer.ln_f.weight")]
    out["norm_f.bias"] = [Part("transformer.ln_f.bias")]
    return out


def alias(key: str) -> list[str]:
    """Where a GPT2LMHeadModel key may be stored: as is, or without `transformer.` (GPT2Model)."""
    return [key, key.removeprefix("transformer.")]


def config_from_hf(hf_config: object) -> GPTConfig:
    """The tpedu config of a `transformers.GPT2Config` (dropout off: use for inference/tuning)."""
    activation = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
    act = hf_config.activation_function
    if act not in activation:
        raise ValueError(
            f"GPT-2 activation {act!r} is not supported; expected one of {list(activation)}"
        )
    return GPTConfig(
        vocab_size=hf_config.vocab_size,
        seq_len=hf_config.n_positions,
        n_layers=hf_config.n_layer,
        hidden=hf_config.n_embd,
        n_heads=hf_config.n_head,
        ffn_hidden=hf_config.n_inner or 4 * hf_config.n_embd,
        activation=activation[act],
        norm_eps=hf_config.layer_norm_epsilon,
        tie_embeddings=True,
    )


def state_from_hf(hf_state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """A GPT2LMHeadModel (or GPT2Model) state dict -> a DenseGPT state dict (copies)."""
    return pack(table(config), lambda k: hf_state[next(a for a in alias(k) if a in hf_state)])


def state_to_hf(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """A DenseGPT state dict (GPT-2-shaped config) -> GPT2LMHeadModel's state dict."""
    check_gpt2_shaped(config)
    out = unpack(table(config), state)
    out["lm_head.weight"] = out["transformer.wte.weight"].clone()  # tied: transformers re-ties
    return out


def check_gpt2_shaped(config: GPTConfig) -> None:
    """Raise a ValueError naming the first setting GPT-2 cannot express."""
    wanted = {
        "norm": "layernorm",
        "position": "learned",
        "bias": True,
        "tie_embeddings": True,
        "experts": 0,  # GPT-2 has no mixture of experts
    }
    require(config, "GPT-2", wanted)
    if config.kv_heads != config.n_heads:  # n_kv_heads None, or spelled out as n_heads
        raise ValueError(f"GPT-2 needs n_kv_heads=None, this model has {config.n_kv_heads!r}")
    if config.activation not in ("gelu", "gelu_tanh"):
        raise ValueError(f"GPT-2 needs a GELU activation, this model has {config.activation!r}")


def hf_config(config: GPTConfig) -> object:
    """The `transformers.GPT2Config` of a GPT-2-shaped tpedu config."""
    from transformers import GPT2Config  # optional dependency, imported only here

    check_gpt2_shaped(config)
    # GPT-2's <|endoftext|> (50256) exists only in its own vocabulary; a smaller one has no such
    # token, and transformers warns about an id outside the vocabulary on every load.
    eos = 50256 if config.vocab_size >= 50257 else None
    return GPT2Config(
        vocab_size=config.vocab_size,
        n_positions=config.seq_len,
        n_embd=config.hidden,
        n_layer=config.n_layers,
        n_head=config.n_heads,
        n_inner=config.ffn,
        activation_function="gelu_new" if config.activation == "gelu_tanh" else "gelu",
        layer_norm_epsilon=config.norm_eps,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=eos,
        eos_token_id=eos,
    )
