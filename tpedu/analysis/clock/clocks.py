"""Lessons 11–18: one recorded step on three clocks, each labelled, beside the formula.

    rows = clocks.three_clocks(logs, net, flops=flops)   # logs: tpedu.comm.recorder.gather
    print(clocks.table(rows, [clocks.Row("formula", "(p-1)/(m+p-1)", bubble=0.273)]))

The clocks of one set of rank logs:

    measured   the wall clock here: first span to last over all ranks; a rank's compute is the
               wall time of its compute spans, its waiting the wall time inside communication
               calls and their waits (on a shared CPU both include the other ranks' turns)
    replayed   tpedu.analysis.clock.replay: a core per rank (compute at its recorded thread CPU
               time), on this machine's loopback link `net`, and on free links
    priced     the same spans on a named cluster: compute × `factor` (from `flops` at a
               device's efficiency, links.device_factor, unless given), communication on `link`

Every row splits a rank's step (means over ranks, seconds) into compute and waiting; a replayed
row also splits the waiting into exposed communication and idle (the bubble), and counts the
communication hidden beside compute.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from tpedu.analysis.clock import links, replay
from tpedu.comm.cost_model import AlphaBeta
from tpedu.comm.recorder import Comm, Compute, RankLog, Wait


@dataclass
class Row:
    """One clock's line: `clock` (measured, replayed, priced, formula), `what` it is, and
    the step's seconds (None: this clock does not give it)."""

    clock: str
    what: str
    step: float | None = None
    compute: float | None = None
    waiting: float | None = None
    exposed: float | None = None
    hidden: float | None = None
    bubble: float | None = None


def measured_row(logs: list[RankLog], cores: int | None = None) -> Row:
    """The wall clock of the recording: step, and a rank's mean wall time computing and
    inside communication calls (waits included)."""
    cores = os.cpu_count() if cores is None else cores
    n = len(logs)
    comp = sum(s.wall_end - s.wall_start for g in logs for s in g.spans if isinstance(s, Compute))
    wait = sum(
        s.wall_end - s.wall_start for g in logs for s in g.spans if isinstance(s, Comm | Wait)
    )
    what = f"wall clock here, {n} rank{'s' * (n > 1)} on {cores} core{'s' * (cores > 1)}"
    return Row("measured", what, replay.measured(logs), comp / n, wait / n)


def timeline_row(clock: str, what: str, t: replay.Timeline) -> Row:
    """A replay's line: step, a rank's mean compute, waiting (exposed + idle), exposed and
    hidden communication, and the bubble (mean idle share of the step)."""
    n = len(t.ranks)
    busy = sum(t.busy) / n
    return Row(clock, what, t.step, busy, t.step - busy, t.exposed, t.hidden, t.bubble)


def three_clocks(
    logs: list[RankLog],
    net: str | AlphaBeta = "loopback",
    flops: float | None = None,
    factor: float | None = None,
    link: str | AlphaBeta = "nvlink",
    priced: str | None = None,
    cores: int | None = None,
) -> list[Row]:
    """Measured, replayed (on `net`, then free links) and priced rows of one recording.

    Priced: compute × `factor`, else × links.device_factor(`flops`, the logs' CPU seconds) on
    its default device (the what-if's H100 at 70 % of peak); no row when neither is given.
    `priced`: its label (default: the device, the link's name and the efficiency); `cores`:
    this machine's (default: all)."""
    rows = [measured_row(logs, cores)]
    rows.append(
        timeline_row("replayed", "a core per rank, loopback link", replay.replay(logs, net))
    )
    rows.append(
        timeline_row("replayed", "a core per rank, free links", replay.replay(logs, "free"))
    )
    if factor is None and flops is not None:
        cpu = sum(log.compute_seconds() for log in logs)
        factor = links.device_factor(flops, cpu)
    if factor is not None:
        name = link if isinstance(link, str) else "α-β link"
        what = priced or f"{links.DEVICE}: {name}, {links.EFFICIENCY:.0%} of peak"
        rows.append(timeline_row("priced", what, replay.replay(logs, link, factor)))
    return rows


def _ms(x: float | None, width: int) -> str:
    return f"{x * 1e3:>{width}.3f}" if x is not None else " " * width


def table(rows: list[Row], title: str = "") -> str:
    """The rows as a table: ms per step, a rank's compute and waiting, exposed and hidden
    communication, bubble; `title` (e.g. the run's name) heads the first row. Blank where a
    clock does not give the number."""
    head = (
        f"{'':<8} {'clock':<54} {'step ms':>9} {'compute':>9} {'waiting':>9} "
        f"{'exposed':>9} {'hidden':>9} {'bubble':>7}"
    )
    lines = [head]
    for i, r in enumerate(rows):
        label = f"{r.clock} ({r.what})"
        bubble = f"{r.bubble:>7.1%}" if r.bubble is not None else " " * 7
        lines.append(
            f"{title * (i == 0):<8} {label:<54} {_ms(r.step, 9)} {_ms(r.compute, 9)} {_ms(r.waiting, 9)} "
            f"{_ms(r.exposed, 9)} {_ms(r.hidden, 9)} {bubble}".rstrip()
        )
    return "\n".join(lines)
