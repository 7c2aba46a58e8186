"""Lesson 11: a pipeline step's recorded or replayed timeline as the pipeline's Events, which
`plot_timeline` draws and `bubble_fraction` measures (tpedu.parallel.pipeline.schedules).

    events = [e for log in logs for e in recorded_events(log)]   # logs: recorder.gather
    bubble_fraction(events); plot_timeline(events)
    plot_timeline(replayed_events(replay.replay(logs, "free")))

run_schedule names each forward's and backward's compute spans F<micro-batch> or
B<micro-batch> (F<micro-batch>.<chunk> with several chunks); a TP collective inside one splits
it into several spans, which make one Event. A receive (its issue to the end of its wait) is a
'wait' Event; other spans are left out.
"""

from __future__ import annotations

import dataclasses

from tpedu.analysis.clock.replay import Timeline
from tpedu.comm.recorder import Comm, Compute, RankLog, Wait
from tpedu.parallel.pipeline.schedules import Event


def _parse(name: str) -> tuple[str, int, int] | None:
    """'F3' -> ('F', 3, 0), 'B2.1' -> ('B', 2, 1); None for any other name."""
    micro, _, chunk = name[1:].partition(".")
    if name[:1] in ("F", "B") and micro.isdigit() and (not chunk or chunk.isdigit()):
        return name[0], int(micro), int(chunk or 0)
    return None


def _add(out: list[Event], stage: int, name: str, start: float, end: float, last: str) -> str:
    """Append the span as an Event, or extend the last one if it continues it (the same F/B
    name, only calls in between); returns the name to continue next."""
    parts = _parse(name)
    if parts is None:
        return ""
    if name == last:
        out[-1] = dataclasses.replace(out[-1], end=end)
    else:
        out.append(Event(stage, *parts, start, end))
    return name


def recorded_events(log: RankLog, stage: int | None = None) -> list[Event]:
    """One rank's recorded step on the wall clock: its forwards, backwards and receive waits,
    as Events of pipeline stage `stage` (default: the log's rank)."""
    stage = log.rank if stage is None else stage
    out: list[Event] = []
    last = ""
    for s in log.spans:
        if isinstance(s, Compute):
            last = _add(out, stage, s.name, s.wall_start, s.wall_end, last)
        elif isinstance(s, Wait):
            issued = log.spans[s.comm]
            if isinstance(issued, Comm) and issued.op == "recv":
                out.append(Event(stage, "wait", -1, -1, issued.wall_start, s.wall_end))
                last = ""
    return out


def replayed_events(timeline: Timeline) -> list[Event]:
    """A replay's compute track as Events (stage = rank): forwards, backwards and waits."""
    out: list[Event] = []
    for r in timeline.ranks:
        last = ""
        for s in timeline.spans:
            if s.rank != r or s.track != "compute":
                continue
            if s.name.startswith("wait"):
                out.append(Event(r, "wait", -1, -1, s.start, s.end))
                last = ""
            else:
                last = _add(out, r, s.name, s.start, s.end, last)
    return out
