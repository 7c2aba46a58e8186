"""tpedu.course.figures_capstone: what the figures draw is the data they are given."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np

from tpedu.course.capstone import MB, Budget, Candidate, describe
from tpedu.course.figures_capstone import first_step, plot_candidates, plot_training, short
from tpedu.parallel.config import ParallelConfig

BUDGET = Budget(bytes_per_rank=23 * MB, sent_per_rank=13 * MB)
FOUND = [
    Candidate(ParallelConfig(dp=4), 48 * MB, 8 * MB),  # over the memory
    Candidate(ParallelConfig(pp=2, dp=2, zero=2), 22 * MB, 7 * MB),
    Candidate(ParallelConfig(tp=2, pp=2), 18 * MB, 12 * MB),
    Candidate(ParallelConfig(tp=2, pp=2, sequence_parallel=True), 16 * MB, 14 * MB),  # wire
]


def test_short_names():
    assert short(ParallelConfig(tp=2, pp=2)) == "tp2·pp2·dp1"
    assert short(ParallelConfig(pp=2, dp=2, zero=1)) == "tp1·pp2·dp2 +Z1"
    assert short(ParallelConfig(tp=2, cp=2, sequence_parallel=True)) == "tp2·cp2·pp1·dp1 +SP"


def test_the_candidates_are_drawn_where_the_dry_run_put_them():
    seconds = {describe(c.parallel): s for c, s in zip(FOUND[1:3], (0.21, 0.32), strict=True)}
    fig = plot_candidates(FOUND, BUDGET, seconds, ParallelConfig(tp=2, pp=2))
    scatter, bars = fig.axes
    points = scatter.collections[0].get_offsets()
    np.testing.assert_allclose(points, [[c.peak / MB, c.sent / MB] for c in FOUND])
    colours = scatter.collections[0].get_facecolors()
    fit = [tuple(colours[i]) == tuple(colours[1]) for i in range(len(FOUND))]
    assert fit == [False, True, True, False]  # within both bounds: one colour
    circled = scatter.collections[1].get_offsets()
    np.testing.assert_allclose(circled, [[18, 12]])  # the choice
    lines = {tuple(line.get_xdata()) for line in scatter.lines} | {
        tuple(line.get_ydata()) for line in scatter.lines
    }
    assert (23, 23) in lines and (13, 13) in lines  # the two bounds, in MB
    assert "on the wire" in scatter.get_ylabel()  # ring volumes, not the tensors' bytes
    numbers = [(t.get_text(), t.xy) for t in scatter.texts if t.get_text().isdigit()]
    assert numbers == [("1", (22, 7)), ("2", (18, 12))]  # the layouts within the budget
    fig.canvas.draw()
    labels = [t.get_text() for t in bars.get_yticklabels()][::-1]  # barh draws bottom up
    assert labels == ["1  tp1·pp2·dp2 +Z2", "2  tp2·pp2·dp1"]
    widths = [p.get_width() for p in bars.patches][::-1]
    np.testing.assert_allclose(widths, [210, 320])  # ms per step, in the same order
    plt.close(fig)


def test_without_times_only_the_scatter():
    fig = plot_candidates(FOUND, BUDGET)
    assert len(fig.axes) == 1
    plt.close(fig)


def _summary(first, losses, parallel, history=()):
    return {
        "losses": losses,
        "history": list(history),
        "settings": {"train": {"steps": first + len(losses)}, "parallel": parallel.to_dict()},
    }


def test_the_training_figure_draws_every_recorded_loss():
    pre = _summary(0, [8.0, 6.0, 5.0, 4.8], ParallelConfig(dp=2), [{"step": 4, "val_loss": 4.9}])
    run = _summary(4, [4.7, 4.6, 4.55, 4.5], ParallelConfig(tp=2, pp=2))
    resumed = _summary(6, [4.55, 4.5], ParallelConfig())
    assert [first_step(s) for s in (pre, run, resumed)] == [0, 4, 6]
    fig = plot_training(pre, run, resumed)
    left, right = fig.axes
    drawn = {tuple(line.get_xdata()): list(line.get_ydata()) for line in left.lines}
    assert drawn[(0, 1, 2, 3)] == pre["losses"]
    assert drawn[(4,)] == [4.9]
    assert drawn[(4, 5, 6, 7)] == run["losses"]
    straight, again = right.lines
    assert list(straight.get_xdata()) == [6, 7] and list(straight.get_ydata()) == [4.55, 4.5]
    assert list(again.get_xdata()) == [6, 7] and list(again.get_ydata()) == resumed["losses"]
    plt.close(fig)
