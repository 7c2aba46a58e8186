"""Lesson 11: write the recorded and replayed timelines as a Chrome trace (the Trace Event Format the
PyTorch profiler exports), which chrome://tracing and https://ui.perfetto.dev open.

    trace.write("step.json", logs, link="loopback")

One process per rank and clock: "rank r · measured" (wall clock here, every rank sharing this
machine's cores) and "rank r · replayed" (a core per rank, the link named), each with a track
for compute and one for communication. Complete events ("ph": "X") with microsecond timestamps
from the run's first span; steps are instant events ("ph": "i").
"""

from __future__ import annotations

import json
from pathlib import Path

from tpedu.analysis.clock.replay import Timeline, check_logs, replay
from tpedu.comm.cost_model import AlphaBeta
from tpedu.comm.recorder import Comm, Compute, Mark, RankLog, Wait

COMPUTE, COMM = 0, 1  # the tracks (tid) of every process
REPLAYED = 1000  # pid offset of the replayed processes


def check_path(path: str | Path) -> Path:
    """Raise a one-line ValueError if a trace cannot be written at `path` (before any rank
    starts: a missing directory or a directory given as the file)."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"trace {path} is a directory; give a file name, e.g. {path}/trace.json")
    if not path.parent.is_dir():
        raise ValueError(
            f"trace {path}: directory {path.parent} does not exist; create it or give another path"
        )
    return path


def _meta(pid: int, name: str, sort: int) -> list[dict]:
    out = [
        {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}},
        {
            "name": "process_sort_index",
            "ph": "M",
            "pid": pid,
            "tid": 0,
            "args": {"sort_index": sort},
        },
    ]
    for tid, track in ((COMPUTE, "compute"), (COMM, "communication")):
        out.append(
            {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": track}}
        )
    return out


def _x(name: str, pid: int, tid: int, start: float, end: float, **args: object) -> dict:
    """A complete event; start/end in seconds, written in microseconds."""
    ts, te = round(start * 1e6, 3), round(max(start, end) * 1e6, 3)  # ends meet exactly
    return {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": te - ts, "args": args}


def recorded_trace(logs: list[RankLog]) -> list[dict]:
    """The measured timelines: every span as it happened, wall clock from the first span."""
    check_logs(logs)
    t0 = min(s.wall if isinstance(s, Mark) else s.wall_start for log in logs for s in log.spans[:1])
    out = []
    for log in logs:
        r = log.rank
        out += _meta(r, f"rank {r} · measured (wall clock here)", 2 * r)
        for s in log.spans:
            if isinstance(s, Compute):
                out.append(
                    _x(s.name, r, COMPUTE, s.wall_start - t0, s.wall_end - t0, cpu_us=s.cpu * 1e6)
                )
            elif isinstance(s, Comm):
                name = s.op if s.blocking else f"issue {s.op}"
                args = {"group": s.group_name, "ranks": list(s.group), "bytes": s.nbytes}
                if s.peer is not None:
                    args["peer"] = s.peer
                out.append(_x(name, r, COMM, s.wall_start - t0, s.wall_end - t0, **args))
            elif isinstance(s, Wait):
                name = f"wait {log.spans[s.comm].op}"
                out.append(_x(name, r, COMM, s.wall_start - t0, s.wall_end - t0))
            else:
                ts = round((s.wall - t0) * 1e6, 3)
                mark = {"name": s.name, "ph": "i", "s": "p", "pid": r, "tid": 0, "ts": ts}
                if s.what or s.nbytes:  # a ZeRO buffer's gather / free, a chunk's call
                    mark["args"] = {"what": s.what, "bytes": s.nbytes}
                out.append(mark)
    return out


def replayed_trace(timeline: Timeline, label: str) -> list[dict]:
    """A replay's timelines (pid REPLAYED + rank), labelled e.g. 'replayed, loopback link'."""
    out = []
    for r in timeline.ranks:
        out += _meta(REPLAYED + r, f"rank {r} · {label}", 2 * r + 1)
    for s in timeline.spans:
        tid = COMPUTE if s.track == "compute" else COMM
        out.append(_x(s.name, REPLAYED + s.rank, tid, s.start, s.end))
    return out


def write(
    path: str | Path,
    logs: list[RankLog],
    link: str | AlphaBeta | dict[str, str | AlphaBeta] = "loopback",
    factor: float | dict[int, float] = 1.0,
    link_name: str | None = None,
) -> Timeline:
    """Write the measured and the replayed (`link`, compute × `factor`) timelines of `logs` to
    `path` as a Chrome trace JSON; returns the replay. `link_name` labels an AlphaBeta link
    (e.g. "loopback, measured here"); its α and β are shown beside it."""
    path = check_path(path)
    timeline = replay(logs, link, factor)
    if isinstance(link, str):
        name = f"{link} link"
    elif isinstance(link, dict):
        name = "links " + ", ".join(
            f"{g}: {v if isinstance(v, str) else 'α-β'}" for g, v in link.items()
        )
    else:
        ab = f"α {link.alpha * 1e6:.0f} µs, {link.bandwidth / 1e9:.2f} GB/s"
        name = f"{link_name or 'link'}: {ab}"
    events = recorded_trace(logs) + replayed_trace(timeline, f"replayed (a core per rank, {name})")
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return timeline
