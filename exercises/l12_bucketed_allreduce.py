"""Lesson 12 exercise: gradient buckets for data parallelism.

Run `make grade EX=l12_bucketed_allreduce` (or
`python -m tpedu.course.grading l12_bucketed_allreduce`) to check.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


def assign_buckets(numels: Sequence[int], bucket_numel: int) -> list[list[int]]:
    """Group parameters (given by their element counts, in model order) into buckets.

    Walk from the LAST parameter to the first (backward produces gradients roughly in that
    order) and append each index to the current bucket; close the bucket as soon as it holds
    ≥ bucket_numel elements. A final, smaller bucket keeps whatever is left.
    numels [7, 3, 5, 2], bucket_numel 6 -> [[3, 2], [1, 0]].
    bucket_numel < 1 -> ValueError("bucket_numel must be at least 1, got ...").
    """
    raise NotImplementedError(
        "l12_bucketed_allreduce: group the parameters into buckets; hint: tpedu.grading.hint('l12_bucketed_allreduce', 1)"
    )


def all_reduce_bucket(
    grads: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None
) -> list[torch.Tensor]:
    """Average tensors of any shapes over `group` with exactly ONE all-reduce.

    Returns new tensors of the inputs' shapes, in order, each the mean over the group's ranks;
    the inputs stay unchanged. Communicate through `tpedu.comm.collectives` (the tests count the
    calls).
    """
    raise NotImplementedError(
        "l12_bucketed_allreduce: average one bucket; hint: tpedu.grading.hint('l12_bucketed_allreduce', 1)"
    )
