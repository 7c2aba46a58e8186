"""Reference for exercises/l03_conjugate_ops.py: the conjugate operators f and f̄."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tpedu.comm import collectives as C


class CopyToTPRegion(torch.autograd.Function):
    """f: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)  # a view: autograd records this node, nothing is copied

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # Every rank holds dL/dx through its own shard only; the true gradient is their sum.
        # Reduce a copy: autograd may hand the same gradient buffer to other nodes.
        grad = grad.contiguous().clone()
        C.all_reduce(grad, ctx.group)
        return grad, None  # one gradient per forward input: x, then group


class ReduceFromTPRegion(torch.autograd.Function):
    """f̄: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        out = x.contiguous().clone()  # all_reduce works in place; the caller's x stays as it was
        C.all_reduce(out, group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # The output is the same on every rank, so each partial sum receives the whole gradient.
        return grad, None
