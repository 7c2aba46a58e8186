"""Lesson 08 exercise: the sequence-parallel operators (序列并行的通信算子).

Activations are [b, s, H]; with t ranks in the group, rank r holds positions [r·s/t, (r+1)·s/t)
of the sequence dimension (`dim`, default 1). Write each operator as a torch.autograd.Function
(forward and backward conjugate) and return `YourFunction.apply(...)` from the function. Use
tpedu.comm.collectives (all_gather, reduce_scatter, all_reduce: they take `dim`) so the tracer sees
every byte. Then run `make grade EX=l08`; notebooks/08_sequence_parallelism.ipynb uses them through
`pick("l08_sp_ops")`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist


def scatter_to_sp_region(
    x: torch.Tensor, group: dist.ProcessGroup | None = None, dim: int = 1
) -> torch.Tensor:
    """x [b, s, H] (the same on every rank) -> this rank's chunk [b, s/t, H] along `dim`.

    Forward: no communication (keep chunk r, contiguous). Backward: all-gather the gradient
    along `dim` in rank order, so every rank gets dL/dx for the whole sequence.
    """
    raise NotImplementedError("l08: write the sequence scatter; hint: tpedu.grading.hint('l08', 1)")


def gather_from_sp_region(
    x: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    dim: int = 1,
    tensor_parallel_output_grad: bool = True,
) -> torch.Tensor:
    """g: this rank's chunk [b, s/t, H] -> the whole [b, s, H] on every rank (rank order).

    Forward: all-gather along `dim`. Backward: each rank holds a partial dL/d(full) (its heads'
    or columns' share) when tensor_parallel_output_grad is True: reduce-scatter it along `dim`
    (sum over ranks, keep own chunk). When False, every rank's gradient is already complete:
    keep own chunk, no communication.
    """
    raise NotImplementedError(
        "l08: write g, the sequence all-gather; hint: tpedu.grading.hint('l08', 1)"
    )


def reduce_scatter_to_sp_region(
    x: torch.Tensor, group: dist.ProcessGroup | None = None, dim: int = 1
) -> torch.Tensor:
    """ḡ: partial sums [b, s, H] (one per rank) -> this rank's chunk of their sum [b, s/t, H].

    Forward: reduce-scatter along `dim`. Backward: all-gather the gradient along `dim`.
    """
    raise NotImplementedError(
        "l08: write g-bar, the sequence reduce-scatter; hint: tpedu.grading.hint('l08', 1)"
    )


def all_reduce_sequence_parallel_grads(
    params: Iterable[torch.nn.Parameter], group: dist.ProcessGroup | None = None
) -> None:
    """Sum the gradients of `params` over the group, in place, with ONE all-reduce.

    These are parameters replicated on every rank but fed only this rank's positions (norm
    weights and biases, row-parallel biases): each rank's .grad covers s/t positions, the true
    gradient is the sum. Skip parameters whose .grad is None. Flatten all gradients into one
    buffer, all-reduce it once, copy the parts back.
    """
    raise NotImplementedError(
        "l08: sum the replicated gradients; hint: tpedu.grading.hint('l08', 1)"
    )
