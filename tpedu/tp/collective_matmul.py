"""Lesson 19: collective matmul: sequence parallelism's all-gather and reduce-scatter cut into
t ring steps, each step's message on the wire while the step's matmul runs (Wang et al. 2023,
"Overlap communication with dependent computation via decomposition"; Megatron-LM's and
torchtitan's async TP).

t ranks in a ring, each sends to its right neighbour (r+1) and receives from its left (r-1):

    all-gather ─► matmul  (column layer, x [b, s/t, H] -> y [b, s, out/t]):
        step k = 0 .. t-1: hold the shard of rank (r-k) mod t; send it right, receive the next
        from the left, and meanwhile multiply the held shard: its output rows land in their
        place, rows (r-k) mod t of the sequence.
    matmul ─► reduce-scatter  (row layer, x [b, s, in/t] -> y [b, s/t, out]):
        step k = 0 .. t-1: multiply own rows of chunk c = (r-k-1) mod t, add the partial sum
        received from the left, send it right; after step t-1 rank r holds chunk r summed over
        every rank (each rank adds its own term last).

Backward: of all-gather ─► matmul, a matmul ─► reduce-scatter ring for dL/dx, the shards of x
passed around the same ring meanwhile (saved is only the shard, as in
tpedu.tp.sequence_parallel), and dL/dW from the gathered shards in one matmul; of matmul ─►
reduce-scatter, an all-gather ─► matmul ring of dL/dy for dL/dx, and dL/dW from the gathered
dL/dy in one matmul.

Messages go through tpedu.comm.collectives.isend/irecv (traced as "send"/"recv", as
tpedu.comm.ring's): t-1 sends of s/t rows per ring, the bytes the all-gather or reduce-scatter
would send ((t-1)/t of the full tensor).

Exactness, against the sequence-parallel layers: the all-gather side computes the same products
(rows, or the gathered tensor's dL/dW), so the results are equal up to how the matmul kernel
rounds s/t rows instead of s (often bitwise; MKL picks kernels by shape); the reduce-scatter
side adds the t partial sums in the ring's order, not the library's: elementwise
|ring - library| ≤ (t-1)·eps·Σ_r |partial_r| (each order's error ≤ (t-1)·eps/2 of that sum).
dL/dW and dL/db are the same matmul on the same gathered tensor: bitwise. Measured (float64,
MKL, tests/test_collective_matmul.py): 30 of 36 layer products bitwise; the whole GPT's loss and
every gradient bitwise the SP model's at tp 1 and 2 (a sum of two terms has one order), within
1e-16 at tp 4.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpedu.comm import collectives as C
from tpedu.tp.chunked import attention_core, mlp_activation
from tpedu.tp.dense import OUTPUT_DROPOUT_SITE
from tpedu.tp.dropout import derive_seed
from tpedu.tp.sequence_parallel import SEQ_DIM, sequence_dropout


def _neighbours(group: dist.ProcessGroup | None) -> tuple[int, int, int, int]:
    """(rank in group, group size, global rank of the left neighbour, of the right one)."""
    rank, t = dist.get_rank(group), dist.get_world_size(group)

    def global_rank(r: int) -> int:
        return r if group is None else dist.get_global_rank(group, r)

    return rank, t, global_rank((rank - 1) % t), global_rank((rank + 1) % t)


class _Ring:
    """One ring exchange per call: post the sends and receives (even ranks send first, odd
    receive first, as tpedu.comm.ring, so NCCL cannot hang), `wait()` before reading."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.rank, self.t, self.left, self.right = _neighbours(group)
        self.works: list[Any] = []

    def post(self, sends: Sequence[torch.Tensor], recvs: Sequence[torch.Tensor]) -> None:
        ops = [(C.isend, s, self.right) for s in sends] + [(C.irecv, r, self.left) for r in recvs]
        if self.rank % 2:
            ops = ops[len(sends) :] + ops[: len(sends)]
        self.works = [op(buf, peer, self.group) for op, buf, peer in ops if buf.numel()]

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        self.works = []


def _rows(x: torch.Tensor, c: int, n: int) -> torch.Tensor:
    """Sequence chunk c (n positions) of x [b, s, ...]: a contiguous copy."""
    return x.narrow(SEQ_DIM, c * n, n).contiguous()


def ring_gather_apply(
    x: torch.Tensor,
    group: dist.ProcessGroup | None,
    fn: Callable[[torch.Tensor], list[torch.Tensor]],
) -> list[torch.Tensor]:
    """The all-gather ─► matmul ring: fn(shard of rank o) for every rank o, each computed while
    the next shard travels; returns, for each of fn's outputs, the t results concatenated along
    the sequence in rank order (rank o's rows in place o)."""
    ring = _Ring(group)
    r, t = ring.rank, ring.t
    outs: list[list[torch.Tensor]] = [[] for _ in range(t)]
    cur = x.contiguous()
    for k in range(t):
        if k < t - 1:
            nxt = torch.empty_like(cur)
            ring.post([cur], [nxt])
        outs[(r - k) % t] = fn(cur)  # while the next shard is on the wire
        if k < t - 1:
            ring.wait()
            cur = nxt
    return [torch.cat(parts, dim=SEQ_DIM) for parts in zip(*outs, strict=True)]


def ring_reduce_scatter_apply(
    group: dist.ProcessGroup | None,
    partial: Callable[[int], torch.Tensor],
    also: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The matmul ─► reduce-scatter ring: partial(c) is this rank's term of sequence chunk c;
    returns chunk r summed over the ranks (received sum + own term: own term last) and, with
    `also` (a shard passed along the same ring meanwhile), its gathered [b, s, ...]."""
    ring = _Ring(group)
    r, t = ring.rank, ring.t
    shards: list[torch.Tensor | None] = [None] * t
    cur = shards[r] = also.contiguous() if also is not None else None
    acc = recv = nxt = None
    for k in range(t):
        p = partial((r - k - 1) % t)  # while the previous step's messages travel
        if k > 0:
            ring.wait()
            acc = recv + p
            if also is not None:
                cur = shards[(r - k) % t] = nxt
        else:
            acc = p
        if k < t - 1:
            recv = torch.empty_like(acc)
            sends, recvs = [acc], [recv]
            if also is not None:
                nxt = torch.empty_like(cur)
                sends, recvs = [acc, cur], [recv, nxt]
            ring.post(sends, recvs)
    return acc, torch.cat(shards, dim=SEQ_DIM) if also is not None else None


class RingAllGatherLinear(torch.autograd.Function):
    """y_i = all_gather(x) · W_iᵀ + b_i by the ring, for weights sharing one input."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, n: int, *wb: torch.Tensor | None) -> Any:
        ctx.group, ctx.n = group, n
        ctx.has_bias = [b is not None for b in wb[n:]]
        ctx.save_for_backward(x, *wb[:n])  # the shard only
        pairs = list(zip(wb[:n], wb[n:], strict=True))
        return tuple(ring_gather_apply(x, group, lambda c: [F.linear(c, w, b) for w, b in pairs]))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        x, *weights = ctx.saved_tensors
        grads = [g.contiguous() for g in grads]
        weights = [w.to(grads[0].dtype) for w in weights]
        n = x.shape[SEQ_DIM]

        def partial(c: int) -> torch.Tensor:  # this rank's term of dL/dx for chunk c
            out = None
            for g, w in zip(grads, weights, strict=True):
                gx = _rows(g, c, n) @ w
                out = gx if out is None else out + gx
            return out

        grad_x, full = ring_reduce_scatter_apply(ctx.group, partial, x.to(grads[0].dtype))
        grad_w = [g.flatten(0, -2).T @ full.flatten(0, -2) for g in grads]
        grad_b = [
            g.flatten(0, -2).sum(0) if hb else None
            for g, hb in zip(grads, ctx.has_bias, strict=True)
        ]
        return grad_x, None, None, *grad_w, *grad_b


class RingLinearReduceScatter(torch.autograd.Function):
    """reduce_scatter(x · Wᵀ) along the sequence by the ring (no bias: add it after)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        ctx.save_for_backward(x, weight)
        t = dist.get_world_size(group)
        n = x.shape[SEQ_DIM] // t
        y, _ = ring_reduce_scatter_apply(group, lambda c: F.linear(_rows(x, c, n), weight))
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight = ctx.saved_tensors
        weight = weight.to(grad.dtype)
        # dL/dx row block by row block as dL/dy's shards come round; dL/dW from all of them
        grad_x, full = ring_gather_apply(grad, ctx.group, lambda g: [g @ weight, g])
        grad_w = full.flatten(0, -2).T @ x.to(grad.dtype).flatten(0, -2)
        return grad_x, grad_w, None


def ring_all_gather_linear(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None],
    group: dist.ProcessGroup | None = None,
) -> list[torch.Tensor]:
    """`tpedu.tp.sequence_parallel.all_gather_linear` by the ring: x [b, s/t, H] ->
    [b, s, out_i/t] for each weight [out_i/t, H]. Forward: t-1 sends of x's shard (= 1
    all-gather). Backward: t-1 sends of x's shard and t-1 of a dL/dx partial sum (= 1
    all-gather + 1 reduce-scatter). Saves x's shard only."""
    if len(weights) != len(biases):
        raise ValueError(f"got {len(weights)} weights but {len(biases)} biases (use None)")
    if x.shape[-1] != weights[0].shape[-1]:
        raise ValueError(
            f"input [..., {x.shape[-1]}] does not fit weight {tuple(weights[0].shape)}"
        )
    return list(RingAllGatherLinear.apply(x, group, len(weights), *weights, *biases))


def ring_linear_reduce_scatter(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """A sequence-parallel row layer by the ring: x [b, s, in/t], weight [out, in/t], bias
    [out] (added once, after the sum) -> [b, s/t, out]. Forward: t-1 sends of a partial sum
    (= 1 reduce-scatter). Backward: t-1 sends of dL/dy's shard (= 1 all-gather)."""
    y = RingLinearReduceScatter.apply(x, weight, group)
    return y + bias if bias is not None else y


def ring_attention_forward(attn: nn.Module, x: torch.Tensor, step: int = 0) -> torch.Tensor:
    """A sequence-parallel ParallelAttention's forward with both matmul collectives on the
    ring: x [b, s/t, H] -> [b, s/t, H]. QKV: ring all-gather ─► matmul; out: matmul ─► ring
    reduce-scatter. The layer's traffic, as t-1 sends per ring."""
    qkv = ring_all_gather_linear(x, [attn.qkv.weight], [attn.qkv.bias], attn.group)[0]
    out = attention_core(attn, qkv, step)
    return ring_linear_reduce_scatter(out, attn.out.weight, attn.out.bias, attn.group)


def ring_mlp_forward(mlp: nn.Module, x: torch.Tensor, step: int = 0) -> torch.Tensor:
    """A sequence-parallel ParallelMLP's forward on the ring: x [b, s/t, H] -> [b, s/t, H]
    (fc1, and SwiGLU's up, share one ring all-gather; fc2 one ring reduce-scatter), output
    dropout on the shard's slice of the dense mask."""
    layers = [mlp.fc1] if mlp.up is None else [mlp.fc1, mlp.up]
    pre = ring_all_gather_linear(x, [m.weight for m in layers], [m.bias for m in layers], mlp.group)
    y = ring_linear_reduce_scatter(
        mlp_activation(mlp, pre, step), mlp.fc2.weight, mlp.fc2.bias, mlp.group
    )
    seed = derive_seed(mlp.seed, OUTPUT_DROPOUT_SITE, step)
    return sequence_dropout(y, mlp.output_dropout, seed, mlp.group, mlp.training)
