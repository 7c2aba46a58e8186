"""The bf16 master-weights demonstration (tpedu/course/figures_precision.py): small updates vanish
on a bf16 weight and not on an fp32 one; the runs, their table and their figure."""

import pytest

import tpedu
from tpedu.course import figures_precision as fp


def test_small_updates_are_rounded_away_in_bf16_only():
    assert fp.rounded_away() == (
        "after 100 updates of +0.001: bf16 weight 1.0000, fp32 weight 1.1000"
    )


def test_three_precisions_train_and_draw():
    runs = tpedu.launch(fp.precision_runs, 2, 2, timeout=300)[0]
    assert all(len(runs[name]) == 2 for name in fp.RUNS) and 0 <= runs["lost"] <= 1
    same = {**runs, "lost": 0.7, **{n: [1.0] * 20 for n in fp.RUNS}}
    assert fp.precision_table(same).splitlines() == [
        "last fp32 step: over 50% of the updates would be lost on bf16 weights ✓",
        "bf16, fp32 masters   mean loss of the last 20 steps within 0.1 of fp32's ✓",
        "bf16 everywhere      mean loss of the last 20 steps within 0.1 of fp32's ✓",
    ]
    with pytest.raises(AssertionError, match="bf16 everywhere: mean loss 0.500 from fp32's"):
        fp.precision_table({**same, "bf16 everywhere": [1.5] * 20})
    with pytest.raises(AssertionError, match="only 30% of the updates lost"):
        fp.precision_table({**same, "lost": 0.3})
    fig = fp.plot_precision_runs(runs)
    assert [line.get_label() for line in fig.axes[0].get_lines()] == list(fp.RUNS)
