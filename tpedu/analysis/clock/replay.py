"""Lesson 11: replay the ranks' logs as if each rank had its own device, on a link of your choice.

    timeline = replay.replay(logs, link="loopback")    # logs: tpedu.comm.recorder.gather
    timeline.step, timeline.bubble, timeline.exposed, timeline.hidden

The rules, for every rank at once (its own clock from 0):

    compute      takes its recorded CPU time × `factor` (1: this laptop's core, one per rank);
                 so does the CPU time a rank's thread spent inside a communication call
    collective   starts when its last member has issued it and its members' communication
                 lanes are free; takes its group's link's α-β time for its op, bytes and size
    asynchronous runs on the rank's communication lane beside compute; the rank waits only
                 at its `wait()` (and then only for what is left)
    send/recv    the transfer starts when the send is issued (on the sender's lane); a receive
                 ends no earlier than the transfer
    blocking     = asynchronous + an immediate wait

Each rank's step splits into compute (busy), exposed communication (waiting while one of its
transfers runs) and idle (waiting for another rank: the bubble). Hidden communication is the
transfer time not waited for. Exact arithmetic on the recorded order: with free links and equal
stages, GPipe and 1F1B give (p-1)/(m+p-1).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tpedu.analysis.clock.links import link as get_link
from tpedu.comm.cost_model import AlphaBeta
from tpedu.comm.recorder import Comm, Compute, Mark, RankLog, Wait


@dataclass
class Span:
    """One replayed interval of a rank: track 'compute' (work, or 'wait …' while blocked) or
    'comm' (its communication lane), seconds from the step's start."""

    rank: int
    track: str
    name: str
    start: float
    end: float


@dataclass
class _Op:
    name: str
    cost: float
    owners: tuple[int, ...]  # the ranks whose lanes it occupies
    members: tuple[int, ...]  # the ranks that must issue it before it starts
    receiver: int | None = None
    issued: dict[int, float] = field(default_factory=dict)
    start: float | None = None
    end: float | None = None


@dataclass
class Timeline:
    """A replay's result: every rank's spans, the step time and its split (seconds; the
    per-rank lists are in rank order, the properties their means). `marks`: when the last
    rank reached each mark without data (a step's boundary: recorder.mark(name))."""

    ranks: list[int]
    spans: list[Span]
    step: float
    busy: list[float]
    exposed_per_rank: list[float]
    hidden_per_rank: list[float]
    marks: dict[str, float]

    @property
    def idle_per_rank(self) -> list[float]:
        return [
            max(0.0, self.step - b - e)
            for b, e in zip(self.busy, self.exposed_per_rank, strict=True)
        ]

    @property
    def bubble(self) -> float:
        """Mean share of the step a rank is idle (waiting for another rank, not a transfer)."""
        return sum(self.idle_per_rank) / len(self.ranks) / self.step if self.step else 0.0

    @property
    def exposed(self) -> float:
        """Mean seconds a rank waits while its communication runs."""
        return sum(self.exposed_per_rank) / len(self.ranks)

    @property
    def hidden(self) -> float:
        """Mean seconds of a rank's communication that ran beside its compute."""
        return sum(self.hidden_per_rank) / len(self.ranks)

    def row(self, label: str) -> str:
        """One line: step, bubble, exposed and hidden communication (ms)."""
        return (
            f"{label:<28} step {self.step * 1e3:8.2f} ms  bubble {self.bubble:6.1%}  "
            f"exposed {self.exposed * 1e3:7.2f} ms  hidden {self.hidden * 1e3:7.2f} ms"
        )


def check_logs(logs: list[RankLog]) -> None:
    """Raise a one-line ValueError unless the logs are one run's, one per rank."""
    if not logs:
        raise ValueError("no logs to replay: record the ranks first (tpedu.comm.recorder)")
    runs = sorted({log.run for log in logs})
    if len(runs) > 1:
        raise ValueError(
            f"the logs come from different runs ({', '.join(runs)}): record every rank in one "
            "run (one run_id) and replay those logs together"
        )
    ranks = [log.rank for log in logs]
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"two logs of the same rank ({sorted(ranks)}): pass one log per rank")


def _key(c: Comm, rank: int) -> tuple:
    if c.op == "send":
        return ("p2p", c.group, rank, c.peer, c.seq)
    if c.op == "recv":
        return ("p2p", c.group, c.peer, rank, c.seq)
    return ("coll", c.group, c.seq)


def _program(log: RankLog, ops: dict[tuple, _Op], nets: dict[str, AlphaBeta]) -> list[tuple]:
    """The rank's log as steps: ('c', cpu, name), ('i', key), ('w', key), ('m', name)."""
    prog: list[tuple] = []
    keys: dict[int, tuple] = {}
    unwaited: list[tuple] = []
    r = log.rank
    for i, s in enumerate(log.spans):
        if isinstance(s, Compute):
            prog.append(("c", s.cpu, s.name))
        elif isinstance(s, Mark) and not s.what:  # a boundary; one with data only annotates
            prog.append(("m", s.name))
        elif isinstance(s, Comm):
            key = keys[i] = _key(s, r)
            op = ops.get(key)
            if s.op == "recv":
                if op is None:  # a placeholder until its send is read
                    op = ops[key] = _Op("send", 0.0, (), ())
                op.receiver = r
            else:
                owners = (r,) if s.op == "send" else s.group
                net = _net(nets, s.group_name)
                cost = net.predict(s.op, s.nbytes, 2 if s.op == "send" else len(s.group))
                if op is None:
                    op = ops[key] = _Op(s.op, cost, owners, owners)
                elif s.op == "send":  # its receive was read first
                    op.cost, op.owners, op.members = cost, owners, owners
                elif op.name != s.op:
                    raise ValueError(
                        f"rank {r}'s call {s.seq} on ranks {list(s.group)} is {s.op}, another "
                        f"rank's is {op.name}: the logs do not match (one run, the same code?)"
                    )
            if s.cpu:  # the call's own work on this thread (copies, the enqueue)
                prog.append(("c", s.cpu, f"call {s.op}"))
            prog.append(("i", key))
            if s.blocking:
                prog.append(("w", key))
            else:
                unwaited.append(key)
        elif isinstance(s, Wait):
            prog.append(("w", keys[s.comm]))
            if s.cpu:
                prog.append(("c", s.cpu, f"call wait {log.spans[s.comm].op}"))
            unwaited.remove(keys[s.comm])
    return prog + [("w", k) for k in unwaited]  # never waited: the step ends after them


def replay(
    logs: list[RankLog],
    link: str | AlphaBeta | dict[str, str | AlphaBeta] = "free",
    factor: float | dict[int, float] = 1.0,
) -> Timeline:
    """Every rank's timeline as if it had its own device (the rules: the module's docstring).

    `link`: a name of tpedu.analysis.clock.links.LINKS or an AlphaBeta, or one per group name
    ({"tp": "nvlink", "*": "infiniband"}: '*' for every other group); `factor`: multiplies every
    compute span's CPU time (one number, or one per rank: e.g. links.device_factor).

    Long because it is one event loop: each rank's clock runs until it waits for a call not yet
    complete, and `resolve` starts the calls whose members have all issued them (split, the
    clocks and lanes would be passed between helpers)."""
    check_logs(logs)
    nets = (
        {k: get_link(v) for k, v in link.items()}
        if isinstance(link, dict)
        else {"*": get_link(link)}
    )
    ops: dict[tuple, _Op] = {}
    ranks = [log.rank for log in logs]
    progs = {log.rank: _program(log, ops, nets) for log in logs}
    for key, op in ops.items():
        if not op.members:
            raise ValueError(f"rank {op.receiver} received from rank {key[2]}, which never sent")
    scale = factor if isinstance(factor, dict) else dict.fromkeys(ranks, factor)
    pc, t = dict.fromkeys(ranks, 0), dict.fromkeys(ranks, 0.0)
    lane: dict[int, deque] = {r: deque() for r in ranks}
    lane_free = dict.fromkeys(ranks, 0.0)
    spans: list[Span] = []
    blocked: dict[int, list[tuple[float, float]]] = {r: [] for r in ranks}
    busy = dict.fromkeys(ranks, 0.0)
    marks: dict[str, float] = {}

    def resolve() -> None:  # start every operation at the head of all its owners' lanes
        changed = True
        while changed:
            changed = False
            for r in ranks:
                while lane[r]:
                    key = lane[r][0]
                    op = ops[key]
                    if any(not lane[o] or lane[o][0] != key for o in op.owners):
                        break
                    if any(m not in op.issued for m in op.members):
                        break
                    starts = [op.issued[m] for m in op.members] + [lane_free[o] for o in op.owners]
                    op.start = max(starts)
                    op.end = op.start + op.cost
                    for o in op.owners:
                        lane[o].popleft()
                        lane_free[o] = op.end
                        spans.append(Span(o, "comm", op.name, op.start, op.end))
                    changed = True

    while any(pc[r] < len(progs[r]) for r in ranks):
        progress = False
        for r in ranks:
            prog = progs[r]
            while pc[r] < len(prog):
                kind, arg, *rest = prog[pc[r]]
                if kind == "c":
                    dur = arg * scale[r]
                    spans.append(Span(r, "compute", rest[0], t[r], t[r] + dur))
                    busy[r] += dur
                    t[r] += dur
                elif kind == "m":
                    marks[arg] = max(marks.get(arg, 0.0), t[r])
                elif kind == "i":
                    op = ops[arg]
                    if r in op.members:
                        op.issued[r] = t[r]
                    if r in op.owners:
                        lane[r].append(arg)
                else:
                    op = ops[arg]
                    if op.end is None:
                        resolve()
                    if op.end is None:
                        break
                    if op.end > t[r]:
                        spans.append(Span(r, "compute", f"wait {op.name}", t[r], op.end))
                        blocked[r].append((t[r], op.end))
                        t[r] = op.end
                pc[r] += 1
                progress = True
        if not progress:
            raise _stuck(ranks, pc, progs, ops)
    resolve()
    step = max([*t.values(), *lane_free.values(), 0.0])
    exposed, hidden = _exposed_hidden(ranks, ops, blocked)
    return Timeline(ranks, spans, step, [busy[r] for r in ranks], exposed, hidden, marks)


def _net(nets: dict[str, AlphaBeta], group: str) -> AlphaBeta:
    """The link of the group named `group` ('tp', 'dp', ...), else the default '*'."""
    if group in nets:
        return nets[group]
    if "*" not in nets:
        raise ValueError(f"no link for group {group!r}: add {group!r} or '*' (every other group)")
    return nets["*"]


def _stuck(ranks: list[int], pc: dict, progs: dict, ops: dict[tuple, _Op]) -> ValueError:
    """The error of logs whose replay cannot go on: a wait whose call never completes."""
    r = next(r for r in ranks if pc[r] < len(progs[r]))
    key = progs[r][pc[r]][1]
    return ValueError(
        f"the logs do not match: rank {r} waits for {ops[key].name} on ranks {list(key[1])} "
        "that never completes; record every rank of one run"
    )


def _exposed_hidden(
    ranks: list[int], ops: dict[tuple, _Op], blocked: dict[int, list[tuple[float, float]]]
) -> tuple[list[float], list[float]]:
    """Per rank: the time its communication ran while it waited (exposed), and while it
    computed (hidden)."""
    exposed, hidden = [], []
    for r in ranks:
        comm = _union(
            [(op.start, op.end) for op in ops.values() if r in op.owners or op.receiver == r]
        )
        overlap = _measure(_intersect(comm, _union(blocked[r])))
        exposed.append(overlap)
        hidden.append(_measure(comm) - overlap)
    return exposed, hidden


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _intersect(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> list:
    return [(max(a, c), min(b, d)) for a, b in xs for c, d in ys if min(b, d) > max(a, c)]


def _measure(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def measured(logs: list[RankLog]) -> float:
    """The recorded wall-clock time: first span's start to last span's end over all ranks
    (perf_counter is one system-wide clock on Linux, so the ranks' times compare)."""
    check_logs(logs)
    starts, ends = [], []
    for log in logs:
        for s in log.spans:
            if isinstance(s, Mark):
                starts.append(s.wall)
                ends.append(s.wall)
            else:
                starts.append(s.wall_start)
                ends.append(s.wall_end)
    return max(ends) - min(starts) if starts else 0.0
