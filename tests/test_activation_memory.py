"""The measured activation ledger against Korthikanti et al.'s per-layer formulas.

Every comparison is exact (integers of bytes): measured == paper formula + tpedu's known extras,
category by category, for every row of the paper's table, on uneven shapes.
"""

import pytest
import torch
from torch import nn

from tpedu import launch
from tpedu.analysis.activation_memory import (
    LayerCase,
    SavedTensorCounter,
    formula_bytes,
    known_extras,
    measure_rows,
    paper_terms,
)
from tpedu.analysis.memory import activation_bytes_per_layer

# Uneven: s, b, h, a all different, a·s/h not an integer; t = 1, 2, 3 divide s and a.
S, B, H, A = 12, 3, 48, 6
ROWS = [(sp, rc) for sp in (False, True) for rc in ("none", "selective", "full")]


def _shapes(t):
    rows = ROWS if t > 1 else [(False, rc) for rc in ("none", "selective", "full")]
    return [LayerCase.from_symbols(S, B, H, A, t, sp, rc) for sp, rc in rows]


def _worker(t):
    return measure_rows(_shapes(t))


@pytest.mark.parametrize("t", [1, 2, 3])
def test_measured_equals_formula_plus_known_extras(t):
    for rank, measurements in enumerate(launch(_worker, t, t)):
        for m in measurements:
            where = f"{m.case.label()} rank {rank}"
            expected = m.expected()
            assert m.by_category == pytest.approx(expected, abs=0), where  # exact, per category
            extras = known_extras(
                m.case, m.itemsize("dropout masks", 2), m.itemsize("norm statistics", 4)
            )
            assert m.total == formula_bytes(m.case) + sum(extras.values()), where
            # bf16 activations, as in the paper; masks stored in the activation dtype
            floats = {r.dtype for r in m.records if r.category != "causal mask"}
            assert floats <= {torch.bfloat16}, where
            if m.case.recompute == "full":  # only the block input: 2sbh (SP: 2sbh/t)
                assert [r.category for r in m.records] == ["block input"], where


@pytest.mark.parametrize("t", [1, 2, 4, 8])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_paper_terms_sum_to_the_table(t, sp, recompute):
    """The category split adds up to tpedu.analysis.memory's formula (the paper's Table 2)."""
    shape = LayerCase.from_symbols(2048, 4, 4096, 32, t, sp, recompute)
    assert sum(paper_terms(shape).values()) == pytest.approx(
        activation_bytes_per_layer(2048, 4, 4096, 32, t, sp, recompute), rel=1e-15
    )
    s, b, h, a = 2048, 4, 4096, 32
    rows = {  # the paper's rows, written out
        ("none", False): s * b * h * (10 + 24 / t + 5 * a * s / (h * t)),
        ("none", True): s * b * h / t * (34 + 5 * a * s / h),
        ("selective", False): s * b * h * (10 + 24 / t),
        ("selective", True): 34 * s * b * h / t,
        ("full", False): 2 * s * b * h,
        ("full", True): 2 * s * b * h / t,
    }
    assert sum(paper_terms(shape).values()) == pytest.approx(rows[(recompute, sp)], rel=1e-15)


def test_counter_counts_each_storage_once_and_skips_parameters():
    lin = nn.Linear(5, 7)
    x = torch.randn(3, 5, requires_grad=True)
    with SavedTensorCounter(lin) as c:
        y = lin(x)  # saves x (and the weight: a parameter, skipped)
        e = y.exp()  # saves its result e
        z = e * e  # saves e twice: the same storage
        w = z[:, :2].sin()  # saves a view of z: z's whole storage
    assert c.total == x.nbytes + e.nbytes + z.nbytes
    assert [r.module for r in c.records] == ["", "", ""]  # lin is the root itself
    w.sum().backward()
    with SavedTensorCounter() as c2:
        (x * 2).sum()  # a python scalar: nothing saved
    assert c2.total == 0


def test_bad_shapes_are_clear_errors():
    with pytest.raises(ValueError, match=r"t \| a.*valid t: 1, 2, 3, 6"):
        LayerCase.from_symbols(12, 3, 48, 6, t=4)
    with pytest.raises(ValueError, match="sequence parallelism needs t | s"):
        LayerCase.from_symbols(10, 1, 48, 6, t=3, sp=True)
    with pytest.raises(ValueError, match="recompute must be one of"):
        LayerCase.from_symbols(12, 3, 48, 6, recompute="half")


def test_calculator_overlay_draws_measured_activations_over_the_prediction(monkeypatch):
    import matplotlib.pyplot as plt

    from tpedu.analysis.activation_memory import calculator_overlay
    from tpedu.analysis.calculator import memory_calculator
    from tpedu.analysis.memory import GB

    calc = memory_calculator(on_measure=calculator_overlay).calculator
    calc.tp.value, calc.sp.value = 2, True
    text, measured = calculator_overlay(calc.config(), calc.settings())
    predicted = calc.ledger().activations
    assert "measured" in text and "✓" in text
    # tpedu saves the paper's bytes plus its named extras (dropout masks, causal mask, ...)
    assert predicted < measured < 1.5 * predicted

    drawn = []
    monkeypatch.setattr(plt, "show", lambda: drawn.append(plt.gca()))
    calc._measure(lambda config, settings: ("measured here", measured))
    hatched = [p for ax in drawn for p in ax.patches if p.get_hatch() == "//"]
    assert len(hatched) == 1 and abs(hatched[0].get_height() - measured / GB) < 1e-9
    static = calc.ledger().weights + calc.ledger().gradients + calc.ledger().optimizer
    assert abs(hatched[0].get_y() - static / GB) < 1e-9
