"""Lesson 03 exercise: the conjugate operators f and f̄ as autograd Functions.

    operator                   forward              backward
    f  = CopyToTPRegion        identity             all-reduce (sum) of the gradient
    f̄  = ReduceFromTPRegion    all-reduce (sum)     identity

Both are called as `CopyToTPRegion.apply(x, group)` (group None = all ranks). Communicate only
through `tpedu.comm.collectives` (C.all_reduce, in place) so the tracer sees your collectives, and
never with `x.register_hook(...)`: lesson 03 shows why hooks give wrong gradients.

    python -m tpedu.course.grading        # or: make grade
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tpedu.comm import collectives as C


class CopyToTPRegion(torch.autograd.Function):
    """f: enter a tensor-parallel region. x [...] (the same on every rank) -> x [...]."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        """Return x unchanged (no communication); remember `group` for backward."""
        raise NotImplementedError(
            "hint: store the group on ctx (ctx.group = group) and return x.view_as(x): "
            "a view, so autograd records this node without copying x"
        )

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        """grad [...] (this rank's dL/dx) -> (the sum of grad over the group's ranks, None)."""
        raise NotImplementedError(
            "hint: all-reduce a contiguous clone (grad.contiguous().clone()) with "
            "C.all_reduce(buf, ctx.group) and return (buf, None): one gradient per forward "
            "input, None for the group. Never modify grad itself in place."
        )


class ReduceFromTPRegion(torch.autograd.Function):
    """f̄: leave a tensor-parallel region. x [...] (a partial sum per rank) -> their sum [...]."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        """Return the sum of x over the group's ranks (1 all-reduce); x itself stays unchanged."""
        raise NotImplementedError(
            "hint: C.all_reduce works in place, so reduce a copy: "
            "out = x.contiguous().clone(); C.all_reduce(out, group); return out"
        )

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        """grad [...] (the same on every rank) -> (grad unchanged, None): no communication."""
        raise NotImplementedError(
            "hint: the output is replicated, so each rank's partial sum receives the whole "
            "gradient: return grad, None"
        )
