"""Lesson 07: `DenseGPT`, the single-process reference GPT (plain torch, no communication).

Pre-norm blocks of tpedu.tp.dense's DenseAttention and DenseMLP, with the same index-based
dropout as the tensor-parallel model, so a `TPGPT` built from a DenseGPT's state dict computes
the same function and can be compared with it gradient by gradient.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from tpedu.model.config import GPTConfig
from tpedu.moe.aux_loss import attach_aux_loss
from tpedu.moe.dense import DenseMoE, MoEOutput
from tpedu.tp.dense import DenseAttention, DenseMLP
from tpedu.tp.dropout import derive_seed, index_dropout
from tpedu.tp.mlp import ParallelMLP
from tpedu.tp.vocab_parallel import IGNORE

# Dropout call sites owned by the model (the attention and MLP modules own theirs).
EMBEDDING_DROPOUT_SITE, ATTENTION_OUTPUT_DROPOUT_SITE = 11, 12


def make_norm(config: GPTConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.hidden, eps=config.norm_eps)
    return nn.LayerNorm(config.hidden, eps=config.norm_eps, bias=config.bias)


def make_mlp(config: GPTConfig, layer: int, seed: int) -> DenseMLP | DenseMoE:
    """Block `layer`'s MLP: a DenseMLP, or a DenseMoE on the config's MoE layers (lesson 18;
    its experts draw no dropout mask, as Mixtral's and DeepSeek's train without one)."""
    if config.is_moe_layer(layer):
        return DenseMoE(
            config.hidden,
            config.expert_ffn,
            config.experts,
            config.top_k,
            config.activation,
            config.bias,
            config.router_renormalize,
            config.shared_expert,
            config.capacity_factor,
        )
    return DenseMLP(
        config.hidden,
        config.ffn,
        config.activation,
        config.bias,
        output_dropout=config.dropout,
        seed=seed,
    )


def mlp_output(block: nn.Module, x: torch.Tensor, step: int) -> torch.Tensor:
    """block.mlp on x: an MLP's output, or a mixture of experts' y with its weighted auxiliary
    losses attached for backward (tpedu.moe.aux_loss); the latter's statistics, detached, are
    kept in block.moe_stats (the dense and the expert-parallel block alike)."""
    out = block.mlp(x, step) if isinstance(block.mlp, DenseMLP | ParallelMLP) else block.mlp(x)
    if not isinstance(out, MoEOutput):
        return out
    cfg = block.moe_coefs
    block.moe_stats = dataclasses.replace(
        out,
        y=None,
        logits=out.logits.detach(),
        aux_loss=out.aux_loss.detach(),
        z_loss=out.z_loss.detach(),
    )
    if cfg == (0.0, 0.0):  # nothing to learn from: no backward through the statistics
        return out.y
    return attach_aux_loss(out.y, cfg[0] * out.aux_loss + cfg[1] * out.z_loss)


class DenseBlock(nn.Module):
    """Pre-norm block: x + drop(attn(norm1(x))), then + mlp(norm2(·)) (the MLP drops its output).
    fused_attention: flash attention (SDPA) whenever no dropout mask is drawn (lesson 10)."""

    def __init__(self, config: GPTConfig, layer: int, fused_attention: bool = True) -> None:
        super().__init__()
        self.seed = derive_seed(config.seed, layer)
        self.p = config.dropout
        self.norm1, self.norm2 = make_norm(config), make_norm(config)
        rope = config.rope_theta if config.position == "rope" else None
        self.attn = DenseAttention(
            config.hidden,
            config.n_heads,
            config.kv_heads,
            bias=config.bias,
            dropout_p=config.dropout,
            dropout_seed=self.seed,
            rope_theta=rope,
            fused=fused_attention,
        )
        self.mlp = make_mlp(config, layer, self.seed)
        self.moe_coefs = (config.aux_loss_coef, config.z_loss_coef)
        self.moe_stats: MoEOutput | None = None  # the last forward's, on MoE layers

    def forward(self, x: torch.Tensor, step: int = 0) -> torch.Tensor:
        a = self.attn(self.norm1(x), step)
        seed = derive_seed(self.seed, ATTENTION_OUTPUT_DROPOUT_SITE, step)
        x = x + index_dropout(a, self.p, seed, training=self.training)
        return x + mlp_output(self, self.norm2(x), step)


class DenseGPT(nn.Module):
    """The single-process reference GPT. ids [b, s] -> logits [b, s, V] (or the mean loss).
    fused_attention=False computes attention explicitly (the scores stored for backward); the
    tensor-parallel model built from this one inherits the choice."""

    def __init__(self, config: GPTConfig, fused_attention: bool = True) -> None:
        super().__init__()
        config.check(1)
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.hidden)
        self.pos_emb = (
            nn.Embedding(config.seq_len, config.hidden) if config.position == "learned" else None
        )
        self.blocks = nn.ModuleList(
            DenseBlock(config, i, fused_attention) for i in range(config.n_layers)
        )
        self.norm_f = make_norm(config)
        self.lm_head = (
            None
            if config.tie_embeddings
            else nn.Linear(config.hidden, config.vocab_size, bias=False)
        )
        self.apply(init_weights)

    def hidden_states(self, ids: torch.Tensor, step: int = 0) -> torch.Tensor:
        """Embeddings -> blocks -> final norm: ids [b, s] -> [b, s, H]."""
        x = embed(self, ids, step)
        for block in self.blocks:
            x = block(x, step)
        return self.norm_f(x)

    def forward(
        self, ids: torch.Tensor, targets: torch.Tensor | None = None, step: int = 0
    ) -> torch.Tensor:
        """Logits [b, s, V]; with `targets` [b, s], the mean loss over non-IGNORE targets."""
        h = self.hidden_states(ids, step)
        head = self.tok_emb.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(h, head)
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)


def embed(
    model: nn.Module, ids: torch.Tensor, step: int, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """Token embeddings (+ learned positions, `positions` [s] or 0 .. s-1) -> dropout:
    [b, s] -> [b, s, H]."""
    x = model.tok_emb(ids)
    if model.pos_emb is not None:
        at = torch.arange(ids.shape[1]) if positions is None else positions
        x = x + model.pos_emb(at.to(ids.device))
    seed = derive_seed(model.config.seed, EMBEDDING_DROPOUT_SITE, step)
    return index_dropout(x, model.config.dropout, seed, training=model.training)


# The modules init_weights re-initialises completely; every other module keeps its constructor's.
INIT_TYPES = (nn.Linear, nn.Embedding)


def init_weights(module: nn.Module) -> None:
    """GPT-2's initialisation: normal(0, 0.02) weights, zero biases."""
    if isinstance(module, INIT_TYPES):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
