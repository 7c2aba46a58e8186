"""Reference for exercises/l04_parallel_linear.py: column- and row-parallel linear forward."""

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
    # f in front: every rank's columns depend on all of x, so backward sums dL/dx over ranks.
    y = F.linear(copy_to_tp_region(x, group), weight, bias)  # [..., out/t]
    return gather_from_tp_region(y, group) if gather_output else y


def row_parallel_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    partial = F.linear(x, weight)  # [..., out], this rank's share of the sum
    y = reduce_from_tp_region(partial, group)
    # The bias after the sum: added to every partial it would be counted t times.
    return y if bias is None else y + bias
