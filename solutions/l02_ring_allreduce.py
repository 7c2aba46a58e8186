"""Reference for exercises/l02_ring_allreduce.py: a ring all-reduce from send/recv."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tpedu.comm import collectives as C


def _ring(group: dist.ProcessGroup | None) -> tuple[int, int, int, int]:
    """(my group rank, group size, global rank of my left neighbour, of my right one)."""
    r, t = dist.get_rank(group), dist.get_world_size(group)

    def global_rank(k: int) -> int:
        return k if group is None else dist.get_global_rank(group, k)

    return r, t, global_rank((r - 1) % t), global_rank((r + 1) % t)


def _exchange(
    send: torch.Tensor, recv: torch.Tensor, r: int, left: int, right: int, group: Any
) -> None:
    """Send right and receive from the left at once. Both are posted before either is waited
    on (a ring of blocking sends deadlocks); odd ranks post the receive first, which NCCL needs.
    Empty chunks (numel < t) are not sent: both ends know the sizes."""
    ops = [(C.isend, send, right), (C.irecv, recv, left)]
    if r % 2:
        ops.reverse()
    works = [op(buf, peer, group) for op, buf, peer in ops if buf.numel()]
    for w in works:
        w.wait()


def ring_reduce_scatter(chunks: list[torch.Tensor], group: dist.ProcessGroup | None = None) -> None:
    r, t, left, right = _ring(group)
    for s in range(t - 1):
        # Chunk k starts at rank k+1 and gains one addend per hop; after t-1 hops it is
        # complete on rank k.
        out, inc = (r - 1 - s) % t, (r - 2 - s) % t
        buf = torch.empty_like(chunks[inc])
        _exchange(chunks[out], buf, r, left, right, group)
        chunks[inc].add_(buf)


def ring_all_gather(chunks: list[torch.Tensor], group: dist.ProcessGroup | None = None) -> None:
    r, t, left, right = _ring(group)
    for s in range(t - 1):
        # Pass on what arrived last step (our own chunk at s = 0); store what arrives in place.
        _exchange(chunks[(r - s) % t], chunks[(r - 1 - s) % t], r, left, right, group)


def ring_all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    t = dist.get_world_size(group)
    if t == 1:
        return x
    buf = x if x.is_contiguous() else x.contiguous()
    chunks = list(buf.view(-1).tensor_split(t))  # views into buf: the ring writes buf itself
    ring_reduce_scatter(chunks, group)
    ring_all_gather(chunks, group)
    if buf is not x:
        x.copy_(buf)
    return x
