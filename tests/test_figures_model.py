"""tpedu.course.figures_model: the lesson figures' data come from a real run and the schedules."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pytest
import torch

from tpedu import launch
from tpedu.comm.tracer import phase
from tpedu.course.figures_model import (
    FBAR,
    held_activations,
    labelled_collectives,
    plot_collectives,
    plot_held_activations,
)
from tpedu.model.config import GPTConfig
from tpedu.model.dense import DenseGPT
from tpedu.model.gpt import TPGPT
from tpedu.parallel.pipeline.schedules import schedule, simulate


def _step(config):
    torch.manual_seed(0)
    model = TPGPT(DenseGPT(config))
    ids = torch.randint(0, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    with labelled_collectives(model) as calls:
        model(ids, ids, step=0).backward()
        with phase("optimizer"):
            model.grad_norm()
    return calls


def test_collectives_are_named_after_the_part_that_ran_them():
    config = GPTConfig.gpt2_like(37, seq_len=8, n_layers=2, hidden=16, n_heads=2)
    calls = launch(_step, 2, config)[0]
    bsh, bs = 2 * 8 * 16, 2 * 8
    forward = [(c.label, c.record.numel) for c in calls if c.record.phase == "forward"]
    backward = [(c.label, c.record.numel) for c in calls if c.record.phase == "backward"]
    assert (
        forward
        == [
            ("embedding", bsh),
            (f"block 0 attention {FBAR}", bsh),
            (f"block 0 MLP {FBAR}", bsh),
            (f"block 1 attention {FBAR}", bsh),
            (f"block 1 MLP {FBAR}", bsh),
        ]
        + [("loss", bs)] * 3
    )
    assert backward == [
        ("LM head f", bsh),
        ("block 1 MLP f", bsh),
        ("block 1 attention f", bsh),
        ("block 0 MLP f", bsh),
        ("block 0 attention f", bsh),
    ]
    assert [(c.label, c.record.numel) for c in calls[-1:]] == [("optimizer", 1)]
    axes = plot_collectives(calls)
    assert [len(ax.patches) for ax in axes] == [8, 5, 1]  # one bar per record
    assert axes[0].patches[0].get_height() == calls[0].record.bytes
    plt.close("all")


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_held_activations_follow_the_schedule(kind):
    p, m = 4, 8
    events = simulate([schedule(kind, m, p, s) for s in range(p)])
    peaks = [max(held_activations(events, s)[1]) for s in range(p)]
    assert peaks == ([m] * p if kind == "gpipe" else [p - s for s in range(p)])
    for s in range(p):
        times, counts = held_activations(events, s)
        assert counts[-1] == 0 and times == sorted(times)
    if kind == "gpipe":  # stage 0 stores at each F's start, frees at each B's end (B0: 14-15)
        rise, fall = [float(t) for t in range(8)], [float(t) for t in range(15, 23)]
        assert held_activations(events, 0) == (rise + fall, [*range(1, 9), *range(7, -1, -1)])
    ax = plot_held_activations(events, kind)
    assert len(ax.get_lines()) == p
    plt.close("all")
