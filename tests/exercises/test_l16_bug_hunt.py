"""Grades exercises/l16_bug_hunt.py: for each of lesson 16's cases, the fix `case_k()` returns.

A case is tpedu run with one function edited (the bug); `case_k()` names one of the case's
suspects and returns a rewrite of it. Two tests per case, each through the case's own check
(float64 TP vs tp=1, the pipeline step, the greedy tokens):

- closed: with the bug in place and your function in place of the suspect you named, the check
  passes on every rank, where without your function it fails; it passes too on runs the case
  never shows (other shapes, layouts, seeds), and your function never calls tpedu's own version
  of the suspect (which, while the check runs, is the broken one);
- a real fix: on tpedu without the bug, your function in place of that suspect keeps the check
  passing (a rewrite that only compensates for the broken function elsewhere would not).

The zoo's tests (tests/test_bugzoo.py) prove each case's bug fails its check and that the check
passes on tpedu.
"""

import pytest

import tpedu
from tpedu.course import hunt
from tpedu.course.grading import implementation
from tpedu.course.hunt_cases import CASES

NAME = "l16_bug_hunt"


def _fix(k):
    """(suspect name, your function) from case_k(), checked as hunt.check checks it."""
    make = getattr(implementation(NAME), f"case_{k}")
    return hunt.fix_of(k, make)  # raises NotImplementedError while case_k is a stub


def _healthy_worker(k, fix):
    name, fn = fix
    suspect = next(s for s in CASES[k - 1].suspects(k) if s.name == name)
    with suspect.install(fn):  # tpedu as it is, your function in place of the suspect
        return CASES[k - 1].check()


@pytest.mark.parametrize("case", hunt.numbers())
def test_your_fix_closes_the_case(case):
    fix = _fix(case)
    results = tpedu.launch(hunt.run_case, hunt.world(case), case, fix, False, timeout=120)
    assert not all(r["broken"][0] for r in results), "the broken run passed its check"
    bad = [f"rank {q}: {r['fixed'][1]}" for q, r in enumerate(results) if not r["fixed"][0]]
    assert not bad, f"case {case} with your {fix[0]}: the check still fails: " + "; ".join(bad)


@pytest.mark.parametrize("case", hunt.numbers())
def test_your_fix_keeps_a_healthy_run_healthy(case):
    fix = _fix(case)
    results = tpedu.launch(_healthy_worker, hunt.world(case), case, fix, timeout=120)
    bad = [f"rank {q}: {detail}" for q, (ok, detail) in enumerate(results) if not ok]
    assert not bad, f"tpedu with your {fix[0]} (and no bug) fails case {case}'s check: " + (
        "; ".join(bad)
    )
