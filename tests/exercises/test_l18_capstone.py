"""Grades exercises/l18_capstone.py: the chosen layout fits the capstone's budget, and a run of
it (train with checkpoints, reshard to tp 1, resume, serve at tp 1 and the chosen tp) passes
every artefact check of tpedu.course.capstone."""

import pytest

from tests.helpers import make_artefacts
from tpedu.course import capstone
from tpedu.course.grading import implementation
from tpedu.parallel.config import ParallelConfig

NAME = "l18_capstone"
VOCAB = 4334  # the novel's characters (novel_data("char"))


def _choose(budget=capstone.BUDGET):
    return implementation(NAME).choose(budget.model(VOCAB), budget)


def test_the_choice_fits_the_budget():
    choice = _choose()
    assert isinstance(choice, ParallelConfig)
    ok, peak = capstone.fits(capstone.BUDGET.model(VOCAB), choice)
    assert ok, f"{capstone.describe(choice)}: {peak:,} bytes on the fullest rank"


def test_a_run_of_the_choice_passes_every_artefact_check(tmp_path):
    choice = _choose()
    checks = capstone.check_capstone(make_artefacts(tmp_path, choice))
    assert capstone.passed(checks), "\n".join(map(str, checks))


def test_an_impossible_budget_is_a_value_error():
    with pytest.raises(ValueError):
        _choose(capstone.Budget(bytes_per_rank=10**5))
