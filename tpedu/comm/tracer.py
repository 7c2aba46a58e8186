"""Lesson 02: record every collective that `tpedu.comm.collectives` runs: which group, which op,
how many bytes, and whether it ran in the forward or the backward pass.

    with CommTracer() as trace:
        loss = model(x).sum()
        loss.backward()
    print(trace.table())
    assert trace.count("all_reduce", phase="backward") == 1

Lessons use it to state communication *contracts* ("column-parallel forward: 0 collectives;
backward: 1 all-reduce of b·s·h elements") and to compare measured bytes with the formulas.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from tpedu.comm.volumes import ring_bytes

_active: list[CommTracer] = []
_phase_override: list[str] = []


@dataclass(frozen=True)
class CommRecord:
    """One collective call as seen by this rank.

    `numel`/`bytes` are the logical tensor (all-reduce: the tensor; all-gather: the gathered
    output; reduce-scatter: the full input); `wire_bytes` is what this rank sends under the ring
    algorithm (see `tpedu.comm.cost_model`).
    """

    op: str
    group: str
    group_size: int
    numel: int
    bytes: int
    wire_bytes: float
    phase: str


def current_phase() -> str:
    """'backward' inside an autograd backward pass, else 'forward' (or an explicit override)."""
    if _phase_override:
        return _phase_override[-1]
    return "backward" if torch._C._current_graph_task_id() != -1 else "forward"


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Label collectives run in this block, e.g. `with phase('optimizer'): ...`."""
    _phase_override.append(name)
    try:
        yield
    finally:
        _phase_override.pop()


def record(op: str, group: str, group_size: int, numel: int, itemsize: int) -> None:
    """Called by every wrapper in `tpedu.comm.collectives`; cheap when no tracer is active."""
    if not _active:
        return
    nbytes = numel * itemsize
    rec = CommRecord(
        op, group, group_size, numel, nbytes, ring_bytes(op, nbytes, group_size), current_phase()
    )
    for tracer in _active:
        tracer.records.append(rec)


class CommTracer:
    """Context manager collecting a `CommRecord` for each traced collective on this rank."""

    def __init__(self) -> None:
        self.records: list[CommRecord] = []

    def __enter__(self) -> CommTracer:
        _active.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _active.remove(self)

    def select(
        self, op: str | None = None, phase: str | None = None, group: str | None = None
    ) -> list[CommRecord]:
        """Records matching every filter given."""
        return [
            r
            for r in self.records
            if (op is None or r.op == op)
            and (phase is None or r.phase == phase)
            and (group is None or r.group == group)
        ]

    def count(
        self, op: str | None = None, phase: str | None = None, group: str | None = None
    ) -> int:
        """Number of calls matching the filters."""
        return len(self.select(op, phase, group))

    def numel(
        self, op: str | None = None, phase: str | None = None, group: str | None = None
    ) -> int:
        """Total logical elements of the matching calls."""
        return sum(r.numel for r in self.select(op, phase, group))

    def bytes(
        self, op: str | None = None, phase: str | None = None, group: str | None = None
    ) -> int:
        """Total logical bytes of the matching calls."""
        return sum(r.bytes for r in self.select(op, phase, group))

    def wire_bytes(
        self, op: str | None = None, phase: str | None = None, group: str | None = None
    ) -> float:
        """Total bytes this rank sent for the matching calls (ring algorithm)."""
        return sum(r.wire_bytes for r in self.select(op, phase, group))

    def summary(self) -> dict[tuple[str, str, str], tuple[int, int, int]]:
        """{(group, op, phase): (calls, elements, bytes)} in first-seen order."""
        out: dict[tuple[str, str, str], tuple[int, int, int]] = {}
        for r in self.records:
            calls, numel, nbytes = out.get((r.group, r.op, r.phase), (0, 0, 0))
            out[(r.group, r.op, r.phase)] = (calls + 1, numel + r.numel, nbytes + r.bytes)
        return out

    def table(self) -> str:
        """A fixed-width text table of `summary()` (deterministic: safe in notebook outputs)."""
        head = f"{'group':<8} {'op':<15} {'phase':<9} {'calls':>5} {'elements':>12} {'bytes':>12}"
        lines = [head, "-" * len(head)]
        for (group, op, ph), (calls, numel, nbytes) in self.summary().items():
            lines.append(f"{group:<8} {op:<15} {ph:<9} {calls:>5} {numel:>12,} {nbytes:>12,}")
        if not self.records:
            lines.append("(no collectives)")
        return "\n".join(lines)
