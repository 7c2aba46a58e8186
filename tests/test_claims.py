"""A lesson's claims print the same on every CPU and fail the cell when they do not hold; the hunt's
and the capstone's verdicts print at their tolerance too."""

import math

import pytest

from tpedu.course import claims
from tpedu.course.troubleshoot import TOLERANCE, Comparison, summary


@pytest.mark.parametrize("diff", [0.0, 2.2e-16, 9.9e-13])
def test_a_claim_prints_its_tolerance_not_the_rounding(diff, capsys):
    claims.check("forward", diff, 1e-12)
    assert capsys.readouterr().out == "forward max |parallel - dense| ≤ 1e-12 ✓\n"


def test_an_exact_claim_prints_zero(capsys):
    claims.check("", 0.0, 0.0, "gathered - dense")
    assert capsys.readouterr().out == "max |gathered - dense| = 0 ✓\n"


@pytest.mark.parametrize("diff, tol", [(1.5e-12, 1e-12), (math.nan, 1e-12), (2e-16, 0.0)])
def test_a_broken_claim_raises(diff, tol, capsys):
    with pytest.raises(AssertionError, match="max |parallel - dense|"):
        claims.check("forward", diff, tol)
    assert capsys.readouterr().out == ""


def test_a_broken_version_must_fail_its_claim(capsys):
    claims.check("naive chunk", 0.98, 1e-12, holds=False)
    assert capsys.readouterr().out == "naive chunk max |parallel - dense| = 9.8e-01 ✗\n"
    with pytest.raises(AssertionError, match="the claim holds"):
        claims.check("naive chunk", 1e-16, 1e-12, holds=False)


def test_claim_without_a_distance(capsys):
    claims.claim("both ranks agree", True)
    assert capsys.readouterr().out == "both ranks agree ✓\n"
    with pytest.raises(AssertionError, match="both ranks agree: does not hold: 3 vs 4"):
        claims.claim("both ranks agree", False, "3 vs 4")


def test_a_healthy_comparison_names_no_worst_gradient():
    """Within the tolerance the worst gradient is an argmax over rounding noise: not printed."""
    cmp = Comparison(1.0, 1.0 + 1e-16, grad_diff={"a": 3e-16, "b": 5e-16})
    assert cmp.summary() == f"loss rel diff ≤ {TOLERANCE:.0e}, every gradient ≤ {TOLERANCE:.0e}"
    assert "<-" not in cmp.table() and "5.0e-16" not in cmp.table()


def test_a_bug_names_its_worst_gradient():
    assert summary(0.0, "blocks.0.attn.qkv.weight", 0.66) == (
        "loss rel diff ≤ 1e-09, worst gradient blocks.0.attn.qkv.weight (6.6e-01)"
    )
    assert summary(3.8e-5, "x", 0.0) == "loss rel diff = 3.8e-05, every gradient ≤ 1e-09"
