"""The α-β model: ring volumes, the fit recovering known parameters, and a real measurement."""

import pytest

from tpedu import launch
from tpedu.comm import cost_model as cm


@pytest.mark.parametrize("t", [2, 3, 4, 8])
def test_ring_volumes(t):
    n = 1200.0
    assert cm.ring_bytes("all_reduce", n, t) == pytest.approx(2 * (t - 1) / t * n)
    # An all-reduce is a reduce-scatter followed by an all-gather: same bytes, same steps.
    rs, ag = cm.ring_bytes("reduce_scatter", n, t), cm.ring_bytes("all_gather", n, t)
    assert cm.ring_bytes("all_reduce", n, t) == pytest.approx(rs + ag)
    assert cm.ring_steps("all_reduce", t) == cm.ring_steps("reduce_scatter", t) * 2 == 2 * (t - 1)
    assert cm.ring_bytes("send", n, t) == n


def test_unknown_op_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown collective 'allreduce'"):
        cm.ring_bytes("allreduce", 1, 2)


def test_fit_recovers_alpha_and_beta():
    truth = cm.AlphaBeta(alpha=25e-6, beta=1 / 5e9)
    samples = [
        cm.Sample(op, n, t, truth.predict(op, n, t))
        for op in ("all_reduce", "all_gather")
        for n in (1 << 10, 1 << 16, 1 << 22)
        for t in (2, 4)
    ]
    fitted = cm.fit(samples)
    assert fitted.alpha == pytest.approx(truth.alpha, rel=1e-9)
    assert fitted.beta == pytest.approx(truth.beta, rel=1e-9)
    assert fitted.predict("all_reduce", 1 << 20, 1) == 0.0


def test_fit_needs_two_samples():
    with pytest.raises(ValueError, match="at least two samples"):
        cm.fit([cm.Sample("all_reduce", 10, 2, 1.0)])
    # One message size on one group size: every row's bytes are proportional to its steps, so
    # any α trades against β; the fit must refuse rather than return an arbitrary pair.
    one_size = [
        cm.Sample(op, 4096, 2, 1e-3) for op in ("all_reduce", "all_gather", "reduce_scatter")
    ]
    with pytest.raises(ValueError, match="two or more message sizes"):
        cm.fit(one_size)


def measure_small():
    return cm.measure("all_reduce", [4096, 1 << 16], repeats=2, warmup=1)


def test_measure_runs_on_ranks_and_agrees_across_them():
    a, b = launch(measure_small, 2)
    assert a == b  # every rank reports the slowest rank's median
    assert [s.nbytes for s in a] == [4096, 1 << 16] and all(s.seconds > 0 for s in a)
