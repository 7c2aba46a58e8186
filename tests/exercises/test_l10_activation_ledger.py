"""Grades exercises/l10_activation_ledger.py: the saved-tensor byte counter and the formula.

Byte counts are integers: compared exactly. Formula values are compared to 1e-12 relative (they
are float sums of a few terms). tpedu's own counter and formula (tpedu.analysis.activation_memory,
tpedu.analysis.memory) refuse to run while the tests do, so a wrapper or an alias of them fails.
"""

import pytest
import torch
from torch import nn

from tests.exercises import refusing
from tpedu.analysis import activation_memory, memory
from tpedu.course.grading import implementation

NAME = "l10_activation_ledger"
TWINS = (
    activation_memory.saved_bytes,
    activation_memory.SavedTensorCounter._pack,
    activation_memory.paper_terms,
    memory.activation_bytes_per_layer,
)


@refusing(*TWINS)
def test_counter_counts_activations_not_parameters() -> None:
    m = implementation(NAME)
    torch.manual_seed(0)
    lin = nn.Linear(7, 5)
    x = torch.randn(3, 7, requires_grad=True)
    got = m.saved_bytes(lin, x, skip=lin.parameters())
    assert got == x.nbytes, f"Linear saves its input only ({x.nbytes} B), got {got}"
    # Without skip the weight counts too (the bias is not saved: its gradient needs no input).
    got = m.saved_bytes(lin, x)
    assert got == x.nbytes + lin.weight.nbytes, f"got {got}"


def _chain(x: torch.Tensor) -> torch.Tensor:
    e = x.exp()  # saves its result e
    z = e * e  # saves e as both operands: one storage
    return z[:, 1:].sin()  # saves a view of z: z's whole storage


@refusing(*TWINS)
def test_each_storage_counts_once() -> None:
    m = implementation(NAME)
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    want = 2 * x.nbytes  # e and z, each [4, 3] float64
    got = m.saved_bytes(_chain, x)
    assert got == want, (
        f"expected {want} B (e and z once each), got {got} (|diff| {abs(got - want)})"
    )
    got32 = m.saved_bytes(_chain, x.detach().float().requires_grad_())
    assert got32 * 2 == got, "float32 saves half the bytes of float64"


@refusing(*TWINS)
def test_views_of_one_buffer_count_once() -> None:
    m = implementation(NAME)
    qkv = torch.randn(2, 5, 9, requires_grad=True)

    def attention_like(t: torch.Tensor) -> torch.Tensor:
        big = t * 1.0  # a fresh [2, 5, 9] buffer (a scalar multiply saves nothing)
        q, k, v = big.split(3, dim=-1)  # three views of it
        return (q * k + v.exp()).sum()  # mul saves q and k, exp saves its result

    got = m.saved_bytes(attention_like, qkv)
    want = qkv.nbytes + 2 * 5 * 3 * 4  # big's storage once + exp's result [2, 5, 3]
    assert got == want, f"expected {want} B, got {got}"


def _paper(s, b, h, a, t, sp, recompute):
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sp else 1)
    att = 0 if recompute == "selective" else 5 * a * s / h
    return sbh / t * (34 + att) if sp else sbh * (10 + 24 / t + att / t)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@refusing(*TWINS)
def test_formula_rows(recompute: str) -> None:
    m = implementation(NAME)
    for s, b, h, a, t in [(2048, 4, 4096, 32, 1), (1000, 3, 960, 12, 3), (96, 5, 80, 10, 5)]:
        for sp in (False, True):
            got = m.activation_bytes_per_layer(s, b, h, a, t, sp, recompute)
            want = _paper(s, b, h, a, t, sp, recompute)
            assert got == pytest.approx(want, rel=1e-12), (
                f"s={s} b={b} h={h} a={a} t={t} sp={sp} {recompute}: got {got}, want {want}, "
                f"|diff| {abs(got - want):.3e}"
            )


@refusing(*TWINS)
def test_formula_rejects_unknown_recompute() -> None:
    m = implementation(NAME)
    with pytest.raises(ValueError, match="recompute"):
        m.activation_bytes_per_layer(128, 1, 64, 4, 1, False, "partial")
