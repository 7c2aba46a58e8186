"""Lesson 08: sequence parallelism (序列并行, Korthikanti et al. 2022): the parts of a block that
tensor parallelism leaves replicated (LayerNorm, dropout, residual adds) run on sequence shards.

Activations are [b, s, H]; with t ranks, rank r holds positions [r·s/t, (r+1)·s/t) of the
sequence between the tensor-parallel regions. The conjugate operators (dim = the sequence dim):

    operator                      forward                             backward
    g   gather_from_sp_region         all-gather      [b,s/t,H] -> [b,s,H]  reduce-scatter
    ḡ   reduce_scatter_to_sp_region   reduce-scatter  [b,s,H] -> [b,s/t,H]  all-gather
        scatter_to_sp_region          keep own chunk                        all-gather

The names are Megatron-LM's (`gather_from_sequence_parallel_region`, ...) shortened as
tpedu.tp.operators shortens the TP ones (`sequence_parallel` -> `sp`, like
`tensor_model_parallel` -> `tp`); the autograd Functions behind them are public, as there.

One block under TP + SP (compare tpedu.model.gpt.TPBlock's f ... f̄):

    x [b, s/t, H] ─► LayerNorm ─► g ─► QKV ... out-proj ─► ḡ ─► dropout, + x ─► LayerNorm ─►
                     (shard)   all-gather  (heads split)  reduce-scatter  (shard)   (shard)
      g ─► fc1 ─► GELU ─► fc2 ─► ḡ ─► dropout, + ─► [b, s/t, H]

A ring all-reduce IS a reduce-scatter followed by an all-gather, so per layer the forward moves
the same bytes as plain TP; what changes is what sits in memory in between: shards.

`all_gather_linear` fuses g with the column-parallel matmul and saves only the input SHARD for
backward, all-gathering it again there (Megatron-LM does the same): without that, the gathered
[b, s, H] input of QKV and fc1 would stay in memory and the paper's sbh·34/t would not hold.

Parameters replicated over the TP group that see only a sequence shard (LayerNorm weights and
biases, the row-parallel biases added after ḡ, learned positions) get only their shard's share
of the gradient: `all_reduce_sequence_parallel_grads` must sum them after backward. Forgetting it
is a real, repeatedly reported bug (Megatron-LM #1446, gpt-neox #1257); lesson 08 shows it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpedu.comm import collectives
from tpedu.tp.dropout import index_dropout
from tpedu.tp.sharding import divisors, rank_chunk

SEQ_DIM = 1  # tpedu's activations are [b, s, H]


def check_sequence_length(s: int, tp: int) -> None:
    """Raise a ValueError naming s, tp and the valid tp values unless tp divides s."""
    if tp < 1 or s % tp:
        valid = ", ".join(str(d) for d in divisors(s))
        raise ValueError(
            f"sequence length s = {s} is not divisible by tp={tp}: sequence parallelism gives "
            f"each rank s/tp positions; use a sequence length that divides (tp values valid for "
            f"s = {s}: {valid}) or turn sequence_parallel off"
        )


def sequence_chunk(
    x: torch.Tensor, group: dist.ProcessGroup | None, dim: int = SEQ_DIM
) -> torch.Tensor:
    """Rank r's chunk of x along `dim`: [.., s, ..] -> [.., s/t, ..] (a contiguous copy)."""
    t, r = dist.get_world_size(group), dist.get_rank(group)
    check_sequence_length(x.shape[dim], t)
    return rank_chunk(x, dim, r, t).contiguous()


def sequence_offset(local_len: int, group: dist.ProcessGroup | None) -> int:
    """Where this rank's shard of `local_len` positions starts in the full sequence."""
    return dist.get_rank(group) * local_len


def sequence_dropout(
    x: torch.Tensor, p: float, seed: int, group: dist.ProcessGroup | None, training: bool = True
) -> torch.Tensor:
    """index_dropout of this rank's shard x [b, s/t, H]: the dense [b, s, H] mask's slice.

    The mask of an element is a hash of its index in the FULL tensor, so the sequence offset
    r·s/t is all a shard needs to drop exactly what the dense model drops. No communication.
    """
    b, n, h = x.shape
    t = dist.get_world_size(group)
    return index_dropout(x, p, seed, (b, n * t, h), (0, sequence_offset(n, group), 0), training)


class ScatterToSPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return sequence_chunk(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return collectives.all_gather(grad.contiguous(), ctx.group, dim=ctx.dim), None, None


class GatherFromSPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int, tp_grad: bool) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.tp_grad = group, dim, tp_grad
        return collectives.all_gather(x.contiguous(), group, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if ctx.tp_grad:  # every rank holds a partial dL/dx (its own heads / columns): sum them
            return (
                collectives.reduce_scatter(grad.contiguous(), ctx.group, ctx.dim),
                None,
                None,
                None,
            )
        return sequence_chunk(grad, ctx.group, ctx.dim), None, None, None  # already complete


class ReduceScatterToSPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return collectives.reduce_scatter(x.contiguous(), group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return collectives.all_gather(grad.contiguous(), ctx.group, dim=ctx.dim), None, None


def scatter_to_sp_region(
    x: torch.Tensor, group: dist.ProcessGroup | None = None, dim: int = SEQ_DIM
) -> torch.Tensor:
    """[b, s, H] (the same on every rank) -> this rank's [b, s/t, H].

    Forward: no communication (keep own chunk). Backward: 1 all-gather of the gradient.
    """
    return ScatterToSPRegion.apply(x, group, dim)


def gather_from_sp_region(
    x: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    dim: int = SEQ_DIM,
    tensor_parallel_output_grad: bool = True,
) -> torch.Tensor:
    """g: this rank's [b, s/t, H] -> the full [b, s, H] (rank order), on every rank.

    Forward: 1 all-gather. Backward: 1 reduce-scatter (the consumer is tensor-parallel, so each
    rank's gradient is a partial sum), or, with tensor_parallel_output_grad=False (the consumer
    is replicated and every rank's gradient is already complete), keep own chunk: no
    communication.
    """
    return GatherFromSPRegion.apply(x, group, dim, tensor_parallel_output_grad)


def reduce_scatter_to_sp_region(
    x: torch.Tensor, group: dist.ProcessGroup | None = None, dim: int = SEQ_DIM
) -> torch.Tensor:
    """ḡ: partial sums [b, s, H] -> this rank's chunk of their sum [b, s/t, H].

    Forward: 1 reduce-scatter. Backward: 1 all-gather of the gradient.
    """
    return ReduceScatterToSPRegion.apply(x, group, dim)


class AllGatherLinear(torch.autograd.Function):
    """y_i = all_gather(x) · W_iᵀ + b_i for several column-parallel weights sharing one input."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, n: int, *wb: torch.Tensor | None) -> Any:
        ctx.group, ctx.n = group, n
        ctx.has_bias = [b is not None for b in wb[n:]]
        ctx.save_for_backward(x, *wb[:n])  # the SHARD, not the gathered input
        full = collectives.all_gather(x.contiguous(), group, dim=SEQ_DIM)
        return tuple(F.linear(full, w, b) for w, b in zip(wb[:n], wb[n:], strict=True))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        x, *weights = ctx.saved_tensors
        # Recompute the all-gather instead of having kept [b, s, H] alive since the forward.
        # Under autocast the forward's matmuls ran in the gradients' dtype (bf16): these too.
        full = collectives.all_gather(x.contiguous(), ctx.group, dim=SEQ_DIM).to(grads[0].dtype)
        grad_full = None
        grad_w, grad_b = [], []
        for g, w, has_b in zip(grads, weights, ctx.has_bias, strict=True):
            gx = g @ w.to(g.dtype)
            grad_full = gx if grad_full is None else grad_full + gx
            grad_w.append(g.flatten(0, -2).T @ full.flatten(0, -2))
            grad_b.append(g.flatten(0, -2).sum(0) if has_b else None)
        grad_x = collectives.reduce_scatter(grad_full.contiguous(), ctx.group, SEQ_DIM)
        return grad_x, None, None, *grad_w, *grad_b


def all_gather_linear(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None],
    group: dist.ProcessGroup | None = None,
) -> list[torch.Tensor]:
    """g fused with column-parallel matmuls: x [b, s/t, H] -> [b, s, out_i/t] for each weight.

    weights[i] [out_i/t, H], biases[i] [out_i/t] or None (QKV: one weight; SwiGLU: gate and up).
    Forward: 1 all-gather. Backward: 1 all-gather (again: only the shard was saved) and
    1 reduce-scatter of dL/dx. Saves x's shard, never the gathered [b, s, H].
    """
    if len(weights) != len(biases):
        raise ValueError(f"got {len(weights)} weights but {len(biases)} biases (use None)")
    return list(AllGatherLinear.apply(x, group, len(weights), *weights, *biases))


def sequence_parallel_params(module: nn.Module) -> list[nn.Parameter]:
    """Parameters marked `p.sequence_parallel = True` (replicated, but fed a sequence shard)."""
    return [p for p in module.parameters() if getattr(p, "sequence_parallel", False)]


def mark_sequence_parallel(params: Iterable[nn.Parameter | None]) -> None:
    """Mark parameters whose gradient must be all-reduced over the TP group after backward."""
    for p in params:
        if p is not None:
            p.sequence_parallel = True


def all_reduce_sequence_parallel_grads(
    params: Iterable[nn.Parameter], group: dist.ProcessGroup | None = None
) -> None:
    """Sum the gradients of sequence-parallel parameters over the TP group, in place.

    One all-reduce of one flat buffer holding them all (coalesced: one latency, not one per
    LayerNorm). Call after backward, before clipping and the optimizer step, every step.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    collectives.all_reduce(flat, group)
    for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(part.view_as(g))
