"""Lesson 02: a ring all-reduce built from send/recv alone: NCCL's ring algorithm.

t ranks stand in a ring; each sends only to its right neighbour and receives only from its left.
The tensor is cut into t chunks (uneven when its size does not divide by t) and reduced in two
phases of t-1 steps each:

    reduce-scatter: every step, each rank passes one chunk right and adds the chunk it receives
                    from the left into its own copy. After t-1 steps rank r holds chunk r summed
                    over all ranks.
    all-gather:     every step, each rank passes one finished chunk right and stores the one it
                    receives. After t-1 steps every rank holds every finished chunk.

Each step moves n/t elements per rank, so each rank sends 2(t-1)/t·n in total: nearly 2n, however
many ranks there are. That is why a ring all-reduce's time barely grows with t (bandwidth term),
while its 2(t-1) steps make the latency term grow linearly (the α-β model in tpedu.comm.cost_model).

Every message goes through `tpedu.comm.collectives.isend/irecv`, so a `CommTracer` counts the bytes.
`on_step` (optional, off by default) is called after every step with what moved and the chunks
as they now stand; lesson 02 draws the ring from it (tpedu.course.figures_basics).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from tpedu.comm import collectives as C

# on_step(phase, step, sent chunk index, received chunk index, chunks): phase is
# "reduce_scatter" or "all_gather"; chunks are this rank's live views (copy them to keep them).
StepHook = Callable[[str, int, int, int, list[torch.Tensor]], None]


def _ring_position(group: dist.ProcessGroup | None) -> tuple[int, int, int, int]:
    """(group-local rank, group size, global rank of left neighbour, global rank of right one)."""
    rank, t = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError(
            "this rank is not a member of the group it passed to the ring; call the ring only on "
            "the ranks of that group (dist.new_group returns a non-member placeholder elsewhere)"
        )

    def global_rank(r: int) -> int:
        # send/recv address peers by *global* rank, also on a subgroup.
        return r if group is None else dist.get_global_rank(group, r)

    return rank, t, global_rank((rank - 1) % t), global_rank((rank + 1) % t)


def _check_chunks(chunks: list[torch.Tensor], t: int, who: str) -> None:
    if len(chunks) != t:
        raise ValueError(
            f"{who}: got {len(chunks)} chunks for a group of {t} ranks; pass exactly "
            f"one chunk per rank (e.g. x.view(-1).tensor_split({t}))"
        )
    if any(not c.is_contiguous() for c in chunks):
        raise ValueError(f"{who}: chunks must be contiguous (split a flat view: x.view(-1))")


def _step(
    send: torch.Tensor,
    recv: torch.Tensor,
    rank: int,
    left: int,
    right: int,
    group: dist.ProcessGroup | None,
) -> None:
    """Send `send` to the right while receiving `recv` from the left.

    A ring where every rank first does a blocking send can deadlock: all ranks sit in send,
    nobody receives. So both messages are posted before waiting on either (gloo then moves them
    concurrently), and in even/odd order: even ranks post the send first, odd ranks the receive.
    On NCCL that order matters, since a rank's send and receive to one peer run one after the
    other on one stream (t = 2: rank 0 "send, recv" meets rank 1 "recv, send"); every rank posting
    its send first could hang there. Empty chunks (numel < t) are skipped on both ends: sender and
    receiver know the chunk sizes alike.
    """
    ops = [(C.isend, send, right), (C.irecv, recv, left)]
    if rank % 2:
        ops.reverse()
    works = [op(buf, peer, group) for op, buf, peer in ops if buf.numel()]
    for w in works:
        w.wait()


def ring_reduce_scatter(
    chunks: list[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    on_step: StepHook | None = None,
) -> None:
    """Ring reduce-scatter, in place: afterwards chunks[r] on rank r is the sum over all ranks.

    chunks: t contiguous tensors (this rank's data, cut into one piece per rank; sizes may differ
    by chunk but must be the same on every rank). Other chunks are left holding partial sums.
    Communication: t-1 steps; each sends one chunk right, receives one from the left.
    """
    rank, t, left, right = _ring_position(group)
    _check_chunks(chunks, t, "ring_reduce_scatter")
    for s in range(t - 1):
        # Step s: pass on chunk r-1-s (a partial sum over s+1 ranks), receive chunk r-2-s and add
        # ours to it. Chunk k starts at rank k+1 and ends, complete, at rank k after t-1 hops.
        out, inc = (rank - 1 - s) % t, (rank - 2 - s) % t
        buf = torch.empty_like(chunks[inc])
        _step(chunks[out], buf, rank, left, right, group)
        chunks[inc].add_(buf)
        if on_step is not None:
            on_step("reduce_scatter", s, out, inc, chunks)


def ring_all_gather(
    chunks: list[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    on_step: StepHook | None = None,
) -> None:
    """Ring all-gather, in place: chunks[r] of rank r is copied into chunks[r] on every rank.

    chunks: t contiguous tensors; on entry only chunks[rank] matters (others are overwritten).
    Communication: t-1 steps; each sends one chunk right, receives one from the left.
    """
    rank, t, left, right = _ring_position(group)
    _check_chunks(chunks, t, "ring_all_gather")
    for s in range(t - 1):
        # Step s: pass on chunk r-s (ours at s=0, then the one just received), receive chunk r-1-s
        # straight into place: nothing is added, so no buffer is needed.
        out, inc = (rank - s) % t, (rank - 1 - s) % t
        _step(chunks[out], chunks[inc], rank, left, right, group)
        if on_step is not None:
            on_step("all_gather", s, out, inc, chunks)


def ring_all_reduce(
    x: torch.Tensor, group: dist.ProcessGroup | None = None, on_step: StepHook | None = None
) -> torch.Tensor:
    """Sum `x` (any shape) over the ranks of `group`, in place, with send/recv only; returns `x`.

    Collective call: every rank of the group calls it with a tensor of the same shape and dtype.
    Communication: 2(t-1) steps, each rank sends 2(t-1)/t·numel elements (chunk sizes differ by at
    most one element when numel does not divide by t). Same result as `dist.all_reduce`, up to
    the order of the additions (chunk k is summed starting from rank k+1 around the ring).
    """
    t = dist.get_world_size(group)
    _ring_position(group)  # membership check, also at t == 1
    if t == 1:
        return x
    buf = x if x.is_contiguous() else x.contiguous()
    chunks = list(buf.view(-1).tensor_split(t))  # views: the ring works on x's own memory
    ring_reduce_scatter(chunks, group, on_step)
    ring_all_gather(chunks, group, on_step)
    if buf is not x:
        x.copy_(buf)
    return x
