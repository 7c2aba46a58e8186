"""Reference for exercises/l12_bucketed_allreduce.py: gradient buckets."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from tpedu.comm import collectives


def assign_buckets(numels: Sequence[int], bucket_numel: int) -> list[list[int]]:
    if bucket_numel < 1:
        raise ValueError(f"bucket_numel must be at least 1, got {bucket_numel}")
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i in reversed(range(len(numels))):  # backward finishes the last parameters first
        current.append(i)
        size += numels[i]
        if size >= bucket_numel:
            buckets.append(current)
            current, size = [], 0
    return buckets + [current] if current else buckets


def all_reduce_bucket(
    grads: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None
) -> list[torch.Tensor]:
    flat = torch.cat([g.reshape(-1) for g in grads])  # a new buffer: the inputs stay as they are
    collectives.all_reduce(flat, group)
    flat /= dist.get_world_size(group)
    out, offset = [], 0
    for g in grads:
        out.append(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
    return out
