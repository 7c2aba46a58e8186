"""Lesson 03: the conjugate operators of tensor parallelism, as autograd Functions (seed §2.2).

Megatron-LM's insight: a tensor-parallel region needs communication only at its two edges, and
each edge's forward and backward are conjugate (what one does forward, the other does backward):

    operator                  forward                        backward
    f   copy_to_tp_region     identity                       all-reduce (sum) of the gradient
    f̄   reduce_from_tp_region all-reduce (sum)               identity
        scatter_to_tp_region  keep own chunk of last dim     all-gather last dim
        gather_from_tp_region all-gather last dim            keep own chunk of last dim

Why autograd Functions and not `x.register_hook(...)` in a module's forward: a hook is attached
to the *tensor*, once per forward call, and it sees the tensor's *total* gradient. Called on a
reused tensor (a leaf, a shared input) hooks pile up and the gradient is all-reduced again and
again; even once, it also all-reduces gradient that reached x through other, replicated paths
(a residual). A Function is a node in the graph: it acts on exactly the gradient flowing
through it, exactly once per use. Lesson 03 measures both failures.

All four take `group` (None = all ranks) and run their collective even at tp=1 (where it is a
no-op), so communication contracts read the same at every tp size.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tpedu.comm import collectives
from tpedu.tp.sharding import rank_chunk


def _own_chunk(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Rank r's chunk [..., n/t] of x [..., n] along the last dim (contiguous copy)."""
    t, r = dist.get_world_size(group), dist.get_rank(group)
    return rank_chunk(x, -1, r, t, "last dimension").contiguous()


class CopyToTPRegion(torch.autograd.Function):
    """f: forward identity; backward all-reduce (sum) of the gradient. Shapes unchanged."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        # x as it is (a view): every rank of the group uses all of it.
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # dL/dx is the sum over the group of each rank's part (each rank used all of x through
        # its own shard); a new tensor: autograd may hand `grad` to other nodes as well.
        grad = grad.contiguous().clone()
        collectives.all_reduce(grad, ctx.group)
        return grad, None


class ReduceFromTPRegion(torch.autograd.Function):
    """f̄: forward all-reduce (sum); backward identity. Shapes unchanged."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        out = x.contiguous().clone()  # all_reduce works in place: never overwrite the input
        collectives.all_reduce(out, group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # dL/dx: the output is the same on every rank, so is its gradient; each rank's partial
        # sum gets all of it, as it is.
        return grad, None


class ScatterToTPRegion(torch.autograd.Function):
    """Forward [..., n] -> [..., n/t] (keep own chunk); backward all-gather the last dim."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _own_chunk(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return collectives.all_gather(grad.contiguous(), ctx.group, dim=-1), None


class GatherFromTPRegion(torch.autograd.Function):
    """Forward [..., n/t] -> [..., n] (all-gather last dim); backward keep own chunk."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return collectives.all_gather(x.contiguous(), group, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _own_chunk(grad, ctx.group), None


def copy_to_tp_region(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """f: x [...] -> x [...]. Forward: no communication. Backward: 1 all-reduce of x's size."""
    return CopyToTPRegion.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """f̄: partial sums [...] -> their sum [...]. Forward: 1 all-reduce. Backward: none."""
    return ReduceFromTPRegion.apply(x, group)


def scatter_to_tp_region(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """[..., n] -> [..., n/t]. Forward: none (keep own chunk). Backward: 1 all-gather."""
    return ScatterToTPRegion.apply(x, group)


def gather_from_tp_region(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """[..., n/t] -> [..., n]. Forward: 1 all-gather (rank order). Backward: none (own chunk)."""
    return GatherFromTPRegion.apply(x, group)
