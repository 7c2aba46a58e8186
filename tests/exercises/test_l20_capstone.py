"""Grades exercises/l20_capstone.py: the survey measures every layout of the space (and leaves
out the ones the model cannot run); the choice is a layout within the budget, with a reason
that names it first and cites a figure of it that the grader's dry run gives; and a run of it
(train with checkpoints, reshard to tp 1, resume, serve at tp 1 and the chosen tp) passes every
artefact check of tpedu.course.capstone.

check_capstone's seventh check, that choice.json is what the learner's survey and choose return,
needs the choice.json of the learner's own run, which only notebooks/20_capstone.ipynb writes:
it is not run here, and `make grade` says so (grading.IN_NOTEBOOK)."""

from dataclasses import replace

import pytest

from tests.helpers import capstone_space, make_artefacts
from tpedu.course import capstone
from tpedu.course.capstone import BUDGET, MB, Budget, describe, measure
from tpedu.course.grading import implementation
from tpedu.parallel.config import ParallelConfig

NAME = "l20_capstone"
VOCAB = 4334  # the novel's characters (novel_data("char"))


@pytest.fixture(scope="module")
def candidates():
    """Layouts within the budget and one over it, measured by the tool itself (not the
    learner's survey), with made-up step times for the ones within it."""
    config = BUDGET.model(VOCAB)
    layouts = [ParallelConfig(pp=2, dp=2), ParallelConfig(pp=4), ParallelConfig(tp=2, pp=2)]
    found = [measure(config, p) for p in [*layouts, ParallelConfig(dp=4)]]
    seconds = {describe(c.parallel): 0.2 + 0.05 * i for i, c in enumerate(found) if c.fits()}
    return found, seconds


def _choose(candidates, budget=BUDGET):
    found, seconds = candidates
    return implementation(NAME).choose(found, seconds, budget)


def test_the_survey_measures_every_layout_of_the_space():
    config = BUDGET.model(VOCAB)
    found = implementation(NAME).survey(config, BUDGET)
    assert all(isinstance(c, capstone.Candidate) for c in found)
    got = sorted(describe(c.parallel) for c in found)
    assert got == sorted(
        describe(p) for p in capstone_space(BUDGET.ranks)
    )  # all run: 4 heads, 4 layers
    by_name = {describe(c.parallel): c for c in found}
    for p in (ParallelConfig(tp=2, pp=2), ParallelConfig(dp=4, zero=3)):
        assert by_name[describe(p)] == measure(config, p)
    assert sum(c.fits() for c in found) >= 3, "the budget admits several layouts"


def test_the_survey_leaves_out_layouts_the_model_cannot_run():
    """One head does not split over tp 2, one layer does not make two stages: only the data
    parallel layouts of 2 ranks remain."""
    small = Budget(ranks=2, n_layers=1, hidden=16, n_heads=1, seq_len=16, batch=4)
    found = implementation(NAME).survey(small.model(VOCAB), small)
    assert sorted(describe(c.parallel) for c in found) == sorted(
        describe(ParallelConfig(dp=2, zero=z)) for z in range(4)
    )


def test_the_choice_is_within_the_budget_and_says_why(candidates):
    choice, why = _choose(candidates)
    found, _ = candidates
    assert choice in [c.parallel for c in found if c.fits()], describe(choice)
    capstone.check_why(why, measure(BUDGET.model(VOCAB), choice))  # raises, saying what is wrong


def test_nothing_within_the_budget_is_a_value_error(candidates):
    with pytest.raises(ValueError):
        _choose(candidates, replace(BUDGET, bytes_per_rank=1 * MB))


def test_a_run_of_the_choice_passes_every_artefact_check(candidates, tmp_path):
    choice, why = _choose(candidates)
    checks = capstone.check_capstone(make_artefacts(tmp_path, choice, why=why))
    assert capstone.passed(checks), "\n".join(map(str, checks))
