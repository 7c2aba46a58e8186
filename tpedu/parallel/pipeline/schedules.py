"""Lesson 11: pipeline parallelism (流水线并行): layers split into stages, micro-batches flow
through them.

    stage 0: embedding + blocks[0:a]  ──activation──▶  stage 1: blocks[a:b]  ──▶ ... ──▶
    stage p-1: blocks[..:n] + final norm + head + loss
    gradients w.r.t. the activations travel back the same way (◀──grad──)

`partition` / `stage_layers` choose a, b, ...: equal block counts, or (ParallelConfig.stage_split
= "flops") fewer blocks on the last stage, whose head `head_cost` prices in blocks.

A schedule is, per stage, the list of actions it runs in order: ("F", mb) / ("B", mb), or with
virtual stages ("F", mb, chunk). Three schedules:

    gpipe             all forwards, then all backwards: m activations in flight per stage
    one_f_one_b       p-1-s warm-up forwards, then alternate F/B: at most p-s in flight
    interleaved       each rank holds v chunks (virtual stages c·p + s): the bubble shrinks by v

Bubble (idle share of the step) with p stages, m micro-batches, F and B of equal cost per stage:
GPipe and 1F1B (p-1)/(m+p-1); interleaved (p-1)/(v·m+p-1).

Point-to-point on gloo: a blocking `send` waits for the matching `recv`, so "every stage sends,
then receives" deadlocks, and batched isend/irecv has known hangs. Here every send is an
`isend` (never blocks; waited for at the end of the step) and every receive blocks right where
its data is needed. Then a rank only ever waits for data that some rank produces without waiting
on it, so any schedule whose per-rank order respects the data flow cannot deadlock (`simulate`
checks that). Activations and gradients use two different groups (channels), so between the same
two ranks they can never be confused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from tpedu.model.config import GPTConfig


Action = tuple  # ("F" | "B", micro-batch) or ("F" | "B", micro-batch, chunk)


def partition(n_layers: int, stages: int, head_cost: float = 0.0) -> list[range]:
    """Contiguous layer ranges, one per stage, each at least one layer.

    The first stage also holds the embedding and the last the head and loss. With head_cost = 0
    the sizes differ by at most one, and the extra layers of an uneven split go to the middle
    stages first: 7 layers on 3 stages -> [0:2] [2:5] [5:7].

    head_cost > 0 says what the head and loss cost, in blocks. Then the split minimises the
    busiest stage (its blocks, plus head_cost on the last one): 4 layers on 2 stages with a head
    worth 2.5 blocks -> [0:3] [3:4] (3 and 3.5 blocks of work) instead of [0:2] [2:4] (2 and 4.5).
    """
    if stages < 1:
        raise ValueError(f"the number of stages must be at least 1, got {stages}")
    if n_layers < stages:
        raise ValueError(
            f"{n_layers} layers cannot be split over {stages} stages (each needs at least one "
            f"layer); use at most pp·chunks = {n_layers} stages or more layers"
        )
    middle_first = list(range(1, stages - 1)) + [0, stages - 1][: min(2, stages)]
    sizes = _spread(n_layers, stages, middle_first)
    if head_cost > 0 and stages > 1:
        options = []  # (busiest stage, sizes) for each block count of the last stage
        for last in range(n_layers - stages + 1, 0, -1):
            rest = _spread(n_layers - last, stages - 1, middle_first[: stages - 1])
            options.append((max(*rest, last + head_cost), rest + [last]))
        sizes = min(options, key=lambda o: o[0])[1]  # ties: the last stage's most blocks
    starts = [sum(sizes[:i]) for i in range(stages)]
    return [range(a, a + n) for a, n in zip(starts, sizes, strict=True)]


def _spread(n_layers: int, stages: int, order: list[int]) -> list[int]:
    """n_layers over stages as evenly as possible; the remainder goes to stages in `order`."""
    sizes = [n_layers // stages] * stages
    for i in order[: n_layers % stages]:
        sizes[i] += 1
    return sizes


def head_cost(config: GPTConfig) -> float:
    """The head's forward FLOPs per token in blocks: 2·h·V over a block's 2·h·(q, k, v, out and
    MLP widths) + 2·s·h (causal attention's q·kᵀ and p·v, half the positions each)."""
    c = config
    width = c.hidden + 2 * c.kv_heads * (c.hidden // c.n_heads) + c.hidden  # qkv, out
    width += (3 if c.activation == "swiglu" else 2) * c.ffn  # fc1 (gated: 2 of them), fc2
    return 2 * c.hidden * c.vocab_size / (2 * c.hidden * width + 2 * c.seq_len * c.hidden)


def stage_layers(config: GPTConfig, stages: int, split: str = "even") -> list[range]:
    """The layers of each stage, as `split` says: "even", or "flops" (the head as `head_cost`)."""
    if split not in ("even", "flops"):
        raise ValueError(f"stage_split must be 'even' or 'flops', got {split!r}")
    cost = head_cost(config) if split == "flops" else 0.0
    return partition(config.n_layers, stages, cost)


def stage_of(name: str, stages: list[range], pp: int) -> int:
    """The pipeline rank that holds the dense tensor `name`: embeddings on the first, the final
    norm and head on the last, block i on the rank of its virtual stage (c·pp + s is on rank s).
    `stages`: the layers of each virtual stage (`stage_layers`)."""
    if name.startswith("blocks."):
        i = int(name.split(".")[1])
        return next(vs for vs, r in enumerate(stages) if i in r) % pp
    return 0 if name.split(".")[0] in ("tok_emb", "pos_emb") else pp - 1


def gpipe(n_micro: int, n_stages: int, stage: int) -> list[Action]:
    """All forwards, then all backwards (GPipe): [F0 .. F(m-1), B0 .. B(m-1)]."""
    _check(n_micro, n_stages, stage)
    return [("F", i) for i in range(n_micro)] + [("B", i) for i in range(n_micro)]


def one_f_one_b(n_micro: int, n_stages: int, stage: int) -> list[Action]:
    """1F1B (PipeDream-flush): warm-up forwards, alternate one forward / one backward, cool-down.

    Every micro-batch runs forward, later backward, both in micro-batch order. Stage s runs a
    forward while fewer than p-s micro-batches are in flight on it (forwarded, not yet
    backwarded) and one remains, else the backward of the oldest: at most p-s activations are
    in flight on stage s (GPipe keeps m), and the last stage runs each backward right after
    its forward.
    """
    _check(n_micro, n_stages, stage)
    warm = min(n_stages - 1 - stage, n_micro)
    out: list[Action] = [("F", i) for i in range(warm)]
    for i in range(n_micro - warm):
        out += [("F", warm + i), ("B", i)]
    return out + [("B", i) for i in range(n_micro - warm, n_micro)]


def interleaved(n_micro: int, n_stages: int, stage: int, chunks: int) -> list[Action]:
    """Interleaved 1F1B (Megatron-LM): rank `stage` runs chunks c = 0..v-1 (virtual stages c·p+s).

    Forwards go in groups of p micro-batches per chunk (chunk 0 for mb 0..p-1, chunk 1 for the
    same mbs, ..., then the next p mbs); backwards likewise from the last chunk down. Warm-up:
    2·(p-1-s) + (v-1)·p forwards. Needs m divisible by p.
    """
    _check(n_micro, n_stages, stage)
    p, v, m = n_stages, chunks, n_micro
    if v < 1:
        raise ValueError(f"chunks must be at least 1, got {v}")
    if v > 1 and m % p:
        raise ValueError(
            f"interleaved 1F1B needs the number of micro-batches ({m}) divisible by the number of "
            f"stages ({p}); use m = {p}, {2 * p}, {3 * p}, ..."
        )

    def which(k: int, forward: bool) -> tuple[int, int]:
        chunk = (k // p) % v
        return (k // (p * v)) * p + k % p, (chunk if forward else v - 1 - chunk)

    total = m * v
    warm = min(total, p - 1 - stage if v == 1 else 2 * (p - 1 - stage) + (v - 1) * p)
    out: list[Action] = [("F", *which(k, True)) for k in range(warm)]
    for k in range(total - warm):
        out += [("F", *which(warm + k, True)), ("B", *which(k, False))]
    return out + [("B", *which(k, False)) for k in range(total - warm, total)]


def _check(n_micro: int, n_stages: int, stage: int) -> None:
    if n_micro < 1 or n_stages < 1 or not 0 <= stage < n_stages:
        raise ValueError(
            f"need n_micro ≥ 1, n_stages ≥ 1, 0 ≤ stage < n_stages; got "
            f"n_micro={n_micro}, n_stages={n_stages}, stage={stage}"
        )


def schedule(kind: str, n_micro: int, n_stages: int, stage: int, chunks: int = 1) -> list[Action]:
    """The actions of `stage` under schedule `kind` ('gpipe', '1f1b' or 'interleaved').

    Raises a ValueError naming the fix for an unknown kind, chunks > 1 without 'interleaved',
    or (interleaved) micro-batches not divisible by the stages: calling it is the check.
    """
    if kind in ("gpipe", "1f1b") and chunks != 1:
        raise ValueError(
            f"{chunks} chunks per rank need the 'interleaved' schedule "
            f"('{kind}' runs one chunk per rank)"
        )
    if kind == "gpipe":
        return gpipe(n_micro, n_stages, stage)
    if kind == "1f1b":
        return one_f_one_b(n_micro, n_stages, stage)
    if kind == "interleaved":
        return interleaved(n_micro, n_stages, stage, chunks)
    raise ValueError(f"unknown schedule {kind!r}; choose 'gpipe', '1f1b' or 'interleaved'")


def action_parts(action: Action) -> tuple[str, int, int]:
    kind, mb, *rest = action
    return kind, mb, (rest[0] if rest else 0)


@dataclass(frozen=True)
class Event:
    """One thing a stage did: 'F'/'B' of (micro-batch, chunk), or 'wait' for a receive."""

    stage: int
    kind: str
    micro: int
    chunk: int
    start: float
    end: float


def simulate(
    schedules: Sequence[Sequence[Action]], forward: float = 1.0, backward: float = 1.0
) -> list[Event]:
    """Run per-stage schedules on an ideal clock (F costs `forward`/v, B `backward`/v, free
    communication); returns the compute events. Raises if the schedules deadlock or are
    incomplete (a forward or backward missing, or a backward before its forward)."""
    p = len(schedules)
    v = 1 + max((action_parts(a)[2] for s in schedules for a in s), default=0)
    last = p * v - 1
    done: dict[tuple[str, int, int], float] = {}  # (kind, mb, virtual stage) -> finish time
    pos, free = [0] * p, [0.0] * p
    events: list[Event] = []
    while any(pos[s] < len(schedules[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while pos[s] < len(schedules[s]):
                kind, mb, c = action_parts(schedules[s][pos[s]])
                vs = c * p + s
                if kind == "F":
                    deps = [("F", mb, vs - 1)] if vs > 0 else []
                else:
                    deps = [("F", mb, vs)] + ([("B", mb, vs + 1)] if vs < last else [])
                if any(d not in done for d in deps):
                    break
                start = max([free[s]] + [done[d] for d in deps])
                end = start + (forward if kind == "F" else backward) / v
                done[(kind, mb, vs)] = free[s] = end
                events.append(Event(s, kind, mb, c, start, end))
                pos[s] += 1
                progressed = True
        if not progressed:
            stuck = {s: schedules[s][pos[s]] for s in range(p) if pos[s] < len(schedules[s])}
            raise RuntimeError(f"the schedules deadlock: stages wait forever at {stuck}")
    return events


def bubble_fraction(events: Sequence[Event]) -> float:
    """Idle share of the step: 1 - (compute time summed over stages) / (stages · makespan)."""
    compute = [e for e in events if e.kind in ("F", "B")]
    stages = {e.stage for e in compute}
    t0, t1 = min(e.start for e in compute), max(e.end for e in compute)
    busy = sum(e.end - e.start for e in compute)
    return 1.0 - busy / (len(stages) * (t1 - t0))


def bubble_formula(n_micro: int, n_stages: int, chunks: int = 1) -> float:
    """(p-1)/(v·m + p-1): the bubble when F and B cost the same on every stage."""
    return (n_stages - 1) / (chunks * n_micro + n_stages - 1)


def peak_in_flight(actions: Sequence[Action]) -> int:
    """Most forward activations held at once (forwarded, not yet backwarded) by one stage."""
    held = peak = 0
    for a in actions:
        held += 1 if a[0] == "F" else -1
        peak = max(peak, held)
    return peak


def plot_timeline(events: Sequence[Event], title: str = "", ax: Axes | None = None) -> Axes:
    """A Gantt chart: one row per stage, forwards blue, backwards green (label = micro-batch),
    waits grey. Times are shifted to start at 0. Returns the axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(11, 0.5 + 0.5 * (1 + max(e.stage for e in events))))
    t0 = min(e.start for e in events)
    shades = {"F": ("tab:blue", "tab:cyan"), "B": ("tab:green", "tab:olive")}
    for e in events:
        color = "lightgrey" if e.kind == "wait" else shades[e.kind][e.chunk % 2]
        ax.barh(e.stage, e.end - e.start, left=e.start - t0, color=color, edgecolor="white")
        if e.kind != "wait":
            ax.text(
                (e.start + e.end) / 2 - t0,
                e.stage,
                str(e.micro),
                ha="center",
                va="center",
                fontsize=7,
                color="white",
            )
    ax.invert_yaxis()
    stages = sorted({e.stage for e in events})
    ax.set_yticks(stages)
    ax.set_yticklabels([f"stage {s}" for s in stages])
    ax.set_xlabel("time")
    ax.set_title(title, fontsize=10)
    return ax
