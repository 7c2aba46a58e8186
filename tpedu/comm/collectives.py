"""Lesson 02: thin, traced wrappers over `torch.distributed` collectives.

Every tensor-parallel module in tpedu communicates through these functions, so a `CommTracer`
sees every byte, and a rank clock (`tpedu.comm.recorder`, lesson 11) every call's place in time.
Each takes an optional process `group` (default: all ranks). Groups can be given readable names
with `name_group(group, "tp")`; the tracer reports them by name.

The gathering and scattering wrappers work along any dimension (tensor parallelism gathers the
last, sequence parallelism the sequence dimension); the dimension's size on every rank must be
equal, which is what the ring collectives require.

On gloo (CPU) in torch 2.13 every collective here is native, reduce-scatter and all-to-all
included; nothing is emulated.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from tpedu.comm import recorder, tracer

_group_names: dict[int, str] = {}


def name_group(group: dist.ProcessGroup | None, name: str) -> dist.ProcessGroup | None:
    """Give `group` a name for the tracer ('tp', 'dp', ...); returns the group."""
    _group_names[id(group if group is not None else dist.group.WORLD)] = name
    return group


def group_name(group: dist.ProcessGroup | None) -> str:
    """The name given by `name_group`, 'world' for the default group, else 'group<id>'."""
    g = group if group is not None else dist.group.WORLD
    if id(g) in _group_names:
        return _group_names[id(g)]
    return "world" if g is dist.group.WORLD else f"group{id(g) % 10000}"


@contextlib.contextmanager
def group_names_kept() -> Iterator[None]:
    """Inside: groups may be named; after, the names are those from before. For a process
    group that is torn down inside (a dry run's fake world): its groups' ids are reused by
    later objects, which would otherwise inherit their names."""
    before = dict(_group_names)
    try:
        yield
    finally:
        _group_names.clear()
        _group_names.update(before)


def own_group(name: str) -> dist.ProcessGroup:
    """A group of this launched rank alone, created by it alone (no collective), named `name`
    for the tracer: e.g. the EP group at ep = 1, so its all-to-alls trace as "ep"."""
    group = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    return name_group(group, name)


@contextlib.contextmanager
def this_rank_alone() -> Iterator[dist.ProcessGroup]:
    """A process group of this process only, to build a model's structure without talking to
    anyone: in a launched rank, a group of just this rank (created by it alone, no collective);
    elsewhere, a one-rank gloo world for the block, torn down after.

    A group, not None: the TP modules read their group's size and rank, so a structure built
    from them is the one that trains. Creating it still registers the group through the job's
    store, so the store must outlive every rank (tpedu.launcher keeps rank 0, its host, until
    all have returned; under torchrun the agent hosts it)."""
    if dist.is_initialized():
        yield dist.new_group([dist.get_rank()], use_local_synchronization=True)
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with group_names_kept():
            yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _trace(
    op: str, x: torch.Tensor, group: dist.ProcessGroup | None, numel: int, peer: int | None = None
) -> None:
    tracer.record(op, group_name(group), dist.get_world_size(group), numel, x.element_size())
    if recorder.on():  # lesson 11: the rank's timeline
        recorder.note(op, group, group_name(group), numel * x.element_size(), peer)


class CompletedWork:
    """The work handle of a collective that had nothing to do (a group of one rank)."""

    def wait(self, timeout: object = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


@recorder.timed
def all_reduce(
    x: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    op: dist.ReduceOp = dist.ReduceOp.SUM,
    async_op: bool = False,
) -> torch.Tensor | dist.Work:
    """Sum (or `op`) `x` over the group, in place. Returns `x`, or a work handle if async."""
    _trace("all_reduce", x, group, x.numel())
    if dist.get_world_size(group) == 1:  # nothing to combine; gloo would still take ~0.4 ms
        return CompletedWork() if async_op else x
    if async_op and not x.is_contiguous():
        raise ValueError("async all_reduce needs a contiguous tensor (it is reduced in place)")
    if x.is_contiguous():
        work = dist.all_reduce(x, op=op, group=group, async_op=async_op)
        return work if async_op else x
    buf = x.contiguous()
    dist.all_reduce(buf, op=op, group=group)
    return x.copy_(buf)


@recorder.timed
def all_gather(
    x: torch.Tensor, group: dist.ProcessGroup | None = None, dim: int = -1
) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, in rank order: [..., n, ...] -> [..., t·n, ...]."""
    t = dist.get_world_size(group)
    if t == 1:
        _trace("all_gather", x, group, x.numel())
        return x
    x = x.contiguous().reshape(1, *x.shape) if x.dim() == 0 else x.contiguous()
    # The flat layout every backend accepts: rank r's tensor is rows [r·n0, (r+1)·n0).
    out = torch.empty((t * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _trace("all_gather", x, group, out.numel())
    dist.all_gather_single(out, x, group=group)
    return torch.cat(out.chunk(t, dim=0), dim=dim)


@recorder.timed
def reduce_scatter(
    x: torch.Tensor, group: dist.ProcessGroup | None = None, dim: int = -1
) -> torch.Tensor:
    """Sum `x` over the group and keep this rank's chunk along `dim`: [.., t·n, ..] -> [.., n, ..]."""
    t = dist.get_world_size(group)
    _trace("reduce_scatter", x, group, x.numel())
    if t == 1:
        return x
    if x.shape[dim] % t:
        raise ValueError(
            f"reduce_scatter: dimension {dim} has size {x.shape[dim]}, not divisible by the "
            f"group size {t}; pad it or choose a size that divides"
        )
    chunks = x.chunk(t, dim=dim)
    flat = torch.cat(chunks, dim=0).contiguous()  # chunk r becomes rows [r·c0, (r+1)·c0)
    out = torch.empty(chunks[0].shape, dtype=x.dtype, device=x.device)
    dist.reduce_scatter_single(out, flat, group=group)
    return out


@recorder.timed
def all_gather_into(
    out: torch.Tensor,
    x: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> dist.Work | CompletedWork:
    """Flat all-gather into a given buffer: out[r·n : (r+1)·n] = rank r's x (n = x.numel()).
    ZeRO's: the buffer is where the parameters live. Returns a work handle (wait before use)."""
    _trace("all_gather", x, group, out.numel())
    if dist.get_world_size(group) == 1:
        out.copy_(x)
        return CompletedWork()
    work = dist.all_gather_single(out, x.contiguous(), group=group, async_op=async_op)
    return work if async_op else CompletedWork()


@recorder.timed
def reduce_scatter_into(
    out: torch.Tensor,
    x: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> dist.Work | CompletedWork:
    """Flat reduce-scatter: out = the sum over ranks of x[r·n : (r+1)·n] on rank r
    (n = out.numel(), x.numel() = t·n). Returns a work handle (wait before reading out)."""
    _trace("reduce_scatter", x, group, x.numel())
    if dist.get_world_size(group) == 1:
        out.copy_(x)
        return CompletedWork()
    work = dist.reduce_scatter_single(out, x.contiguous(), group=group, async_op=async_op)
    return work if async_op else CompletedWork()


@recorder.timed
def broadcast(x: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Copy global rank `src`'s `x` to every rank of the group, in place."""
    _trace("broadcast", x, group, x.numel())
    dist.broadcast(x, src=src, group=group)
    return x


@recorder.timed
def all_to_all(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Split `x` into t chunks along dim 0; chunk j goes to rank j; returns the received chunks."""
    t = dist.get_world_size(group)
    if x.shape[0] % t:
        raise ValueError(
            f"all_to_all: dimension 0 has size {x.shape[0]}, not divisible by the group size {t}"
        )
    x = x.contiguous()
    _trace("all_to_all", x, group, x.numel())
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


@recorder.timed
def all_to_all_variable(
    x: torch.Tensor,
    send_counts: Sequence[int],
    recv_counts: Sequence[int],
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """All-to-all of unequal chunks along dim 0: [Σ send_counts, ...] -> [Σ recv_counts, ...].

    Rows [Σ send_counts[:j], Σ send_counts[:j+1]) go to rank j; the rows received come in rank
    order. recv_counts[j] must be what rank j passes as send_counts[this rank] (exchange the
    counts first, with an all_to_all). Traced as an all_to_all of x, the rows kept on this rank
    included, as all_to_all counts them; this rank sends (Σ send_counts - send_counts[rank])
    rows (the tracer's wire bytes, (t-1)/t of x, assume equal chunks). One rank: a copy.
    """
    t = dist.get_world_size(group)
    send_counts, recv_counts = [int(c) for c in send_counts], [int(c) for c in recv_counts]
    if len(send_counts) != t or len(recv_counts) != t:
        raise ValueError(
            f"all_to_all_variable: {len(send_counts)} send and {len(recv_counts)} receive "
            f"counts for a group of {t} ranks; pass one count per rank"
        )
    if x.shape[0] != sum(send_counts):
        raise ValueError(
            f"all_to_all_variable: dimension 0 has size {x.shape[0]} but the send counts sum to "
            f"{sum(send_counts)}; they must be equal"
        )
    x = x.contiguous()
    _trace("all_to_all", x, group, x.numel())
    if t == 1:
        if recv_counts != send_counts:
            raise ValueError(
                f"all_to_all_variable on one rank: receives {recv_counts}, sends {send_counts}"
            )
        return x.clone()
    out = x.new_empty((sum(recv_counts), *x.shape[1:]))
    dist.all_to_all_single(
        out, x, output_split_sizes=recv_counts, input_split_sizes=send_counts, group=group
    )
    return out


@recorder.timed
def send(x: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None) -> None:
    """Blocking point-to-point send of `x` to global rank `dst`."""
    _trace("send", x, group, x.numel(), dst)
    dist.send(x.contiguous(), dst=dst, group=group)


@recorder.timed
def recv(x: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Blocking receive into `x` from global rank `src`; returns `x`."""
    _trace("recv", x, group, x.numel(), src)
    dist.recv(x, src=src, group=group)
    return x


@recorder.timed
def isend(x: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None) -> dist.Work:
    """Non-blocking send; call `.wait()` on the result before reusing `x`."""
    _trace("send", x, group, x.numel(), dst)
    return dist.isend(x, dst=dst, group=group)


@recorder.timed
def irecv(x: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> dist.Work:
    """Non-blocking receive into `x`; call `.wait()` before reading it."""
    _trace("recv", x, group, x.numel(), src)
    return dist.irecv(x, src=src, group=group)
