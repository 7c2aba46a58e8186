"""Course infrastructure: figures for lessons 02–06, drawn from what the code records in a run.

Each figure has two halves: a *recorder* that runs inside a rank (under `tpedu.launch`) and
returns plain data taken from the real code path (the ring's per-step chunks, `CommTracer`
records, the shards a layer keeps), and a *drawing* function that turns that data into a
matplotlib figure. Nothing drawn is typed in by hand: change the code and the figure changes.

    states = tpedu.launch(worker_calling_record_ring, 4)      # lesson 02
    fig = draw_ring(states)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

from tpedu.comm import collectives
from tpedu.comm.ring import ring_all_reduce
from tpedu.comm.tracer import CommRecord, CommTracer, current_phase

RANK_COLOURS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860")


def rank_colour(rank: int) -> str:
    """The colour lessons 02–06 give to rank `rank`."""
    return RANK_COLOURS[rank % len(RANK_COLOURS)]


# --- lesson 02: the ring all-reduce, step by step ------------------------------------------


@dataclass(frozen=True)
class RingStep:
    """One rank after one ring step: phase ("start", "reduce_scatter", "all_gather"), the step
    number within it, the chunk indices sent and received (-1 at the start), and the value of
    the first element of every chunk."""

    phase: str
    step: int
    sent: int
    received: int
    chunks: tuple[float, ...]


def record_ring(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> list[RingStep]:
    """Run `tpedu.comm.ring.ring_all_reduce(x)` and return this rank's state before and after
    each of its 2(t-1) steps. Collective call: every rank of the group calls it."""
    first = lambda chunks: tuple(float(c.view(-1)[0]) for c in chunks)
    t = dist.get_world_size(group)
    states = [RingStep("start", -1, -1, -1, first(x.view(-1).tensor_split(t)))]

    def on_step(phase: str, step: int, sent: int, received: int, chunks: list) -> None:
        states.append(RingStep(phase, step, sent, received, first(chunks)))

    ring_all_reduce(x, group, on_step=on_step)
    return states


def _contributors(value: float) -> list[int]:
    """Ranks whose data a chunk holds, when rank r started with the value 2**r (a bit mask)."""
    v = int(value)
    return [r for r in range(v.bit_length()) if v >> r & 1]


def draw_ring(states: Sequence[Sequence[RingStep]]) -> Figure:
    """Ranks (rows) × steps (columns) of a ring all-reduce recorded with `record_ring`.

    states[r] is rank r's list. Rank r must have started with 2**r in every element, so each
    chunk's value says whose data it holds: the label lists those ranks, the shade their count.
    The chunk received in a step has a black edge, the one sent a small arrow under it.
    """
    t, n_cols = len(states), len(states[0])
    fig, ax = plt.subplots(figsize=(1.45 * n_cols + 0.8, 0.75 * t + 1.4))
    for r, rank_states in enumerate(states):
        y = t - 1 - r
        for c, st in enumerate(rank_states):
            x0 = c * (t + 1)
            for k, value in enumerate(st.chunks):
                who = _contributors(value)
                full = len(who) == t
                face = plt.cm.Greens(0.15 + 0.7 * len(who) / t)
                edge, lw = ("black", 2.2) if k == st.received else ("white", 1.0)
                ax.add_patch(Rectangle((x0 + k, y), 1, 0.8, facecolor=face, edgecolor=edge, lw=lw))
                label = "all" if full else "".join(str(w) for w in who)
                ax.text(
                    x0 + k + 0.5,
                    y + 0.4,
                    label,
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white" if full else "black",
                )
                if k == st.sent:
                    ax.annotate(
                        "",
                        (x0 + k + 0.85, y - 0.08),
                        (x0 + k + 0.15, y - 0.08),
                        arrowprops={"arrowstyle": "->", "color": "#C44E52", "lw": 1.4},
                    )
        ax.text(-0.3, y + 0.4, f"rank {r}", ha="right", va="center", fontsize=9)
    for k in range(t):
        ax.text(k + 0.5, -0.3, f"c{k}", ha="center", va="center", fontsize=7, color="grey")
    for c, st in enumerate(states[0]):
        title = "start" if st.phase == "start" else f"{st.phase.replace('_', '-')}\nstep {st.step}"
        ax.text(c * (t + 1) + t / 2, t + 0.05, title, ha="center", va="bottom", fontsize=8)
    n_rs = sum(st.phase == "reduce_scatter" for st in states[0])
    ax.axvline((1 + n_rs) * (t + 1) - 0.5, color="grey", ls="--", lw=1)
    ax.set_xlim(-1.6, n_cols * (t + 1))
    ax.set_ylim(-0.4, t + 0.9)
    ax.axis("off")
    ax.set_title(
        f"ring all-reduce on {t} ranks: chunk labels = ranks summed in; black edge = received, "
        "red arrow = sent this step",
        fontsize=9,
    )
    fig.tight_layout()
    return fig


# --- lessons 03, 04: which collective runs at which stage, forward and backward --------------


@dataclass
class StageTrace:
    """One stage of a chain: its name, input/output shapes and the collectives it ran."""

    name: str
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    forward: list[CommRecord] = field(default_factory=list)
    backward: list[CommRecord] = field(default_factory=list)


def trace_stages(
    stages: Sequence[tuple[str, Callable[[torch.Tensor], torch.Tensor]]],
    x: torch.Tensor,
    grad_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[StageTrace]]:
    """Run x through `stages` in order, then backward from the output, and attribute every
    traced collective to the stage that ran it.

    Forward: one `CommTracer` per stage call. Backward: a gradient hook on each stage's input
    and output marks where the gradient is, so the records between two marks are that stage's.
    x must require grad (a leaf). Returns (the output, one StageTrace per stage).
    """
    traces: list[StageTrace] = []
    marks: dict[tuple[int, str], int] = {}
    back = CommTracer()

    def mark(i: int, where: str) -> Callable[[torch.Tensor], None]:
        def hook(_grad: torch.Tensor) -> None:
            marks[(i, where)] = len(back.records)

        return hook

    h = x
    for i, (name, fn) in enumerate(stages):
        h.register_hook(mark(i, "in"))
        with CommTracer() as fwd:
            out = fn(h)
        out.register_hook(mark(i, "out"))
        traces.append(StageTrace(name, tuple(h.shape), tuple(out.shape), list(fwd.records)))
        h = out
    with back:
        h.backward(torch.ones_like(h) if grad_out is None else grad_out)
    for i, st in enumerate(traces):
        st.backward = back.records[marks[(i, "out")] : marks[(i, "in")]]
    return h, traces


def _comm_label(records: Sequence[CommRecord]) -> str:
    if not records:
        return "no communication"
    return "\n".join(f"{r.op.replace('_', '-')} {r.numel} el." for r in records)


def draw_dataflow(traces: Sequence[StageTrace], title: str = "") -> Figure:
    """Boxes for the stages of `trace_stages`, forward arrows left to right on top and backward
    arrows right to left below; each stage is annotated with the collectives it ran in each pass
    (red box edge: this stage communicates)."""
    n = len(traces)
    fig, ax = plt.subplots(figsize=(2.3 * n + 1.6, 3.6))
    w, gap = 1.7, 0.6
    xs = [0.8 + i * (w + gap) for i in range(n)]
    for x0, st in zip(xs, traces, strict=True):
        talks = bool(st.forward or st.backward)
        ax.add_patch(
            Rectangle(
                (x0, 1.1),
                w,
                0.9,
                facecolor="#EAEAF2",
                edgecolor="#C44E52" if talks else "grey",
                lw=2 if talks else 1,
            )
        )
        ax.text(x0 + w / 2, 1.55, st.name, ha="center", va="center", fontsize=9)
        for y, recs, colour in ((2.25, st.forward, "#4C72B0"), (0.85, st.backward, "#DD8452")):
            ax.text(
                x0 + w / 2,
                y,
                _comm_label(recs),
                ha="center",
                va="bottom" if y > 1 else "top",
                fontsize=8,
                color="#C44E52" if recs else colour,
                fontweight="bold" if recs else "normal",
            )
    shapes = [traces[0].in_shape] + [st.out_shape for st in traces]
    edges = [0.0] + [x0 + w for x0 in xs]
    starts = [x0 for x0 in xs] + [edges[-1] + 0.8]
    for i, shape in enumerate(shapes):
        a, b = edges[i], starts[i]
        ax.add_patch(
            FancyArrowPatch(
                (a, 1.75), (b, 1.75), arrowstyle="-|>", mutation_scale=12, color="#4C72B0"
            )
        )
        ax.add_patch(
            FancyArrowPatch(
                (b, 1.35), (a, 1.35), arrowstyle="-|>", mutation_scale=12, color="#DD8452"
            )
        )
        ax.text((a + b) / 2, 2.0, str(list(shape)), ha="center", va="bottom", fontsize=7)
    ax.text(0, 3.2, "forward  →", color="#4C72B0", fontsize=9, va="top")
    ax.text(0, 0.05, "←  backward (gradients)", color="#DD8452", fontsize=9, va="bottom")
    ax.set_xlim(-0.2, starts[-1] + 0.3)
    ax.set_ylim(0, 3.3)
    ax.axis("off")
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


# --- lesson 04: who owns which block of the MLP's weights -----------------------------------


def ownership(dense: torch.Tensor, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """int64 map of `dense`'s shape: the rank whose shard holds each entry (-1: none, -2: more
    than one). `dense` must hold distinct values (e.g. torch.arange) so entries can be found."""
    owner = torch.full(dense.shape, -1, dtype=torch.int64)
    for r, s in enumerate(shards):
        hit = torch.isin(dense, s.to(dense.dtype).cpu())
        owner = torch.where(hit & (owner != -1), -2, torch.where(hit, r, owner))
    return owner


def _draw_owner(ax: plt.Axes, owner: torch.Tensor, title: str, xlabel: str, ylabel: str) -> None:
    from matplotlib.colors import ListedColormap

    t = int(owner.max()) + 1
    ax.imshow(
        owner.numpy(),
        cmap=ListedColormap([rank_colour(r) for r in range(t)]),
        vmin=-0.5,
        vmax=t - 0.5,
        aspect="auto",
        interpolation="nearest",
    )
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.tick_params(labelsize=7)


def draw_mlp_split(
    fc1_owner: torch.Tensor, fc2_owner: torch.Tensor, traces: Sequence[StageTrace]
) -> Figure:
    """fc1.weight [F, H] and fc2.weight [H, F] coloured by owning rank (from `ownership`),
    between them the hidden activation's columns, and the collectives each stage ran
    (from `trace_stages` on the ParallelMLP)."""
    t = int(fc1_owner.max()) + 1
    hidden_owner = fc1_owner[:, 0][None, :]  # hidden column j comes from fc1's output row j
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.6), gridspec_kw={"width_ratios": [1, 2.2, 2.2]})
    _draw_owner(
        axes[0],
        fc1_owner,
        "fc1.weight [F, H]\ncolumn-parallel: split by rows",
        "H (input)",
        "F (output)",
    )
    _draw_owner(
        axes[1],
        hidden_owner,
        "hidden h [..., F]: each rank keeps\nits own columns, nothing moves",
        "F",
        "",
    )
    axes[1].set_yticks([])
    _draw_owner(
        axes[2],
        fc2_owner,
        "fc2.weight [H, F]\nrow-parallel: split by columns",
        "F (input)",
        "H (output)",
    )
    lines = []
    for st in traces:
        for phase, recs in (("forward", st.forward), ("backward", st.backward)):
            lines += [f"{st.name}, {phase}: {r.op} of {r.numel} el." for r in recs]
    fig.text(
        0.5,
        0.01,
        "traced: " + ";  ".join(lines or ["no collectives"]),
        ha="center",
        fontsize=9,
        color="#C44E52",
    )
    handles = [Rectangle((0, 0), 1, 1, color=rank_colour(r)) for r in range(t)]
    fig.legend(handles, [f"rank {r}" for r in range(t)], loc="upper right", fontsize=8)
    fig.tight_layout(rect=(0, 0.06, 0.93, 1))
    return fig


# --- lesson 05: which rows of the fused QKV weight each rank keeps --------------------------


def draw_qkv_split(
    layouts: Sequence[tuple[str, Sequence[torch.Tensor]]],
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
) -> Figure:
    """One panel per layout (title, [rows kept by rank r, from `qkv_rows`]): ranks × rows of the
    dense fused [q | k | v] weight, filled with the rank's colour where it keeps the row. A
    column filled on several ranks is a replicated KV head; the count is printed above it."""
    n_rows = (n_heads + 2 * n_kv_heads) * head_dim
    names = [f"q{h}" for h in range(n_heads)] + [f"k{h}" for h in range(n_kv_heads)]
    names += [f"v{h}" for h in range(n_kv_heads)]
    height = sum(0.45 * len(rows) + 0.7 for _, rows in layouts)
    fig, axes = plt.subplots(len(layouts), 1, figsize=(0.32 * n_rows + 1.5, height), squeeze=False)
    for ax, (title, rows) in zip(axes[:, 0], layouts, strict=True):
        t = len(rows)
        copies = torch.zeros(n_rows, dtype=torch.int64)
        for r, kept in enumerate(rows):
            copies[kept] += 1
            for i in kept.tolist():
                ax.add_patch(Rectangle((i, t - 1 - r), 1, 0.9, color=rank_colour(r)))
        for h, name in enumerate(names):
            x = h * head_dim + head_dim / 2
            ax.text(x, -0.35, name, ha="center", va="center", fontsize=7)
            if int(copies[h * head_dim]) > 1:
                ax.text(
                    x,
                    t + 0.25,
                    f"×{int(copies[h * head_dim])}",
                    ha="center",
                    fontsize=7,
                    color="#C44E52",
                )
        for b in (n_heads * head_dim, (n_heads + n_kv_heads) * head_dim):
            ax.axvline(b, color="black", lw=1)
        ax.set_yticks(
            [t - 1 - r + 0.45 for r in range(t)], [f"rank {r}" for r in range(t)], fontsize=8
        )
        ax.set_xticks([])
        ax.set_xlim(0, n_rows)
        ax.set_ylim(-0.7, t + 0.7)
        ax.set_title(title, fontsize=9)
        for s in ax.spines.values():
            s.set_visible(False)
    fig.tight_layout()
    return fig


# --- lesson 06: the vocabulary-parallel cross-entropy, collective by collective -------------


@dataclass(frozen=True)
class Reduction:
    """One all-reduce as a rank saw it: reduce op, shape, phase, the tensor before and after."""

    op: str
    shape: tuple[int, ...]
    phase: str
    before: torch.Tensor
    after: torch.Tensor


@contextlib.contextmanager
def watch_all_reduce() -> Iterator[list[Reduction]]:
    """Record every `tpedu.comm.collectives.all_reduce` in this block: its reduce op, shape,
    phase and the tensor before and after (copies). Code that calls
    `collectives.all_reduce(...)` through the module is seen; the call itself is unchanged."""
    seen: list[Reduction] = []
    original = collectives.all_reduce

    def watched(x: torch.Tensor, group=None, op=dist.ReduceOp.SUM, async_op=False):
        before = x.detach().clone().cpu()
        out = original(x, group, op=op, async_op=async_op)
        name = str(op).split(".")[-1].upper()
        seen.append(
            Reduction(name, tuple(x.shape), current_phase(), before, x.detach().clone().cpu())
        )
        return out

    collectives.all_reduce = watched
    try:
        yield seen
    finally:
        collectives.all_reduce = original


def draw_vocab_ce(
    per_rank: Sequence[Sequence[Reduction]],
    shard_shape: tuple[int, ...],
    steps: Sequence[str],
    token: tuple[int, ...] = (0, 0),
) -> Figure:
    """The all-reduces of `vocab_parallel_cross_entropy` (from `watch_all_reduce` on every rank),
    in the order they ran: each row a step (`steps[i]` names the local work before reduction i),
    with each rank's local value for one `token` and the reduced value, shape and reduce op."""
    t, n = len(per_rank), len(per_rank[0])
    fig, ax = plt.subplots(figsize=(10, 1.25 * n + 1.2))
    ax.text(
        0.0,
        n + 0.35,
        f"each rank: logits shard {list(shard_shape)}  (values below: token {list(token)})",
        fontsize=9,
        va="bottom",
    )
    for i in range(n):
        y = n - 1 - i
        red = per_rank[0][i]
        ax.text(0.0, y + 0.5, f"{i + 1}. {steps[i]}", fontsize=9, va="center")
        for r in range(t):
            v = float(per_rank[r][i].before[token])
            ax.add_patch(
                Rectangle((4.3 + 1.3 * r, y + 0.15), 1.2, 0.7, facecolor=rank_colour(r), alpha=0.35)
            )
            ax.text(
                4.9 + 1.3 * r, y + 0.5, f"rank {r}\n{v:.3g}", ha="center", va="center", fontsize=8
            )
        x_ar = 4.3 + 1.3 * t + 0.2
        ax.add_patch(
            FancyArrowPatch(
                (x_ar, y + 0.5),
                (x_ar + 1.9, y + 0.5),
                arrowstyle="-|>",
                mutation_scale=12,
                color="#C44E52",
            )
        )
        ax.text(
            x_ar + 0.95,
            y + 0.62,
            f"all-reduce {red.op}\n{list(red.shape)}, {red.phase}",
            ha="center",
            va="bottom",
            fontsize=7.5,
            color="#C44E52",
        )
        ax.text(
            x_ar + 2.1,
            y + 0.5,
            f"{float(red.after[token]):.3g} on every rank",
            va="center",
            fontsize=8.5,
        )
    back = [x for x in per_rank[0] if x.phase == "backward"]
    ax.text(
        0.0,
        -0.05,
        f"then loss = log S - z_y locally; backward: {len(back)} all-reduces",
        fontsize=9,
        va="top",
    )
    ax.set_xlim(0, x_ar + 4.2)
    ax.set_ylim(-0.5, n + 0.8)
    ax.axis("off")
    fig.tight_layout()
    return fig
