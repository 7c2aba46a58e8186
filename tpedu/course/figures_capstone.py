"""Lesson 20: the capstone's figures, drawn from what its tools measured and its runs recorded.

    fig = plot_candidates(found, BUDGET, seconds, CHOICE)   # the dry run's bytes held and
                                                            # on the wire, the budget's bounds,
                                                            # the measured steps, the choice
    fig = plot_training(pretrain, run, resumed)             # the loss from the first step to
                                                            # the last, and the resume on top
                                                            # of the straight run

`found`: tpedu.course.capstone.Candidate's (the dry run of each layout); `seconds`:
{describe(layout): seconds per step} from `step_seconds`; the runs: `train`'s JSON summaries
("losses" per step, "history" of validation losses, "settings"). Nothing drawn is typed in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.ticker import MaxNLocator

from tpedu.course.capstone import MB, Budget, Candidate, describe
from tpedu.parallel.config import ParallelConfig

FIT, OVER, CHOSEN = "#4C72B0", "#BBBBBB", "#C44E52"
ALWAYS_SHOWN = ("tp", "pp", "dp")  # 3D parallelism's axes; any other only when it is used


def short(parallel: ParallelConfig) -> str:
    """A layout as a plot label: 'tp2·pp2·dp1', '+SP', '+Z1', '+recompute'."""
    sizes = parallel.layout.sizes.items()
    name = "·".join(f"{a}{n}" for a, n in sizes if n > 1 or a in ALWAYS_SHOWN)
    extra = (" +SP" if parallel.sequence_parallel else "") + (
        f" +Z{parallel.zero}" if parallel.zero else ""
    )
    if parallel.recompute != "none":
        extra += f" +{parallel.recompute}"
    return name + extra


def first_step(summary: Mapping) -> int:
    """The first step a run ran: train runs steps first .. settings.train.steps - 1."""
    return summary["settings"]["train"]["steps"] - len(summary["losses"])


def plot_candidates(
    found: Sequence[Candidate],
    budget: Budget,
    seconds: Mapping[str, float] | None = None,
    choice: ParallelConfig | None = None,
) -> Figure:
    """Left: every candidate's fullest rank (x) against its bytes on the wire per step (y), the
    budget's two bounds as lines around the region within both (shaded), the layouts there
    in colour and numbered, the others grey, the choice circled. Right (with `seconds`): the
    measured step of each numbered layout, under its number and name, the choice in red."""
    wide = seconds is not None
    fig, axes = plt.subplots(1, 2 if wide else 1, figsize=(12, 4.4) if wide else (6.5, 4.4))
    ax = axes[0] if wide else axes
    mem, sent = budget.bytes_per_rank / MB, budget.sent_per_rank / MB
    ax.add_patch(Rectangle((0, 0), mem, sent, color=FIT, alpha=0.08, lw=0))
    ax.axvline(mem, color="k", ls="--", lw=0.9)
    ax.axhline(sent, color="k", ls=":", lw=0.9)
    xs = [c.peak / MB for c in found]
    ys = [c.sent / MB for c in found]
    inside = [c.fits(budget) for c in found]
    ax.scatter(xs, ys, c=[FIT if ok else OVER for ok in inside], s=36, zorder=3)
    ax.set_xlim(0, 1.08 * max([*xs, mem]))
    ax.set_ylim(0, 1.1 * max([*ys, sent]))
    named = [(c, x, y) for c, x, y, ok in zip(found, xs, ys, inside, strict=True) if ok]
    for i, (_, x, y) in enumerate(named, 1):  # the numbers of the bars on the right
        ax.annotate(str(i), (x, y), xytext=(4, 3), textcoords="offset points", fontsize=8)
    span = (ax.get_xlim()[1], ax.get_ylim()[1])
    if choice is not None and choice in [c.parallel for c in found]:
        mine = next(c for c in found if c.parallel == choice)
        ax.scatter([mine.peak / MB], [mine.sent / MB], s=220, facecolors="none",
                   edgecolors=CHOSEN, linewidths=2, zorder=4, label="the choice")  # fmt: skip
        ax.legend(loc="upper left", fontsize=8)
    ax.text(mem, span[1], f"memory per rank {mem:g} MB ", rotation=90, va="top", ha="right",
            fontsize=8)  # fmt: skip
    ax.text(span[0], sent, f"on the wire per step {sent:g} MB", va="bottom", ha="right",
            fontsize=8)  # fmt: skip
    ax.set_xlabel("fullest rank, MB (dry run: weights, grads, AdamW, activations)")
    ax.set_ylabel("most bytes a rank puts on the wire per step, MB (dry run)")
    ax.set_title(
        f"{len(found)} layouts of {budget.ranks} ranks: {sum(inside)} within the budget "
        "(grey: over a bound)",
        fontsize=10,
    )
    if wide:
        numbered = [(i, c) for i, (c, _, _) in enumerate(named, 1)]
        timed = [(i, c) for i, c in numbered if describe(c.parallel) in seconds]
        names = [f"{i}  {short(c.parallel)}" for i, c in timed]
        timed = [c for _, c in timed]
        ms = [1e3 * seconds[describe(c.parallel)] for c in timed]
        bar_colours = [CHOSEN if c.parallel == choice else FIT for c in timed]
        axes[1].barh(names[::-1], ms[::-1], color=bar_colours[::-1])
        for i, v in enumerate(ms[::-1]):
            axes[1].text(v, i, f" {v:.0f}", va="center", fontsize=8)
        axes[1].set_xlabel("ms per training step, measured here (slowest rank, median)")
        axes[1].set_title("The layouts within the budget, one real step each", fontsize=10)
        axes[1].tick_params(axis="y", labelsize=8)
    fig.tight_layout()
    return fig


def plot_training(pretrain: Mapping, run: Mapping, resumed: Mapping) -> Figure:
    """Left: the training loss of every step, pretraining (with its validation losses) then
    the run under the chosen layout. Right: that run from the step the resumed run started
    at, with the resumed run's losses on top (another layout, the same losses)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 3.8))
    a, b, c = first_step(pretrain), first_step(run), first_step(resumed)
    where = lambda s: describe(ParallelConfig.from_dict(s["settings"]["parallel"]))
    left.plot(range(a, a + len(pretrain["losses"])), pretrain["losses"], lw=0.7, color="#999999",
              label=f"pretraining ({where(pretrain)}), train loss")  # fmt: skip
    val = pretrain.get("history") or []
    if val:
        left.plot([h["step"] for h in val], [h["val_loss"] for h in val], "o-", color=FIT,
                  label="pretraining, validation loss")  # fmt: skip
    left.plot(range(b, b + len(run["losses"])), run["losses"], lw=1.2, color=CHOSEN,
              label=f"continued on {where(run)}")  # fmt: skip
    left.axvline(c, color="k", ls=":", lw=0.8)
    left.set_xlabel("step (dotted: where the checkpoint was resharded)")
    left.set_ylabel("cross-entropy, nats per character")
    left.set_title("The served model's training")
    left.legend(fontsize=8)
    straight = run["losses"][c - b :]
    right.plot(range(c, c + len(straight)), straight, "-", color=CHOSEN, lw=2,
               label=f"straight run ({where(run)})")  # fmt: skip
    right.plot(range(c, c + len(resumed["losses"])), resumed["losses"], "o", color="k", ms=4,
               label=f"resharded at step {c}, resumed ({where(resumed)})")  # fmt: skip
    right.xaxis.set_major_locator(MaxNLocator(integer=True))
    right.set_xlabel("step")
    right.set_title("Resumed on another layout: the same losses")
    right.legend(fontsize=8)
    fig.tight_layout()
    return fig
