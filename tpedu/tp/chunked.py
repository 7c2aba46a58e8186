"""Lesson 19: hide a block's TP all-reduces by cutting the batch into chunks (seed §3.3;
DeepSpeed's Domino, arXiv 2409.15241).

Rows of a batch are independent until a weight sees them all, so a block can run as n chunks of
b/n sequences each, and chunk i's all-reduce can be on the wire while chunk i+1 computes:

    forward, attention half then MLP half (each: norm ─► f ─► column ─► ... ─► row ─► f̄):
        for i: partial_i = row layer's partial product of chunk i;  issue all-reduce, async
        for i: wait(i); + bias, dropout, residual                    (chunk i+1 computed meanwhile)
    backward (autograd runs the ready node created last first), each half:
        for i = n-1 .. 0: column layer's dL/dx_i, issue its all-reduce (f), async
        for i = n-1 .. 0: wait(i) in the `wait_grad` node in front of f, then the norm

The waits are autograd nodes of their own: `wait_grad(x)` sits in front of f, so its backward
(which waits) runs strictly after f's (which issues) on any schedule: correct on every order;
the order above (the wait nodes are created before any chunk's compute, so they run after every
chunk's) is what makes it overlap, and the rank clock (tpedu.comm.recorder) shows it. Per
half-block the last chunk's all-reduce stays exposed: (n-1)/n of the traffic can hide. Same collectives as the
unsplit block, n times as many, each 1/n the size.

What is equal to what: elementwise ops, norms and dropout masks (index_dropout at the chunk's
batch offset) are the unsplit block's; a matmul over b/n rows may round differently from one
over b rows (MKL picks kernels by shape), weight gradients become a sum of n chunk products,
and the all-reduces add the same t terms in a size-dependent order (bitwise at t = 2). So:
float64 within 1e-12 of the unsplit and dense block, not bitwise in general (measured,
tests/test_tp_overlap_chunks.py: worst 1.4e-16; 1 of 28 gradient tensors bitwise).

With context parallelism (positions given) each chunk's attention core is the block's CP
attention (ring or Ulysses, tpedu.cp) over the CP group on its b/n sequences: chunks cut the
batch, CP the sequence, so the two are independent. Every rank builds the same graph, so each
group (TP, CP) sees its collectives in the same order on all its ranks, forward and backward.

With a mixture of experts only the attention half is chunked: the MoE half runs on the whole
batch, as in the unsplit block, because the router's load-balancing loss and each expert's
capacity (which tokens are dropped) are computed over all the block's tokens; chunking them
would change the model, not just the schedule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tpedu.comm import collectives, recorder
from tpedu.tp.dense import (
    ACTIVATIONS,
    ATTENTION_DROPOUT_SITE,
    HIDDEN_DROPOUT_SITE,
    OUTPUT_DROPOUT_SITE,
    attend,
)
from tpedu.tp.dropout import derive_seed, index_dropout
from tpedu.tp.rope import apply_rope


class Pending:
    """One chunk's collective in flight: its work handle between issue and wait."""

    def __init__(self, chunk: int, what: str) -> None:
        self.chunk, self.what, self.work = chunk, what, None

    def start(self, work: Any) -> None:
        self.work = work
        recorder.mark("chunk", f"{self.what}{self.chunk}")  # names the call just issued

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None


class IssueAllReduce(torch.autograd.Function):
    """f̄ issued, not waited: forward all-reduces a copy asynchronously (read it after
    pending.wait()); backward identity."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, pending: Pending) -> torch.Tensor:
        out = x.contiguous().clone()
        pending.start(collectives.all_reduce(out, group, async_op=True))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


class AsyncCopyToTPRegion(torch.autograd.Function):
    """f with an async backward: forward identity; backward issues the all-reduce of dL/dx
    and returns the buffer; `WaitGrad` in front of it waits before anyone reads it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, pending: Pending) -> torch.Tensor:
        ctx.group, ctx.pending = group, pending
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad.contiguous().clone()
        ctx.pending.start(collectives.all_reduce(grad, ctx.group, async_op=True))
        return grad, None, None


class WaitGrad(torch.autograd.Function):
    """Identity forward; backward waits for `pending` (the all-reduce of this gradient)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, pending: Pending) -> torch.Tensor:
        ctx.pending = pending
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.pending.wait()
        return grad, None


def attention_core(
    attn: nn.Module,
    qkv: torch.Tensor,
    step: int,
    b0: int = 0,
    batch: int | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """A ParallelAttention's heads on qkv [b, s, (nq/t + 2·nkv_r)·d] -> [b, s, nq/t·d], for
    sequences b0 .. b0+b of a batch of `batch` (dropout draws that slice of the dense mask).
    No TP communication. Selective recomputation (attn.recompute_core) as in the layer.
    `positions` [cp, s] (context parallelism; s: this rank's positions): RoPE at the global
    positions and the core is attn.context_core (CP's ring sends or all-to-alls, forward and
    backward), as in ParallelAttention.forward."""
    nq, nkv, d = len(attn.q_heads), len(attn.kv_heads), attn.head_dim
    b, s, _ = qkv.shape
    q, k, v = qkv.split([nq * d, nkv * d, nkv * d], dim=-1)
    q = q.view(b, s, nq, d).transpose(1, 2)  # [b, nq/t, s, d]
    k = k.view(b, s, nkv, d).transpose(1, 2)
    v = v.view(b, s, nkv, d).transpose(1, 2)
    mine = attn.local_positions(positions)
    if attn.rope_theta is not None:
        q, k = apply_rope(q, attn.rope_theta, mine), apply_rope(k, attn.rope_theta, mine)
    if positions is not None:  # CP refuses dropout, and its core keeps its own activations
        return attn.context_core(q, k, v, positions)
    batch = b if batch is None else batch

    def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if nq != nkv:
            k = k.repeat_interleave(nq // nkv, dim=1)
            v = v.repeat_interleave(nq // nkv, dim=1)
        seed = derive_seed(attn.dropout_seed, ATTENTION_DROPOUT_SITE, step)
        shape, offsets = (batch, attn.n_heads, s, s), (b0, attn.q_heads[0], 0, 0)
        drop = lambda p: index_dropout(p, attn.dropout_p, seed, shape, offsets, attn.training)
        drops = attn.training and attn.dropout_p > 0
        out = attend(q, k, v, attn.causal, attn.fused, drop if drops else None)
        return out.transpose(1, 2).reshape(b, s, nq * d)

    if attn.recompute_core and torch.is_grad_enabled():
        return checkpoint(core, q, k, v, use_reentrant=False)
    return core(q, k, v)


def mlp_activation(
    mlp: nn.Module, pre: list[torch.Tensor], step: int, b0: int = 0, batch: int | None = None
) -> torch.Tensor:
    """A ParallelMLP's activation of its column outputs ([fc1's], or SwiGLU's [gate, up]), each
    [b, s, F/t] -> the row layer's input [b, s, F/t], hidden dropout at batch offset b0 of a
    batch of `batch`. No communication."""
    a = ACTIVATIONS[mlp.activation](pre[0]) if mlp.up is None else F.silu(pre[0]) * pre[1]
    if mlp.training and mlp.hidden_dropout > 0:
        n = mlp.ffn_hidden // mlp.tp
        batch = a.shape[0] if batch is None else batch
        a = index_dropout(
            a,
            mlp.hidden_dropout,
            derive_seed(mlp.seed, HIDDEN_DROPOUT_SITE, step),
            global_shape=(batch, *a.shape[1:-1], mlp.ffn_hidden),
            offsets=(b0, *[0] * (a.dim() - 2), mlp.rank * n),
        )
    return a


def mlp_hidden(
    mlp: nn.Module, h: torch.Tensor, step: int, b0: int = 0, batch: int | None = None
) -> torch.Tensor:
    """A ParallelMLP's column half on h [b, s, H] (already behind f) -> [b, s, F/t]."""
    layers = [mlp.fc1] if mlp.up is None else [mlp.fc1, mlp.up]
    return mlp_activation(mlp, [F.linear(h, m.weight, m.bias) for m in layers], step, b0, batch)


def _half(
    normed: list[torch.Tensor],
    partial: Callable[[torch.Tensor, int], torch.Tensor],
    bias: torch.Tensor | None,
    group: dist.ProcessGroup | None,
) -> list[torch.Tensor]:
    """One half-block on every chunk: f (async backward) ─► partial ─► f̄ (async forward).

    The wait nodes are created before any chunk's compute, so backward reaches them only after
    every chunk's f has issued its all-reduce (see the module docstring)."""
    grads = [Pending(i, "grad ") for i in range(len(normed))]
    waits = [WaitGrad.apply(h, p) for h, p in zip(normed, grads, strict=True)]
    issued = []
    for i, (h, p) in enumerate(zip(waits, grads, strict=True)):
        y = partial(AsyncCopyToTPRegion.apply(h, group, p), i)
        pending = Pending(i, "")
        issued.append((IssueAllReduce.apply(y, group, pending), pending))
    out = []
    for y, pending in issued:
        pending.wait()
        out.append(y + bias if bias is not None else y)
    return out


def chunked_block(
    x: torch.Tensor,
    step: int,
    chunks: int,
    block: nn.Module,
    attention_dropout_seed: int,
    positions: torch.Tensor | None = None,
    moe: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """A TPBlock (norm1, attn, norm2, mlp, p) on x [b, s, H] as `chunks` batch chunks ->
    [b, s, H]. Per half-block and chunk: forward 1 all-reduce of b/n·s·H (async), backward 1
    (async): the unsplit block's traffic in n pieces. chunks must divide b.
    `positions` [cp, s] (context parallelism): each chunk's attention core is the CP attention,
    its CP communication per chunk on b/n sequences. `moe` (a mixture of experts: the block's
    norm2 ─► MoE output, x [b, s, H] -> [b, s, H]): the MLP half runs once on the whole batch,
    its collectives the unsplit block's."""
    b, s, h = x.shape
    if chunks < 1 or b % chunks:
        raise ValueError(
            f"tp_chunks = {chunks} does not divide the micro-batch of {b} sequences; choose a "
            f"divisor of {b}"
        )
    attn, mlp, n = block.attn, block.mlp, b // chunks
    xs = list(x.split(n))
    offs = [i * n for i in range(chunks)]

    def attention(hc: torch.Tensor, i: int) -> torch.Tensor:
        qkv = F.linear(hc, attn.qkv.weight, attn.qkv.bias)
        return F.linear(attention_core(attn, qkv, step, offs[i], b, positions), attn.out.weight)

    def mlp_partial(hc: torch.Tensor, i: int) -> torch.Tensor:
        return F.linear(mlp_hidden(mlp, hc, step, offs[i], b), mlp.fc2.weight)

    group = attn.group
    a = _half([block.norm1(c) for c in xs], attention, attn.out.bias, group)
    xs = [
        c + index_dropout(ac, block.p, attention_dropout_seed, (b, s, h), (o, 0, 0), block.training)
        for c, ac, o in zip(xs, a, offs, strict=True)
    ]
    if moe is not None:  # routing and capacity over the whole batch: not chunked
        x = torch.cat(xs)
        return x + moe(x)
    m = _half([block.norm2(c) for c in xs], mlp_partial, mlp.fc2.bias, group)
    seed = derive_seed(mlp.seed, OUTPUT_DROPOUT_SITE, step)
    return torch.cat(
        [
            c + index_dropout(mc, mlp.output_dropout, seed, (b, s, h), (o, 0, 0), mlp.training)
            for c, mc, o in zip(xs, m, offs, strict=True)
        ]
    )
