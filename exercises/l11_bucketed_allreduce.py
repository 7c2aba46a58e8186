"""Lesson 11 exercise: gradient buckets for data parallelism.

Run `make grade` (or `python -m tpedu.course.grading exercises l11_bucketed_allreduce`) to check.
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
        "hint: for i in reversed(range(len(numels))): add i; once the bucket's sum of numels "
        "reaches bucket_numel, start a new bucket; keep a non-empty last bucket"
    )


def all_reduce_bucket(
    grads: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None
) -> list[torch.Tensor]:
    """Average tensors of any shapes over `group` with exactly ONE all-reduce.

    Flatten them into one buffer (torch.cat of .reshape(-1)), call
    `tpedu.comm.collectives.all_reduce(buffer, group)` once, divide by the group size, and return the
    buffer cut back into tensors of the original shapes, in order. The inputs stay unchanged.
    """
    raise NotImplementedError(
        "hint: flat = torch.cat([g.reshape(-1) for g in grads]); all_reduce; flat /= world size; "
        "then slice flat[offset : offset + g.numel()].view_as(g) for each g"
    )
