"""Lesson 19 exercise: all-gather ─► matmul as a ring (collective matmul, 集合矩阵乘).

Sequence parallelism all-gathers x [b, s/t, H] along the sequence, then multiplies the whole
[b, s, H] by this rank's column shard of a weight. Here the all-gather becomes t ring steps,
and each step multiplies the shard it holds while the next shard is on the wire.

The ring: t ranks of `group`, group-local rank r sends to (r+1) % t and receives from
(r-1) % t. send/recv take *global* ranks: translate with `dist.get_global_rank(group, r)`
(group=None is the world group: local == global). Use `C.isend` / `C.irecv` from
tpedu.comm.collectives (the tracer and the recorder see them), never an all-gather, and wait
for a step's messages only after that step's matmul.

    make grade EX=l19        # or: python -m tpedu.course.grading l19
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tpedu.comm import collectives as C


def ring_all_gather_matmul(
    x: torch.Tensor, weight: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """all_gather(x along dim 1) @ weightᵀ, by the ring -> [b, s, n].

    x: this rank's positions [b, s/t, H] (rank r holds rows r·s/t .. (r+1)·s/t of the
    sequence); weight: [n, H]. Step k = 0 .. t-1: this rank holds the shard of rank
    (r-k) mod t; if k < t-1, post the send of it to the right and the receive of the next
    from the left; multiply the held shard (its output rows go to place (r-k) mod t); then
    wait for the messages. t-1 sends of one shard each, nothing else. With t = 1: x @ weightᵀ.
    """
    raise NotImplementedError(
        "l19: write the ring all-gather matmul; hint: tpedu.grading.hint('l19', 1)"
    )
