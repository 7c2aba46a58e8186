"""Lesson 04: dense, single-process references: plain torch, no communication (DenseAttention
from lesson 05 on).

Every tensor-parallel module in tpedu is tested against (and built from) one of these: build the
dense module, shard it into the parallel one, and compare forward and backward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tpedu.tp.dropout import derive_seed, index_dropout
from tpedu.tp.rope import apply_rope

# ---------------------------------------------------------------------------------------------
# DenseMLP: the single-process reference for tpedu.tp.mlp.
# ---------------------------------------------------------------------------------------------

# Elementwise activations: each output element depends on its own input only, which is why a
# column-sharded hidden activation needs no communication (seed §2.2).
ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}
MLP_KINDS = (*ACTIVATIONS, "swiglu")

# Dropout call sites inside the MLP: seed = derive_seed(seed, site, step).
HIDDEN_DROPOUT_SITE, OUTPUT_DROPOUT_SITE = 1, 2


def check_activation(activation: str) -> None:
    """Raise a ValueError listing the supported activations unless `activation` is one."""
    if activation not in MLP_KINDS:
        raise ValueError(f"unknown activation {activation!r}; choose one of {', '.join(MLP_KINDS)}")


class DenseMLP(nn.Module):
    """fc1 -> activation -> [dropout] -> fc2 -> [dropout]: x [..., hidden] -> [..., hidden].

    activation="swiglu": down(silu(gate(x)) · up(x)) with fc1 = gate, `up`, fc2 = down.
    Dropout is `index_dropout` at offsets 0 (the whole tensor), seeded per site and step, so the
    tensor-parallel MLP (tpedu.tp.mlp.ParallelMLP) draws exactly the same masks.
    """

    def __init__(
        self,
        hidden: int,
        ffn_hidden: int,
        activation: str = "gelu",
        bias: bool = True,
        hidden_dropout: float = 0.0,
        output_dropout: float = 0.0,
        seed: int = 0,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_activation(activation)
        self.activation = activation
        self.hidden_dropout, self.output_dropout, self.seed = hidden_dropout, output_dropout, seed
        self.fc1 = nn.Linear(hidden, ffn_hidden, bias=bias, dtype=dtype)
        self.up = (
            nn.Linear(hidden, ffn_hidden, bias=bias, dtype=dtype)
            if activation == "swiglu"
            else None
        )
        self.fc2 = nn.Linear(ffn_hidden, hidden, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor, step: int = 0) -> torch.Tensor:
        """x [..., hidden] -> [..., hidden]; `step` selects this step's dropout masks."""
        if self.up is None:
            h = ACTIVATIONS[self.activation](self.fc1(x))
        else:
            h = F.silu(self.fc1(x)) * self.up(x)
        h = index_dropout(
            h,
            self.hidden_dropout,
            derive_seed(self.seed, HIDDEN_DROPOUT_SITE, step),
            training=self.training,
        )
        y = self.fc2(h)
        return index_dropout(
            y,
            self.output_dropout,
            derive_seed(self.seed, OUTPUT_DROPOUT_SITE, step),
            training=self.training,
        )


# ---------------------------------------------------------------------------------------------
# DenseAttention: the single-process reference for tpedu.tp.attention.
# ---------------------------------------------------------------------------------------------


# Dropout call site of the attention probabilities: seed = derive_seed(dropout_seed, site, step).
ATTENTION_DROPOUT_SITE = 3


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    fused: bool = True,
    dropout: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """softmax(q·kᵀ/√d, future masked if causal) · v: q, k, v [b, a, s, d] -> [b, a, s, d].

    `fused` and no `dropout`: F.scaled_dot_product_attention, a flash-attention kernel on CPU
    and GPU. It never stores the [b, a, s, s] scores or probabilities (lesson 10's 5·a·s²·b bytes
    drop out, as with selective recomputation) and runs ~2× faster than the explicit path on
    the benchmark model. Otherwise the explicit path below, whose every intermediate lesson 10
    counts, with `dropout` applied to the probabilities: a fused kernel draws its own mask, and
    tensor parallelism needs index_dropout's (each rank draws its heads' slice of the dense one).
    """
    if fused and dropout is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    s = q.shape[-2]
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if causal:
        future = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    probs = scores.softmax(dim=-1)
    return (probs if dropout is None else dropout(probs)) @ v


class DenseAttention(nn.Module):
    """Plain causal multi-head / grouped-query self-attention with a fused [q|k|v] projection.

    qkv: nn.Linear(H, (nq + 2·nkv)·d), rows [q heads | k heads | v heads]; out: nn.Linear(nq·d, H).
    x [b, s, H] -> [b, s, H]. Query head j uses KV head j // (nq/nkv). Dropout on the attention
    probabilities [b, nq, s, s] through tpedu.tp.dropout.index_dropout at offsets 0 (the whole
    tensor), seed derive_seed(dropout_seed, ATTENTION_DROPOUT_SITE, step): a tensor-parallel
    copy drawing its slice of the same mask matches it exactly.

    Many parameters because they are the layer's hyperparameters, as nn.MultiheadAttention's
    are.
    """

    def __init__(
        self,
        hidden: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        bias: bool = True,
        causal: bool = True,
        dropout_p: float = 0.0,
        dropout_seed: int = 0,
        dtype: torch.dtype | None = None,
        rope_theta: float | None = None,
        fused: bool = True,
    ) -> None:
        super().__init__()
        self.rope_theta = rope_theta  # None: no rotary embedding (positions are added elsewhere)
        self.fused = fused  # see attend()
        self.n_heads = n_heads
        self.n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads = {n_heads} is not a multiple of n_kv_heads = {self.n_kv_heads}"
            )
        if head_dim is None and hidden % n_heads:
            raise ValueError(f"hidden = {hidden} is not divisible by n_heads = {n_heads}")
        self.head_dim = hidden // n_heads if head_dim is None else head_dim
        self.causal, self.dropout_p, self.dropout_seed = causal, dropout_p, dropout_seed
        rows = (n_heads + 2 * self.n_kv_heads) * self.head_dim
        self.qkv = nn.Linear(hidden, rows, bias=bias, dtype=dtype)
        self.out = nn.Linear(n_heads * self.head_dim, hidden, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor, step: int = 0) -> torch.Tensor:
        """x [b, s, H] -> [b, s, H]; `step` selects this step's dropout mask."""
        b, s, _ = x.shape
        nq, nkv, d = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = self.qkv(x).split([nq * d, nkv * d, nkv * d], dim=-1)
        q = q.view(b, s, nq, d).transpose(1, 2)  # [b, nq, s, d]
        k = k.view(b, s, nkv, d).transpose(1, 2)
        if self.rope_theta is not None:
            q, k = apply_rope(q, self.rope_theta), apply_rope(k, self.rope_theta)
        k = k.repeat_interleave(nq // nkv, dim=1)
        v = v.view(b, s, nkv, d).transpose(1, 2).repeat_interleave(nq // nkv, dim=1)
        seed = derive_seed(self.dropout_seed, ATTENTION_DROPOUT_SITE, step)
        drop = lambda p: index_dropout(p, self.dropout_p, seed, training=self.training)
        drops = self.training and self.dropout_p > 0  # else attend() may use the fused kernel
        out = attend(q, k, v, self.causal, self.fused, drop if drops else None)
        return self.out(out.transpose(1, 2).reshape(b, s, nq * d))
