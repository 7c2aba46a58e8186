"""Lesson 09: Ulysses attention: all-to-all from sequence shards to head shards and back.

DeepSpeed-Ulysses' answer to the same problem as the ring. Each CP rank holds all heads of its
s/cp positions; one all-to-all each for q, k and v gives it all s positions of h/cp heads.
Heads are independent, so plain (flash) causal attention runs on them; one all-to-all of the
output brings each rank its positions again:

    q, k, v [b, h, s/cp, d] --all-to-all--> [b, h/cp, s, d] --attention--> --all-to-all--> [b, h, s/cp, d]

4 all-to-alls per layer forward (q, k, v, out), 4 backward (their gradients), each moving
(cp − 1)/cp of the tensor. The limit here: cp must divide the heads, query and KV, that TP leaves
on the rank (GQA with 2 KV heads allows cp ≤ 2). Replicating each KV head cp / n_kv times before
the all-to-all, as DeepSpeed-Ulysses does for GQA, would lift the KV limit; this module does not.
The ring has no such limit.
The gathered positions arrive in rank order; they are put in sequence order (any assignment,
contiguous or zig-zag) before the causal attention and back after it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tpedu.comm import collectives


def _seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """[b, h, s/cp, d] -> [b, h/cp, s, d], the gathered positions in rank order. 1 all-to-all."""
    t = dist.get_world_size(group)
    b, h, s, d = x.shape
    chunks = x.reshape(b, t, h // t, s, d).transpose(0, 1)  # chunk j: heads of rank j
    got = collectives.all_to_all(chunks, group)  # [t (source rank), b, h/t, s, d]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // t, t * s, d)


def _heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """[b, h/cp, s, d] (positions in rank order) -> [b, h, s/cp, d]. 1 all-to-all."""
    t = dist.get_world_size(group)
    b, hl, s, d = x.shape
    chunks = x.reshape(b, hl, t, s // t, d).permute(2, 0, 1, 3, 4)  # chunk j: rank j's positions
    got = collectives.all_to_all(chunks, group)  # [t (source rank: its heads), b, h/t, s/t, d]
    return got.transpose(0, 1).reshape(b, t * hl, s // t, d)


class SeqToHeads(torch.autograd.Function):
    """Forward: sequence shards -> head shards (1 all-to-all). Backward: the reverse."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _heads_to_seq(grad, ctx.group), None


class HeadsToSeq(torch.autograd.Function):
    """Forward: head shards -> sequence shards (1 all-to-all). Backward: the reverse."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _seq_to_heads(grad, ctx.group), None


def check_ulysses_heads(n_heads: int, n_kv_heads: int, cp: int) -> None:
    """Raise a ValueError naming the valid cp if it does not divide the rank's heads."""
    for what, n in (("query", n_heads), ("KV", n_kv_heads)):
        if n % cp:
            valid = [c for c in range(1, n + 1) if n_heads % c == 0 and n_kv_heads % c == 0]
            raise ValueError(
                f"Ulysses needs cp to divide the {what} heads on each rank: {n} % cp={cp} != 0; "
                f"use cp in {valid}, or ring attention (no such limit)"
            )


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Causal attention with the sequence split over `group`: q [b, nq, s/cp, d], k and v
    [b, nkv, s/cp, d] (positions[rank]), positions [cp, s/cp] -> [b, nq, s/cp, d]."""
    cp = dist.get_world_size(group)
    check_ulysses_heads(q.shape[1], k.shape[1], cp)
    order = positions.reshape(-1).to(q.device).argsort()  # rank order -> sequence order
    back = order.argsort()
    qh, kh, vh = (SeqToHeads.apply(t, group).index_select(2, order) for t in (q, k, v))
    groups = qh.shape[1] // kh.shape[1]
    if groups > 1:  # GQA: query head j uses KV head j // groups, on this rank as in the model
        kh, vh = kh.repeat_interleave(groups, 1), vh.repeat_interleave(groups, 1)
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
    return HeadsToSeq.apply(out.index_select(2, back), group)
