"""Lesson 03 exercise: the conjugate operators f and f̄ as autograd Functions.

    operator                   forward              backward
    f  = CopyToTPRegion        identity             all-reduce (sum) of the gradient
    f̄  = ReduceFromTPRegion    all-reduce (sum)     identity

Both are called as `CopyToTPRegion.apply(x, group)` (group None = all ranks). Communicate only
through `tpedu.comm.collectives` (C.all_reduce, in place) so the tracer sees your collectives, and
never with `x.register_hook(...)`: lesson 03 shows why hooks give wrong gradients.

    make grade EX=l03        # or: python -m tpedu.course.grading l03
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
        raise NotImplementedError("l03: write f's forward; hint: tpedu.grading.hint('l03', 1)")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        """grad [...] (this rank's dL/dx) -> (the sum of grad over the group's ranks, None)."""
        raise NotImplementedError("l03: write f's backward; hint: tpedu.grading.hint('l03', 1)")


class ReduceFromTPRegion(torch.autograd.Function):
    """f̄: leave a tensor-parallel region. x [...] (a partial sum per rank) -> their sum [...]."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        """Return the sum of x over the group's ranks (1 all-reduce); x itself stays unchanged."""
        raise NotImplementedError("l03: write f-bar's forward; hint: tpedu.grading.hint('l03', 1)")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        """grad [...] (the same on every rank) -> (grad unchanged, None): no communication."""
        raise NotImplementedError("l03: write f-bar's backward; hint: tpedu.grading.hint('l03', 1)")
