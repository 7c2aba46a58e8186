"""Lesson 18: Hugging Face Mixtral <-> tpedu: MixtralForCausalLM's weights in the tensor- and
expert-parallel GPT, and a Mixtral-shaped tpedu mixture of experts exported for `transformers`.

Mixtral is Llama (tpedu.checkpoint.hf_llama: RMSNorm, RoPE, grouped-query attention, no biases)
with every MLP a mixture of E SwiGLU experts, top-k routed:

    logits = gate(x)        [T, E]     tpedu: blocks.i.mlp.router.gate.weight
    probs  = softmax(logits)           transformers: in float32, whatever the model's dtype
    top-k of probs, renormalised to sum to 1 (tpedu's router_renormalize=True), dropless
    y = Σ_j w_j · w2_e(silu(w1_e x) · w3_e x)    e: the j-th choice; w1, w3, w2 = tpedu's fc1
                                                 (gate), up, fc2 (down)

The expert weights exist in two layouts, both read here:
    files (save_pretrained, the Hub)   model.layers.i.block_sparse_moe.gate.weight           [E, H]
                                       model.layers.i.block_sparse_moe.experts.j.w1.weight   [F, H]
                                       ... .w3.weight [F, H], .w2.weight [H, F]
    the model (transformers 5)         model.layers.i.mlp.gate.weight                         [E, H]
                                       model.layers.i.mlp.experts.gate_up_proj  [E, 2F, H]: w1 | w3
                                       model.layers.i.mlp.experts.down_proj     [E, H, F]:  w2
`table` is the files' layout (per expert: so a rank reads only its experts, and only its TP
rows or columns of each); `to_files` / `from_files` convert the model's fused tensors to it and
back. `state_to_hf` gives the model's state dict (load_state_dict), `state_to_files` the files'
(export_hf writes these: transformers' loader fuses them, as it does the Hub's).

Not expressed, so refused on import (`unsupported`): router jitter noise (transformers
multiplies the router's input by noise in training), a sliding window shorter than the
positions, top_k > 2, and Llama's refusals (RoPE scaling, an activation other than silu, a
head_dim other than H / heads). Refused on export (`check_mixtral_shaped`):
what Mixtral cannot express: a shared expert, a capacity factor (Mixtral is dropless), top-k
weights not renormalised, dense layers between the MoE ones (moe_every > 1).

The auxiliary loss: the coefficient is carried as is (aux_loss_coef = router_aux_loss_coef;
transformers adds it to the loss only with output_router_logits=True), but the two losses
differ: transformers' is E · Σ_e f̄_e · P̄_e with f̄ (top-k assignments per token, so it sums to
k) and P̄ averaged over all the layers first; tpedu's is Σ_layers E · Σ_e f_e · P_e with f summing
to 1. For one layer, transformers' = k · tpedu's. Mixtral has no z-loss: z_loss_coef is 0 on
import and not carried on export. Neither changes the forward.
"""

from __future__ import annotations

import dataclasses
import re

import torch

from tpedu.checkpoint import hf_llama
from tpedu.checkpoint.hf_map import Part, Table, pack, require, unpack
from tpedu.model.config import GPTConfig
from tpedu.moe.router import TOP_K

_EXPERT = {"fc1": "w1", "up": "w3", "fc2": "w2"}  # tpedu expert Linear -> Mixtral's
_FUSED = re.compile(r"^(?P<at>.*)\.mlp\.experts\.(?P<what>gate_up_proj|down_proj)$")
_FILED = re.compile(r"^(?P<at>.*)\.block_sparse_moe\.experts\.(?P<j>\d+)\.(?P<w>w[123])\.weight$")


def table(config: GPTConfig) -> Table:
    """DenseGPT key -> its tensors in Mixtral's files: Llama's attention, norms, embedding and
    head (hf_llama.table), and per layer the router and each expert's w1, w3, w2."""
    out = {k: v for k, v in hf_llama.table(config).items() if ".mlp." not in k}
    for i in range(config.n_layers):
        at = f"model.layers.{i}.block_sparse_moe."
        out[f"blocks.{i}.mlp.router.gate.weight"] = [Part(f"{at}gate.weight")]
        for j in range(config.experts):
            for ours, theirs in _EXPERT.items():
                key = f"{at}experts.{j}.{theirs}.weight"
                out[f"blocks.{i}.mlp.experts.{j}.{ours}.weight"] = [Part(key)]
    return out


def alias(key: str) -> list[str]:
    """Where a Mixtral file key may be stored: as is, or without `model.` (MixtralModel)."""
    return hf_llama.alias(key)


def to_files(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """MixtralForCausalLM.state_dict() (fused experts) -> the files' keys (per expert; views,
    not copies). Keys already in the files' layout pass unchanged."""
    out = {}
    for key, value in hf_state.items():
        fused = _FUSED.match(key)
        if fused is None:
            out[key.replace(".mlp.gate.weight", ".block_sparse_moe.gate.weight")] = value
            continue
        at = f"{fused['at']}.block_sparse_moe.experts"
        for j, w in enumerate(value):
            if fused["what"] == "down_proj":
                out[f"{at}.{j}.w2.weight"] = w
            else:
                gate, up = w.chunk(2)  # transformers' `gate, up = linear(x, w).chunk(2)`
                out[f"{at}.{j}.w1.weight"], out[f"{at}.{j}.w3.weight"] = gate, up
    return out


def from_files(files: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The files' keys -> MixtralForCausalLM.state_dict()'s: per layer, the experts' w1 | w3
    stacked into gate_up_proj [E, 2F, H] and w2 into down_proj [E, H, F] (copies)."""
    out, experts = {}, {}
    for key, value in files.items():
        filed = _FILED.match(key)
        if filed is None:
            out[key.replace(".block_sparse_moe.gate.weight", ".mlp.gate.weight")] = value
        else:
            experts.setdefault(filed["at"], {})[int(filed["j"]), filed["w"]] = value
    for at, ws in experts.items():
        n = 1 + max(j for j, _ in ws)
        out[f"{at}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([ws[j, "w1"], ws[j, "w3"]]) for j in range(n)]
        )
        out[f"{at}.mlp.experts.down_proj"] = torch.stack([ws[j, "w2"] for j in range(n)])
    return out


def unsupported(hf_config: object) -> str | None:
    """Why tpedu cannot express a `transformers.MixtralConfig`, or None if it can."""
    why = hf_llama.unsupported(hf_config)  # RoPE scaling, the activation, head_dim
    if why is not None:
        return why
    jitter = getattr(hf_config, "router_jitter_noise", 0.0) or 0.0
    if jitter:
        return f"router_jitter_noise {jitter}: tpedu's router has no input jitter; set it to 0"
    window, positions = hf_config.sliding_window, hf_config.max_position_embeddings
    if window is not None and window < positions:
        return (
            f"sliding_window {window} < max_position_embeddings {positions}: tpedu's attention "
            "is full causal (use sliding_window None)"
        )
    k, e = hf_config.num_experts_per_tok, hf_config.num_local_experts
    if k not in TOP_K or not 1 <= k <= e:
        return f"num_experts_per_tok {k} of {e} experts: tpedu routes to top 1 or 2 of E >= k"
    return None


def config_from_hf(hf_config: object) -> GPTConfig:
    """The tpedu config of a `transformers.MixtralConfig`: Llama's, every layer a mixture of
    num_local_experts experts (top num_experts_per_tok, renormalised, dropless); a ValueError
    names the first setting tpedu cannot express (`unsupported`)."""
    why = unsupported(hf_config)
    if why is not None:
        raise ValueError(f"this Mixtral config cannot be loaded into tpedu: {why}")
    return dataclasses.replace(
        hf_llama.config_from_hf(hf_config),
        experts=hf_config.num_local_experts,
        top_k=hf_config.num_experts_per_tok,
        moe_every=1,
        router_renormalize=True,
        aux_loss_coef=float(hf_config.router_aux_loss_coef),
        z_loss_coef=0.0,
    )


def state_from_hf(hf_state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """A MixtralForCausalLM (or MixtralModel) state dict, fused or per expert -> a DenseGPT
    state dict (copies)."""
    files = to_files(hf_state)
    return pack(table(config), lambda k: files[next(a for a in alias(k) if a in files)])


def state_to_files(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """A DenseGPT state dict (Mixtral-shaped config) -> the tensors of Mixtral's files, per
    expert (copies; a tied lm_head as a copy of the embedding)."""
    check_mixtral_shaped(config)
    out = unpack(table(config), state)
    if config.tie_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"].clone()
    return out


def state_to_hf(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """A DenseGPT state dict (Mixtral-shaped config) -> MixtralForCausalLM's state dict (the
    experts fused, as transformers 5 holds them)."""
    return from_files(state_to_files(state, config))


def check_mixtral_shaped(config: GPTConfig) -> None:
    """Raise a one-line ValueError naming the first setting Mixtral cannot express."""
    wanted = {
        "norm": "rmsnorm",
        "position": "rope",
        "activation": "swiglu",
        "bias": False,
        "moe_every": 1,  # every Mixtral layer is a mixture of experts
        "shared_expert": False,
        "capacity_factor": None,  # Mixtral is dropless
        "router_renormalize": True,  # Mixtral renormalises the top-k weights
    }
    if config.experts < 1:
        raise ValueError("Mixtral needs experts >= 1, this model has none: export it as Llama")
    require(config, "Mixtral", wanted)


def hf_config(config: GPTConfig) -> object:
    """The `transformers.MixtralConfig` of a Mixtral-shaped tpedu config."""
    from transformers import MixtralConfig  # optional dependency, imported only here

    check_mixtral_shaped(config)
    return MixtralConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden,
        intermediate_size=config.expert_ffn,  # every layer's MLP is experts
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.kv_heads,
        head_dim=config.hidden // config.n_heads,
        max_position_embeddings=config.seq_len,
        rms_norm_eps=config.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        hidden_act="silu",
        tie_word_embeddings=config.tie_embeddings,
        sliding_window=None,
        num_local_experts=config.experts,
        num_experts_per_tok=config.top_k,
        router_aux_loss_coef=config.aux_loss_coef,
        router_jitter_noise=0.0,
        bos_token_id=None,  # tpedu's tokenizers have no <s> / </s>
        eos_token_id=None,
    )
