"""Lesson 11: record a rank's timeline: compute between communication calls, and every call
as issued (the rank clocks; tpedu.analysis.clock replays them).

    with recorder.Recorder(recorder.run_id()) as rec:  # on every rank (run_id is collective)
        loss = model(x).sum(); loss.backward()
    logs = recorder.gather(rec.log)                    # every rank's log, on every rank

What one rank's log holds, in the order it happened:

    Compute  the work between two communication calls: wall time and this thread's CPU time
             (`time.thread_time`; one thread per rank, as the launcher sets, so that is this
             rank's work and not the other ranks' turns on the shared cores)
    Comm     a call of tpedu.comm.collectives: op, group (global ranks), bytes, peer of a send or
             receive, blocking or asynchronous, when it was issued and when it returned
    Wait     the `.wait()` on an asynchronous call's handle: when it began and ended
    Mark     a named instant (a step boundary), or one with data: `mark("free", "block 2",
             nbytes)` says what it is about and its bytes (ZeRO-3's buffers coming and going,
             which is no communication; the chunk a TP overlap's call belongs to)

Every wrapper in tpedu.comm.collectives is decorated with `timed` and calls `note`; with no
recorder active both return at once, as do `label` and `mark`, so recording off changes
nothing, bit for bit. On CUDA the CPU time is the launch, not the kernel: this recorder is for
CPU ranks (the replay's point is a laptop).
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

_active: list[Recorder] = []  # at most one: the recorder of this process (this rank)
_ranks: dict[int, tuple[int, ...]] = {}  # id(group) -> its global ranks


@dataclass
class Compute:
    """Work between two communication calls: wall seconds and this thread's CPU seconds."""

    name: str
    wall_start: float
    wall_end: float
    cpu: float


@dataclass
class Comm:
    """One call of tpedu.comm.collectives as this rank issued it.

    `group`: the global ranks of its process group; `nbytes`: the logical tensor (as the
    tracer counts it: all-gather the gathered output, reduce-scatter the full input); `peer`:
    a send's destination or a receive's source (global rank), else None; `seq`: this call's
    number among this rank's earlier calls on the same group (and peer, for sends/receives),
    which is how the replay matches it with the other ranks' calls."""

    op: str
    group: tuple[int, ...]
    group_name: str
    nbytes: int
    peer: int | None
    seq: int
    blocking: bool
    wall_start: float
    wall_end: float
    cpu: float = 0.0  # this thread's CPU time inside the call (copies, the backend's enqueue)


@dataclass
class Wait:
    """The wait on the asynchronous call at index `comm` of the log."""

    comm: int
    wall_start: float
    wall_end: float
    cpu: float = 0.0


@dataclass
class Mark:
    """A named instant, e.g. 'step 3'. `what` and `nbytes`, when given, say what it is about:
    a ZeRO buffer's 'gather' or 'free' (the buffer's name and size), a TP overlap's 'chunk'
    (whose call was just issued)."""

    name: str
    wall: float
    what: str = ""
    nbytes: int = 0


Span = Compute | Comm | Wait | Mark


@dataclass
class RankLog:
    """One rank's spans, in order. `run`: the id shared by the ranks of one recording."""

    rank: int
    run: str
    spans: list[Span] = field(default_factory=list)

    def comms(self) -> list[Comm]:
        return [s for s in self.spans if isinstance(s, Comm)]

    def compute_seconds(self) -> float:
        """CPU seconds of all compute spans."""
        return sum(s.cpu for s in self.spans if isinstance(s, Compute))


def run_id() -> str:
    """A fresh id, the same on every rank: rank 0's, broadcast (a collective of the world,
    outside the recorder). Outside a launched job: a fresh id."""
    ids = [uuid.uuid4().hex[:12]]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(ids, src=0)
    return ids[0]


class Recorder:
    """Records this rank's spans while entered (re-entering appends to the same log)."""

    def __init__(self, run: str = "local") -> None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.log = RankLog(rank, run)
        self._seq: dict[tuple, int] = {}
        self._depth = 0  # > 0 inside a timed call (wrappers may call each other)
        self._label = "compute"
        self._pending: tuple | None = None
        self._wall = self._cpu = 0.0

    def __enter__(self) -> Recorder:
        if _active:
            raise RuntimeError("a Recorder is already recording on this rank; stop it first")
        _active.append(self)
        self._restart()
        return self

    def __exit__(self, *exc: object) -> None:
        self._close()
        _active.remove(self)

    def mark(self, name: str, what: str = "", nbytes: int = 0) -> None:
        """A named instant, e.g. the start of a step (closes the compute span before it)."""
        self._close()
        self.log.spans.append(Mark(name, self._wall, what, nbytes))

    def _restart(self) -> None:
        self._wall, self._cpu = time.perf_counter(), time.thread_time()

    def _close(self, name: str | None = None) -> None:
        """End the compute span running since the last call (if any time passed)."""
        wall, cpu = time.perf_counter(), time.thread_time()
        if wall > self._wall:
            self.log.spans.append(Compute(name or self._label, self._wall, wall, cpu - self._cpu))
        self._wall, self._cpu = wall, cpu


def active() -> Recorder | None:
    """The recorder of this rank, or None when not recording."""
    return _active[0] if _active else None


def on() -> bool:
    """Whether this rank is recording (the collectives' cheap test)."""
    return bool(_active)


def mark(name: str, what: str = "", nbytes: int = 0) -> None:
    """This rank's recorder's `mark` (e.g. `mark("gather", "block 0", 1024)`); nothing when
    not recording."""
    if _active:
        _active[0].mark(name, what, nbytes)


class label:
    """`with label("F0"): ...`: the compute spans inside are named so (the pipeline's forwards
    and backwards, the TP overlap's weight gradient). Cheap when not recording."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        rec = active()
        if rec is not None:
            rec._close()
            self.before, rec._label = rec._label, self.name

    def __exit__(self, *exc: object) -> None:
        rec = active()
        if rec is not None and hasattr(self, "before"):
            rec._close()
            rec._label = self.before


def note(
    op: str, group: dist.ProcessGroup | None, name: str, nbytes: int, peer: int | None = None
) -> None:
    """Called by tpedu.comm.collectives inside a `timed` wrapper: what the call is."""
    if not _active or _active[0]._depth != 1 or _active[0]._pending is not None:
        return
    g = group if group is not None else dist.group.WORLD
    ranks = _ranks.get(id(g))
    if ranks is None:
        ranks = _ranks[id(g)] = tuple(dist.get_process_group_ranks(g))
    _active[0]._pending = (op, ranks, name, int(nbytes), peer)


def timed(fn: Callable) -> Callable:
    """Decorator of every wrapper in tpedu.comm.collectives: close the compute span before
    the call, log the call (what `note` said) and wrap an asynchronous call's handle so its
    wait is logged. Not recording: calls `fn` and nothing else."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not _active:
            return fn(*args, **kwargs)
        rec = _active[0]
        if rec._depth:
            return fn(*args, **kwargs)
        rec._close()
        rec._depth, rec._pending = 1, None
        try:
            out = fn(*args, **kwargs)
        finally:
            rec._depth = 0
        end, cpu = time.perf_counter(), time.thread_time() - rec._cpu
        pending, rec._pending = rec._pending, None
        if pending is not None:
            op, ranks, name, nbytes, peer = pending
            key = (ranks, peer, op) if op in ("send", "recv") else (ranks,)
            seq = rec._seq[key] = rec._seq.get(key, -1) + 1
            is_async = hasattr(out, "wait") and not isinstance(out, torch.Tensor)
            rec.log.spans.append(
                Comm(op, ranks, name, nbytes, peer, seq, not is_async, rec._wall, end, cpu)
            )
            if is_async:
                out = Handle(out, rec, len(rec.log.spans) - 1)
        rec._restart()
        return out

    return wrapper


class Handle:
    """An asynchronous call's work handle whose `wait()` is logged (once)."""

    def __init__(self, work: Any, rec: Recorder, index: int) -> None:
        self.work, self.rec, self.index = work, rec, index

    def wait(self, timeout: object = None) -> bool:
        rec = self.rec if active() is self.rec and self.index >= 0 else None
        if rec is not None:
            rec._close()
        out = self.work.wait() if timeout is None else self.work.wait(timeout)
        if rec is not None:
            end, cpu = time.perf_counter(), time.thread_time() - rec._cpu
            rec.log.spans.append(Wait(self.index, rec._wall, end, cpu))
            self.index = -1
            rec._restart()
        return out

    def is_completed(self) -> bool:
        return self.work.is_completed()


def gather(log: RankLog) -> list[RankLog]:
    """Every rank's log, in rank order, on every rank (all_gather_object over the world,
    outside the recorder). Call it on every rank, after recording."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [log]
    logs: list[RankLog | None] = [None] * dist.get_world_size()
    dist.all_gather_object(logs, log)
    return logs  # type: ignore[return-value]
