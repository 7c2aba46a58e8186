"""Reference for exercises/l08_sp_ops.py: the sequence-parallel operators."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from tpedu.comm import collectives


def _own_chunk(x: torch.Tensor, group: dist.ProcessGroup | None, dim: int) -> torch.Tensor:
    """Positions [r·s/t, (r+1)·s/t) of x along dim, contiguous."""
    t, r = dist.get_world_size(group), dist.get_rank(group)
    n = x.shape[dim] // t
    return x.narrow(dim, r * n, n).contiguous()


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _own_chunk(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return collectives.all_gather(grad.contiguous(), ctx.group, dim=ctx.dim), None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int, tp_grad: bool) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.tp_grad = group, dim, tp_grad
        return collectives.all_gather(x.contiguous(), group, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if ctx.tp_grad:  # each rank holds a partial dL/d(full): sum them, keep own positions
            grad = collectives.reduce_scatter(grad.contiguous(), ctx.group, ctx.dim)
        else:  # every rank's gradient is already complete
            grad = _own_chunk(grad, ctx.group, ctx.dim)
        return grad, None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return collectives.reduce_scatter(x.contiguous(), group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return collectives.all_gather(grad.contiguous(), ctx.group, dim=ctx.dim), None, None


def scatter_to_sp_region(
    x: torch.Tensor, group: dist.ProcessGroup | None = None, dim: int = 1
) -> torch.Tensor:
    return _Scatter.apply(x, group, dim)


def gather_from_sp_region(
    x: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    dim: int = 1,
    tensor_parallel_output_grad: bool = True,
) -> torch.Tensor:
    return _Gather.apply(x, group, dim, tensor_parallel_output_grad)


def reduce_scatter_to_sp_region(
    x: torch.Tensor, group: dist.ProcessGroup | None = None, dim: int = 1
) -> torch.Tensor:
    return _ReduceScatter.apply(x, group, dim)


def all_reduce_sequence_parallel_grads(
    params: Iterable[torch.nn.Parameter], group: dist.ProcessGroup | None = None
) -> None:
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])  # one buffer: one collective, one latency
    collectives.all_reduce(flat, group)
    for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(part.view_as(g))
