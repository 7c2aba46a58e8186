"""Lessons 07–11: figures drawn from what the code records (lessons 07 and 11), not by hand.

    with labelled_collectives(model) as calls:      # lesson 07: one training step at tp=2
        model(ids, targets).backward()
    plot_collectives(calls)                         # forward row, backward row, bytes per call

    events = simulate([schedule("1f1b", 8, 4, s) for s in range(4)])
    plot_held_activations(events, "1F1B")           # lesson 11: micro-batches held per stage

`labelled_collectives` wraps a tpedu.comm.tracer.CommTracer and names each record after the part
of the TPGPT that ran it. Forward: a pre-hook on the embedding, on each block's attention and
MLP, and a hook after the last block (what follows is the loss). Backward: a gradient hook on the
loss (what follows is the LM head's f) and on each attention and MLP output (what follows is that
part's f). A record gets the name of the last mark before it; records of another phase (e.g.
`with phase("optimizer")`) get the phase's name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tpedu.comm.tracer import CommRecord, CommTracer
from tpedu.parallel.pipeline.schedules import Event

if TYPE_CHECKING:
    from matplotlib.axes import Axes

FBAR = "f\u0304"  # f̄: identity in backward, all-reduce in forward (f is the other way round)


@dataclass(frozen=True)
class Collective:
    """One traced collective and the part of the model that ran it."""

    label: str
    record: CommRecord


@contextlib.contextmanager
def labelled_collectives(model: torch.nn.Module) -> Iterator[list[Collective]]:
    """Trace the collectives run in the block; on exit the yielded list holds one `Collective`
    per record, in call order. `model`: a tpedu.model.gpt.TPGPT (one pipeline stage or all)."""
    marks: list[tuple[int, str]] = []  # (index of the next record, label from there on)
    out: list[Collective] = []
    handles = []
    trace = CommTracer()

    def mark(label: str) -> None:
        marks.append((len(trace.records), label))

    def before(label: str):
        return lambda _module, _args: mark(label)

    def on_grad(label: str):
        def hook(_module: torch.nn.Module, _args: tuple, output: torch.Tensor) -> None:
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(lambda _grad: mark(label))

        return hook

    if getattr(model, "tok_emb", None) is not None and getattr(model, "first", True):
        handles.append(model.tok_emb.register_forward_pre_hook(before("embedding")))
    for i, block in enumerate(model.blocks):
        for part, name in ((block.attn, "attention"), (block.mlp, "MLP")):
            handles.append(part.register_forward_pre_hook(before(f"block {i} {name} {FBAR}")))
            handles.append(part.register_forward_hook(on_grad(f"block {i} {name} f")))
    if model.blocks:
        last = model.blocks[-1]
        handles.append(last.register_forward_hook(lambda _m, _a, _o: mark("loss")))
    handles.append(model.register_forward_hook(on_grad("LM head f")))
    try:
        with trace:
            yield out
    finally:
        for h in handles:
            h.remove()
    for i, rec in enumerate(trace.records):
        label = next((lb for at, lb in reversed(marks) if at <= i), "?")
        out.append(Collective(label if rec.phase in ("forward", "backward") else rec.phase, rec))


def _color(label: str) -> str:
    for key, color in (("attention", "C0"), ("MLP", "C1"), ("loss", "C3")):
        if key in label:
            return color
    return "C2" if label in ("embedding", "LM head f") else "grey"


def _tex(label: str) -> str:
    return label.replace(FBAR, r"$\bar{f}$")  # the combining macron renders badly in fonts


def _size(nbytes: float) -> str:
    for unit, scale in (("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:g} B"


def plot_collectives(
    calls: Sequence[Collective], title: str = "", axes: Sequence[Axes] | None = None
) -> Sequence[Axes]:
    """One row per phase (forward, backward, then any other), one bar per collective in call
    order: its logical bytes (log scale), coloured by the part of the model, named below.
    Returns the axes."""
    import matplotlib.pyplot as plt

    phases = list(dict.fromkeys(c.record.phase for c in calls))
    if axes is None:
        width = max(6.0, 0.75 * sum(c.record.phase == phases[0] for c in calls))
        _, axes = plt.subplots(len(phases), 1, figsize=(width, 2.6 * len(phases)), squeeze=False)
        axes = axes[:, 0]
    top = max(c.record.bytes for c in calls)
    most = max(sum(c.record.phase == p for c in calls) for p in phases)
    for ax, ph in zip(axes, phases, strict=True):
        row = [c for c in calls if c.record.phase == ph]
        xs = range(len(row))
        ax.bar(xs, [c.record.bytes for c in row], color=[_color(c.label) for c in row], width=0.6)
        for x, c in zip(xs, row, strict=True):
            ax.text(x, c.record.bytes * 1.15, _size(c.record.bytes), ha="center", fontsize=7)
        ax.set_yscale("log")
        ax.set_ylim(1, top * 8)
        ax.set_xlim(-0.6, most - 0.4)  # the same bar width in every row
        ax.set_xticks(list(xs), [_tex(c.label) for c in row], rotation=35, ha="right", fontsize=8)
        ax.set_ylabel("bytes")
        ops = ", ".join(sorted({c.record.op.replace("_", "-") for c in row}))
        count = f"{len(row)} call" + ("s" if len(row) > 1 else "")
        ax.set_title(f"{ph}: {count} ({ops}), in call order", fontsize=9, loc="left")
    if title:
        axes[0].figure.suptitle(title, fontsize=10)
    axes[0].figure.tight_layout()
    return axes


def held_activations(events: Sequence[Event], stage: int) -> tuple[list[float], list[int]]:
    """Micro-batches (or micro-batch-chunks) whose activations `stage` holds over time: +1 when
    a forward starts storing them, -1 when its backward has finished. Returns the step
    function's corner times (shifted to start at 0) and the count from each time on."""
    t0 = min(e.start for e in events)
    deltas = [(e.start - t0, 1) for e in events if e.stage == stage and e.kind == "F"]
    deltas += [(e.end - t0, -1) for e in events if e.stage == stage and e.kind == "B"]
    times, counts, held = [0.0], [0], 0
    for t, d in sorted(deltas, key=lambda td: (td[0], td[1])):  # a free before a store at a tie
        held += d
        if times[-1] == t:
            counts[-1] = held
        else:
            times.append(t)
            counts.append(held)
    return times, counts


def plot_held_activations(events: Sequence[Event], title: str = "", ax: Axes | None = None) -> Axes:
    """One step line per stage: how many micro-batches' activations it holds at each time of
    the step (`held_activations`); each stage's peak in the legend. Returns the axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3))
    stages = sorted({e.stage for e in events})
    end = max(e.end for e in events) - min(e.start for e in events)
    for s in stages:
        times, counts = held_activations(events, s)
        ax.step(
            times + [end],
            counts + [counts[-1]],
            where="post",
            color=f"C{s}",
            lw=1.6,
            label=f"stage {s}: peak {max(counts)}",
        )
    peak = max(max(held_activations(events, s)[1]) for s in stages)
    ax.set_xlim(0, end)
    ax.set_ylim(-0.3, 1.6 * peak + 1)  # room for the legend above the lines
    ax.legend(fontsize=7, loc="upper center", ncol=2)
    ax.set_xlabel("time (one forward or backward = 1)")
    ax.set_ylabel("micro-batches held")
    ax.set_title(title, fontsize=10)
    return ax


__all__ = [
    "Collective",
    "held_activations",
    "labelled_collectives",
    "plot_collectives",
    "plot_held_activations",
]
