"""Lesson 02 exercise: a ring all-reduce from point-to-point messages.

Write the two phases, then combine them. Use only `C.isend` / `C.irecv` (or `C.send` / `C.recv`)
from tpedu.comm.collectives, so the tracer can count your bytes; no `dist.all_reduce`.

The ring: t ranks of `group`, group-local rank r sends to (r+1) % t and receives from (r-1) % t.
send/recv take *global* ranks: translate with `dist.get_global_rank(group, r)` (group=None is the
world group: local == global).

    make grade EX=l02        # or: python -m tpedu.course.grading l02
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tpedu.comm import collectives as C


def ring_reduce_scatter(chunks: list[torch.Tensor], group: dist.ProcessGroup | None = None) -> None:
    """Ring reduce-scatter, in place: afterwards chunks[r] on rank r is the sum over all ranks.

    chunks: t contiguous 1-D tensors, this rank's data cut into one piece per rank (sizes may
    differ from chunk to chunk, e.g. 11 elements on 3 ranks -> 4, 4, 3; the same on every rank).
    Run t-1 steps; in each, every rank sends one chunk to the right and adds the chunk it receives
    from the left into its own copy of that chunk. Other chunks may end holding partial sums.
    """
    raise NotImplementedError(
        "l02: write the ring reduce-scatter; hint: tpedu.grading.hint('l02', 1)"
    )


def ring_all_gather(chunks: list[torch.Tensor], group: dist.ProcessGroup | None = None) -> None:
    """Ring all-gather, in place: chunks[r] of rank r is copied into chunks[r] on every rank.

    chunks: t contiguous 1-D tensors; on entry only chunks[rank] matters, the others are
    overwritten. Run t-1 steps; in each, every rank sends one chunk right and receives one from
    the left.
    """
    raise NotImplementedError("l02: write the ring all-gather; hint: tpedu.grading.hint('l02', 1)")


def ring_all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum `x` (any shape, any numel, also not contiguous) over the group's ranks, in place.

    Returns `x`. Each rank must send 2(t-1)/t·numel elements in total (±2 when numel does not
    divide by t). With one rank there is nothing to do.
    """
    raise NotImplementedError("l02: combine the two phases; hint: tpedu.grading.hint('l02', 1)")
