"""Lesson 14: Hugging Face Llama <-> tpedu: LlamaForCausalLM weights in the tensor-parallel GPT,
and a Llama-style tpedu model exported so `transformers` can use it.

Llama is tpedu's Llama-style config: RMSNorm, RoPE, SwiGLU, grouped-query attention, no biases.
Its separate q_proj, k_proj, v_proj stack into tpedu's fused QKV ([q heads | k heads | v heads],
each head's rows contiguous), and gate_proj / up_proj / down_proj are the MLP's fc1 / up / fc2.

RoPE needs no weight permutation here. Meta's original Llama rotates interleaved pairs
(x_0, x_1), (x_2, x_3), ...; Hugging Face rotates (x_i, x_{i+d/2}) (`rotate_half`) and permutes
q_proj and k_proj's rows once, when converting Meta's weights, to match. tpedu's `apply_rope`
rotates (x_i, x_{i+d/2}) too, so HF's q_proj and k_proj are used as stored.
"""

from __future__ import annotations

import torch

from tpedu.checkpoint.hf_map import Part, Table, pack, require, unpack
from tpedu.model.config import GPTConfig

_BLOCK = {  # tpedu block key -> Llama decoder-layer key (fused QKV: see `table`)
    "norm1.weight": "input_layernorm.weight",
    "attn.out.weight": "self_attn.o_proj.weight",
    "norm2.weight": "post_attention_layernorm.weight",
    "mlp.fc1.weight": "mlp.gate_proj.weight",
    "mlp.up.weight": "mlp.up_proj.weight",
    "mlp.fc2.weight": "mlp.down_proj.weight",
}


def table(config: GPTConfig) -> Table:
    """DenseGPT key -> its LlamaForCausalLM tensors; the fused QKV stacks q, k and v_proj."""
    d = config.hidden // config.n_heads
    q, kv = config.n_heads * d, config.kv_heads * d
    out = {"tok_emb.weight": [Part("model.embed_tokens.weight")]}
    for i in range(config.n_layers):
        at = f"model.layers.{i}."
        qkv = [(f"{at}self_attn.{x}_proj.weight", n) for x, n in (("q", q), ("k", kv), ("v", kv))]
        out[f"blocks.{i}.attn.qkv.weight"] = [Part(k, n) for k, n in qkv]
        out.update({f"blocks.{i}.{ours}": [Part(at + theirs)] for ours, theirs in _BLOCK.items()})
    out["norm_f.weight"] = [Part("model.norm.weight")]
    if not config.tie_embeddings:
        out["lm_head.weight"] = [Part("lm_head.weight")]
    return out


def alias(key: str) -> list[str]:
    """Where a LlamaForCausalLM key may be stored: as is, or without `model.` (LlamaModel)."""
    return [key, key.removeprefix("model.")]


def _rope(hf_config: object) -> dict:
    """RoPE settings: `rope_parameters` (transformers 5), else rope_theta and rope_scaling."""
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:
        params = {**(getattr(hf_config, "rope_scaling", None) or {})}
        params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    return params


def unsupported(hf_config: object) -> str | None:
    """Why tpedu cannot express a `transformers.LlamaConfig`, or None if it can."""
    rope = _rope(hf_config)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        return f"rope_type {kind!r} (RoPE scaling): tpedu implements plain RoPE only"
    if hf_config.hidden_act != "silu":
        return f"hidden_act {hf_config.hidden_act!r}: tpedu's SwiGLU gates with silu"
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(hf_config, flag, False):
            return f"{flag}=True: tpedu's Llama-style layers have no biases"
    n_heads, hidden = hf_config.num_attention_heads, hf_config.hidden_size
    head_dim = getattr(hf_config, "head_dim", None) or hidden // n_heads
    if head_dim * n_heads != hidden:
        return f"head_dim {head_dim} != hidden_size / num_attention_heads ({hidden} / {n_heads})"
    return None


def config_from_hf(hf_config: object) -> GPTConfig:
    """The tpedu config of a `transformers.LlamaConfig`; a ValueError names the first setting
    tpedu cannot express (`unsupported`)."""
    why = unsupported(hf_config)
    if why is not None:
        raise ValueError(f"this Llama config cannot be loaded into tpedu: {why}")
    return GPTConfig(
        vocab_size=hf_config.vocab_size,
        seq_len=hf_config.max_position_embeddings,
        n_layers=hf_config.num_hidden_layers,
        hidden=hf_config.hidden_size,
        n_heads=hf_config.num_attention_heads,
        n_kv_heads=hf_config.num_key_value_heads or hf_config.num_attention_heads,
        ffn_hidden=hf_config.intermediate_size,
        norm="rmsnorm",
        position="rope",
        activation="swiglu",
        bias=False,
        tie_embeddings=bool(hf_config.tie_word_embeddings),
        norm_eps=hf_config.rms_norm_eps,
        rope_theta=float(_rope(hf_config)["rope_theta"]),
    )


def state_from_hf(hf_state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """A LlamaForCausalLM (or LlamaModel) state dict -> a DenseGPT state dict (copies)."""
    return pack(table(config), lambda k: hf_state[next(a for a in alias(k) if a in hf_state)])


def state_to_hf(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """A DenseGPT state dict (Llama-shaped config) -> LlamaForCausalLM's state dict (a tied
    lm_head as a copy of the embedding, as GPT-2's export gives it)."""
    check_llama_shaped(config)
    out = unpack(table(config), state)
    if config.tie_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"].clone()
    return out


def check_llama_shaped(config: GPTConfig) -> None:
    """Raise a ValueError naming the first setting Llama cannot express."""
    wanted = {
        "norm": "rmsnorm",
        "position": "rope",
        "activation": "swiglu",
        "bias": False,
        "experts": 0,  # Llama has no mixture of experts
    }
    require(config, "Llama", wanted)


def hf_config(config: GPTConfig) -> object:
    """The `transformers.LlamaConfig` of a Llama-shaped tpedu config."""
    from transformers import LlamaConfig  # optional dependency, imported only here

    check_llama_shaped(config)
    return LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden,
        intermediate_size=config.ffn,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.kv_heads,
        head_dim=config.hidden // config.n_heads,
        max_position_embeddings=config.seq_len,
        rms_norm_eps=config.norm_eps,
        rope_theta=config.rope_theta,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=config.tie_embeddings,
        bos_token_id=None,  # tpedu's tokenizers have no Llama <s> / </s>
        eos_token_id=None,
    )
