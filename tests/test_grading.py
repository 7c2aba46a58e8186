"""The grader: solutions get full marks; every untouched stub is caught as unfinished; the table
prints for both without crashing."""

import ast
import json
import subprocess
import sys

import pytest

from tpedu.course import grading

ROOT = grading.ROOT


def grade(kind, *names):
    p = subprocess.run(
        [sys.executable, "-m", "tpedu.course.grading", kind, *names, "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr
    return {s["exercise"]: s for s in json.loads(p.stdout.strip().splitlines()[-1])}


def public_functions(name):
    tree = ast.parse((ROOT / "exercises" / f"{name}.py").read_text(encoding="utf-8"))
    found = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            found.append(node.name)
        if isinstance(node, ast.ClassDef):
            found += [f.name for f in node.body if isinstance(f, ast.FunctionDef)]
    return found


@pytest.fixture(scope="module")
def exercise_scores():
    return grade("exercises")


def test_every_exercise_has_a_solution_and_tests():
    for name in grading.exercise_names():
        assert (ROOT / "solutions" / f"{name}.py").exists(), name
        assert (ROOT / "tests" / "exercises" / f"test_{name}.py").exists(), name


def test_the_grader_gives_solutions_full_marks():
    """The grader's own counting (make test already runs every exercise test on solutions/)."""
    scores = grade("solutions", "l01_matmul_split", "l02_ring_allreduce")
    assert list(scores) == ["l01_matmul_split", "l02_ring_allreduce"]
    for name, s in scores.items():
        assert s["total"] > 0 and s["passed"] == s["total"] and s["status"] == "done", (
            f"{name}: {s}"
        )


def test_every_untouched_stub_is_caught_as_unfinished(exercise_scores):
    for name in grading.exercise_names():
        left = set(grading.stubs(name))
        if left and left >= set(public_functions(name)) - {"__init__"}:  # still untouched
            s = exercise_scores[name]
            assert s["total"] > 0 and s["passed"] == 0 and s["unfinished"] == s["total"], s


def test_grade_table_prints_for_stubs():
    scores = [grading.Score("l99_demo", passed=0, failed=4, unfinished=4)]
    text = grading.table(scores)
    assert "l99_demo" in text and "not started" in text and "0%" in text
