"""Lesson 04 exercise: the forward of column- and row-parallel linear layers, given the shards.

Weights use nn.Linear's layout, weight [out, in], y = x·Wᵀ + b. With t = tp size, r = tp rank:
- column parallel: rank r holds rows [r·out/t, (r+1)·out/t) of W and the same slice of b;
- row parallel: rank r holds columns [r·in/t, (r+1)·in/t) of W and the FULL bias.

Use the conjugate operators from lesson 03 (tpedu.tp.operators: copy_to_tp_region,
reduce_from_tp_region, gather_from_tp_region) so backward is right and the tracer sees the
communication; F.linear does the local matmul.

    make grade EX=l04        # or: python -m tpedu.course.grading l04
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tpedu.tp.operators import copy_to_tp_region, gather_from_tp_region, reduce_from_tp_region


def column_parallel_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: dist.ProcessGroup | None = None,
    gather_output: bool = False,
) -> torch.Tensor:
    """This rank's output columns of x·Wᵀ + b.

    x [..., in] (the same on every rank), weight [out/t, in], bias [out/t] or None
    -> [..., out/t], or the full [..., out] (all ranks' columns in rank order) if gather_output.
    Forward: no communication (+1 all-gather if gather_output).
    Backward: 1 all-reduce of dL/dx, because every rank's columns depend on all of x.
    """
    raise NotImplementedError(
        "l04: write the column-parallel layer; hint: tpedu.grading.hint('l04', 1)"
    )


def row_parallel_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """x·Wᵀ + b from this rank's input columns.

    x [..., in/t] (this rank's chunk of the input features), weight [out, in/t], bias [out] or
    None (full, the same on every rank) -> [..., out], the same on every rank.
    Forward: 1 all-reduce of the partial products. Backward: no communication.
    """
    raise NotImplementedError(
        "l04: write the row-parallel layer; hint: tpedu.grading.hint('l04', 1)"
    )
