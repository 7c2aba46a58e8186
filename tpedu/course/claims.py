"""Course infrastructure: a lesson's claims, printed the same on every CPU and asserted.

A lesson claims `max |parallel - dense| ≤ tol`. The number under the bound depends on the
kernels the CPU runs: AVX-512, AVX2 and SSE code block a matmul differently, so a sum of the same
float64 products can come out 0.0 on one laptop and 2e-16 on another. The claim does not depend on
them, so it is what a lesson prints, at its tolerance: a stored notebook output then holds on any
CPU, and a claim that fails raises, so the cell (and nbval) fails on every machine.

    check("forward", diff, 1e-12)            forward max |parallel - dense| ≤ 1e-12 ✓
    check("gathered weights", diff, 0.0)     gathered weights max |parallel - dense| = 0 ✓
    check("no f", diff, 1e-12, holds=False)  no f max |parallel - dense| = 2.8e+01 ✗

A claim about the learner's code (run through `pick`) names what usually breaks it, so a failure
points at the bug, not only at the claim:

    check("dL/dx", diff, 1e-12, causes="f missing: no all-reduce of dL/dx in backward")
    AssertionError: dL/dx: max |parallel - dense| = 1.2e+00: the claim fails.
    Likely causes: f missing: no all-reduce of dL/dx in backward

Use tol = 0 only where the arithmetic is the same on every kernel: copies and gathers, integer-
valued data whose sums are exact in any order, or a fixed-order matmul (lesson 01).
"""

from __future__ import annotations


def within(value: float, tol: float) -> str:
    """`value` as a claim: "≤ tol" when it holds (below the bound its digits are rounding, which
    the CPU decides); the value itself when it does not."""
    if tol == 0:
        return "= 0" if value == 0 else f"= {value:.1e}"
    return f"≤ {tol:.0e}" if value <= tol else f"= {value:.1e}"


def _likely(causes: str) -> str:
    return f".\nLikely causes: {causes}" if causes else ""


def check(
    label: str,
    diff: float,
    tol: float,
    name: str = "parallel - dense",
    holds: bool = True,
    causes: str = "",
) -> None:
    """Print `label max |name| ≤ tol ✓`; raise AssertionError when `diff` exceeds `tol` (or is
    NaN), naming the likely `causes` if given. `label` may be "" for the bare claim. holds=False
    is for a lesson's deliberately broken version: its claim must fail, and it prints ✗ with the
    value (a bug's, far above rounding)."""
    if (diff <= tol) != holds:
        verdict = "holds" if holds is False else "fails"
        raise AssertionError(
            f"{label.strip() or name}: max |{name}| {within(diff, tol)}: the claim {verdict}"
            + _likely(causes if holds else "")
        )
    print(f"{label} max |{name}| {within(diff, tol)} {'✓' if holds else '✗'}".lstrip())


def claim(label: str, ok: bool, detail: str = "", causes: str = "") -> None:
    """Print `label ✓` for a claim that is not a distance (a count, an equality of ids);
    raise AssertionError with `detail` (and the likely `causes`) when it does not hold."""
    if not ok:
        raise AssertionError(
            f"{label}: does not hold{': ' + detail if detail else ''}{_likely(causes)}"
        )
    print(f"{label} ✓")
