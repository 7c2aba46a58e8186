"""The grader: solutions get full marks; every untouched stub is caught as unfinished; the table
prints for both without crashing, and lists each exercise's failing tests (first lines, capped)
with the command that grades it alone; one exercise is graded by its lesson ("l04"). Hints: every
exercise has at least three, in order, and asks for them fail clearly. Stubs do not dictate code;
solutions are written out, not re-exported. pick: the reference's pieces run in the learner's
module (tests/test_grading_cheats.py holds the ways around it that are refused). A check the
tests cannot run (the capstone's author check) is named in the table, not counted as passed; every
lesson's stored outputs say whose code ran for each picked piece it calls."""

import ast
import json
import re
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
    assert "hint l03 1" in text  # the learner is told how to ask for hints


# ---- hints


def test_every_exercise_has_at_least_three_hints_in_order():
    for name in grading.exercise_names():
        texts = grading.hints(name)  # raises unless the levels read 1, 2, ..., n
        assert len(texts) >= 3, f"{name}: {len(texts)} hints"
        for level, text in enumerate(texts, 1):
            assert len(text) > 80, f"{name} hint {level} is too short to help: {text!r}"
            shown = grading.hint(name, level)
            assert shown.startswith(f"{name}, hint {level} of {len(texts)}:") and text in shown
            assert repr(shown) == str(shown)  # a notebook shows the text, not a quoted string
        assert len(set(texts)) == len(texts), f"{name}: two hints are the same"


def test_hints_out_of_order_are_an_error(tmp_path, monkeypatch):
    (tmp_path / "l03_conjugate_ops.md").write_text("## Hint 1\na\n## Hint 3\nb\n")
    monkeypatch.setattr(grading, "HINTS", tmp_path)
    with pytest.raises(ValueError, match=r"1, 2, \.\.\., got \[1, 3\]"):
        grading.hints("l03")


def test_hint_accepts_the_short_and_the_full_name():
    assert grading.hint("l03", 2) == grading.hint("l03_conjugate_ops", 2)
    assert grading.resolve("l09") == "l09_context_parallel"


def test_hint_errors_name_the_valid_choices():
    with pytest.raises(ValueError, match="no exercise 'l99'.*l03_conjugate_ops"):
        grading.hint("l99", 1)
    with pytest.raises(ValueError, match="l12_bucketed_allreduce.*l12_zero.*full name"):
        grading.hint("l12", 1)  # two exercises in lesson 12
    n = len(grading.hints("l03"))
    for bad in (0, n + 1, "1", 1.0, True):
        with pytest.raises(ValueError, match=f"hint levels 1 to {n}"):
            grading.hint("l03", bad)


def test_tpedu_grading_hint_is_the_graders():
    import tpedu.grading

    assert tpedu.grading.hint("l03", 1) == grading.hint("l03_conjugate_ops", 1)


def test_hint_command_line(capsys):
    """A started interpreter for a hint and for one refusal (the exit codes of the command
    itself); the other refusals through grading.main in this process (an interpreter start with
    torch costs 3-5 s each)."""

    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "tpedu.course.grading", "hint", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )

    def here(*args):
        code = grading.main(["hint", *args])
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out, err)

    ok = run("l03", "2")
    assert ok.returncode == 0 and ok.stdout.strip() == str(grading.hint("l03", 2)), ok.stderr
    assert here("l03", "2").stdout == ok.stdout
    refusals = [(("l99",), run("l99"))]  # the started command's own exit code 2
    refusals += [(bad, here(*bad)) for bad in (("l03", "9"), ("l03", "two"), ())]
    for bad, p in refusals:
        assert p.returncode == 2 and p.stderr.strip() and not p.stdout, (bad, p)


# ---- stubs teach, solutions show


def _raises_not_implemented(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            if getattr(node.exc.func, "id", None) == "NotImplementedError":
                yield node.exc


def test_stub_messages_point_at_hints_and_do_not_dictate_code():
    """Every message is one plain sentence and the hint call; no code (calls, indexing,
    assignments, attribute access) that would hand over the solution."""
    for name in grading.exercise_names():
        tree = ast.parse((ROOT / "exercises" / f"{name}.py").read_text(encoding="utf-8"))
        calls = list(_raises_not_implemented(tree))
        assert calls, f"{name}: no stub left"
        for call in calls:
            assert len(call.args) == 1 and isinstance(call.args[0], ast.Constant), name
            msg = call.args[0].value
            ask = re.search(r"hint: tpedu\.grading\.hint\('([a-z0-9_]+)', 1\)$", msg)
            assert ask and grading.resolve(ask.group(1)) == name, f"{name}: {msg!r}"
            prose = msg[: ask.start()]
            code_like = re.search(
                r"[()\[\]=]|\w\.\w|->|\b(return|lambda|import|def)\b|\bfor\b.*\bin\b", prose
            )
            assert not code_like, f"{name}: the stub message dictates code: {msg!r}"


def _tpedu_imports(tree):
    """Names a module binds by importing from tpedu (functions, classes or modules)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "tpedu":
            found |= {a.asname or a.name for a in node.names}
        if isinstance(node, ast.Import):
            found |= {
                (a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith("tpedu")
            }
    return found


def _is_a_forward(fn, imported):
    """A function whose body (docstring aside) is one `return f(...)` (or `f(...)[i]`) with f
    imported from tpedu: a re-export in disguise. Collectives are called through their module
    (`collectives.all_reduce`), an attribute, so communication inside a body never counts."""
    body = fn.body[1:] if ast.get_docstring(fn) is not None else fn.body
    if len(body) != 1 or not isinstance(body[0], ast.Return):
        return False
    value = body[0].value
    while isinstance(value, (ast.Subscript, ast.Attribute)):
        value = value.value
    return (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Name)
        and value.func.id in imported
    )


def test_solutions_are_written_out_not_re_exported():
    """Every public function and class of an exercise is defined in its solution (not imported),
    and none of their bodies is just `return <tpedu function>(...)`: a stuck learner reads the
    arithmetic, not a pointer into the package."""
    for name in grading.exercise_names():
        tree = ast.parse((ROOT / "solutions" / f"{name}.py").read_text(encoding="utf-8"))
        imported = _tpedu_imports(tree)
        defined = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        for public in set(public_functions(name)) - {"__init__"} | _public_classes(name):
            owner = defined.get(public) or next(
                (
                    c
                    for c in defined.values()
                    if isinstance(c, ast.ClassDef)
                    and any(isinstance(f, ast.FunctionDef) and f.name == public for f in c.body)
                ),
                None,
            )
            assert owner is not None, f"solutions/{name}.py does not define {public}"
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                assert not _is_a_forward(node, imported), (
                    f"solutions/{name}.py: {node.name} only calls into tpedu"
                )


def _public_classes(name):
    tree = ast.parse((ROOT / "exercises" / f"{name}.py").read_text(encoding="utf-8"))
    return {n.name for n in tree.body if isinstance(n, ast.ClassDef)}


# ---- pick: the learner's functions where written, the reference's for the rest

_EXERCISE = """
SCALE = 10  # the learner's own constant


def double(x):
    return 2 * x * SCALE // 10


def quadruple_plus_one(x):
    return double(double(x)) + 1  # calls its neighbour: the reference's while that one is a stub


def triple(x):
    raise NotImplementedError("l99: write triple; hint: tpedu.grading.hint('l99', 1)")


class Counter:
    def __init__(self):
        self.n = 0

    def bump(self):
        raise NotImplementedError("l99: write bump; hint: tpedu.grading.hint('l99', 1)")
"""

_REFERENCE = """
def double(x):
    return -1  # never right: shows when the reference's double ran


def quadruple_plus_one(x):
    return -1


def triple(x):
    return 3 * x


class Counter:
    def __init__(self):
        self.n = 100

    def bump(self):
        self.n += 1
        return self.n
"""


@pytest.fixture
def demo_course(tmp_path, monkeypatch):
    """A course of one exercise, l99_demo, in tmp_path: exercises/ and solutions/ packages."""
    for kind, text in (("exercises", _EXERCISE), ("solutions", _REFERENCE)):
        (tmp_path / kind).mkdir()
        (tmp_path / kind / "__init__.py").write_text("")
        (tmp_path / kind / "l99_demo.py").write_text(text)
    monkeypatch.setattr(grading, "ROOT", tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("exercises", "solutions", "solutions.l99_demo", "exercises.l99_demo"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.delenv("TPEDU_IMPL", raising=False)
    yield tmp_path / "exercises" / "l99_demo.py"
    for name, module in list(sys.modules.items()):  # monkeypatch then restores the real ones
        if str(getattr(module, "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]


def test_pick_mixes_the_learners_functions_with_the_references(demo_course, capsys):
    m = grading.pick("l99")
    line = capsys.readouterr().out.strip()
    ref = grading.implementation("l99_demo", "solutions")
    assert m.double(4) == 8 and m.double is not ref.double  # written: the learner's
    assert m.triple(4) == 12 and grading.whose(m, "triple") == "reference"  # a stub
    assert m.Counter().bump() == 101 and grading.whose(m, "Counter") == "reference"
    assert m.triple.__globals__ is vars(m)  # the reference's code, run in the learner's module
    assert m.quadruple_plus_one(1) == 5  # the learner's, calling the learner's double
    assert m.SCALE == 10  # the learner's module keeps its own names
    assert grading.whose(m, "double") == "yours" and grading.whose(m, "triple") == "reference"
    assert line == (
        "l99_demo: yours: double, quadruple_plus_one · reference: triple, Counter "
        "(still raise NotImplementedError; Counter runs as a whole class: bump not written yet)"
    )
    # the grader's module is untouched: its stub still raises
    with pytest.raises(NotImplementedError):
        grading.implementation("l99_demo", "exercises").triple(1)


def test_a_written_function_calls_the_references_helper_while_its_own_is_a_stub(
    demo_course, capsys
):
    text = demo_course.read_text()
    stubbed = text.replace("return 2 * x * SCALE // 10", "raise NotImplementedError('l99')")
    demo_course.write_text(stubbed)
    m = grading.pick("l99_demo")  # the file is read again: the edit counts
    assert grading.whose(m, "double") == "reference" and m.double(4) == -1
    assert m.quadruple_plus_one(1) == 0  # the learner's code, through the reference's double
    assert (
        "yours: quadruple_plus_one · reference: double, triple, Counter" in capsys.readouterr().out
    )


def test_pick_when_everything_is_written_and_when_forced(demo_course, capsys, monkeypatch):
    text = demo_course.read_text().replace(
        "raise NotImplementedError(\"l99: write triple; hint: tpedu.grading.hint('l99', 1)\")",
        "return x + x + x",
    )
    demo_course.write_text(
        text.replace(
            "raise NotImplementedError(\"l99: write bump; hint: tpedu.grading.hint('l99', 1)\")",
            "self.n += 1\n        return self.n",
        )
    )
    m = grading.pick("l99")
    assert m.Counter().bump() == 1 and grading.whose(m, "triple") == "yours"
    assert capsys.readouterr().out.strip() == (
        "l99_demo: your code runs for every function and class: "
        "double, quadruple_plus_one, triple, Counter"
    )
    monkeypatch.setenv("TPEDU_IMPL", "solutions")
    m = grading.pick("l99")
    assert m is grading.implementation("l99_demo", "solutions") and m.double(4) == -1
    assert grading.whose(m, "double") == "reference"
    assert capsys.readouterr().out.strip() == (
        "l99_demo: the reference runs for every function and class (TPEDU_IMPL=solutions): "
        "double, quadruple_plus_one, triple, Counter"
    )
    monkeypatch.setenv("TPEDU_IMPL", "nonsense")
    with pytest.raises(ValueError, match="TPEDU_IMPL must be one of"):
        grading.pick("l99")


def test_pick_names_every_function_of_the_real_exercises(monkeypatch, capsys):
    """Under TPEDU_IMPL=solutions (the stored notebook outputs), one line per exercise that
    lists every public function and class of its stub file, and the reference module itself."""
    monkeypatch.setenv("TPEDU_IMPL", "solutions")
    for name in grading.exercise_names():
        m = grading.pick(name)
        assert m is grading.implementation(name, "solutions")
        line = capsys.readouterr().out.strip()
        tree = ast.parse((ROOT / "exercises" / f"{name}.py").read_text(encoding="utf-8"))
        public = [
            n.name
            for n in tree.body
            if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and not n.name.startswith("_")
        ]
        assert line.startswith(f"{name}: the reference runs for every ") and line.endswith(
            "(TPEDU_IMPL=solutions): " + ", ".join(public)
        ), line


def test_the_bug_hunt_says_when_the_reference_ran():
    """hunt.check(k, m) says "closed" only when case_k is the learner's; the reference's (pick's
    stand-in for a stub) is "not written yet", and says the reference fix ran."""
    from tpedu.course import hunt

    ref = grading.implementation("l16_bug_hunt", "solutions")
    assert {grading.whose(ref, f"case_{k}") for k in hunt.numbers()} == {"reference"}
    per_rank = [{"broken": (False, "b"), "fixed": (True, "f"), "shown": None}] * hunt.world(1)
    by_reference = hunt.verdict(1, "reference", per_rank)
    assert str(by_reference).startswith("Case 1: not written yet") and not by_reference.closed
    assert "The reference fix ran" in str(by_reference)
    assert str(hunt.verdict(1, "yours", per_rank, "f")).startswith("Case 1 closed: with your f")


# ---- make grade says what failed, and grades one exercise by its short name


def test_grade_table_shows_what_failed_and_how_to_grade_it_alone():
    failures = [(f"test_{k}", f"AssertionError: claim {k} fails\nmore") for k in range(7)]
    scores = [
        grading.Score("l04_parallel_linear", passed=3, failed=7, unfinished=0, failures=failures),
        grading.Score("l05_qkv_split", failed=2, unfinished=2, failures=failures[:2]),
        grading.Score("l12_zero", passed=1, failed=1, failures=[("test_z", "x" * 300)]),
    ]
    text = grading.table(scores)
    block = text[text.index("l04_parallel_linear: 7 of 10 tests fail") :]
    shown = [f"    test_{k}: AssertionError: claim {k} fails" for k in range(grading.SHOWN)]
    assert block.splitlines()[1 : grading.SHOWN + 1] == shown  # first lines only, capped
    assert "test_5" not in text and "... and 2 more" in block
    assert "grade it alone: make grade EX=l04" in block
    assert "l05_qkv_split: " not in text  # not started: nothing to list, the table says so
    assert "make grade EX=l12_zero" in text  # l12 names two exercises: the full name
    assert max(map(len, text.splitlines())) <= 110  # a long message is clipped


def test_the_command_line_takes_short_names_and_help(monkeypatch, capsys):
    asked = []
    monkeypatch.setattr(grading, "grade", lambda kind, quiet=True, names=None: asked.append((kind, names)) or [])  # fmt: skip
    assert grading.main(["--help"]) == 0 and "usage:" in capsys.readouterr().out and not asked
    assert grading.main(["l04"]) == 0 and asked[-1] == ("exercises", ["l04_parallel_linear"])
    assert grading.main(["solutions", "l12", "l04_parallel_linear"]) == 0
    assert asked[-1] == ("solutions", ["l12_bucketed_allreduce", "l12_zero", "l04_parallel_linear"])
    assert grading.main([]) == 0 and asked[-1] == ("exercises", None)
    capsys.readouterr()
    assert grading.main(["l99"]) == 2
    err = capsys.readouterr().err
    assert "unknown exercise 'l99'" in err and "usage:" in err and len(asked) == 3


def test_grade_records_each_failing_test_and_its_first_line(demo_course):
    tests = demo_course.parents[1] / "tests" / "exercises"
    tests.mkdir(parents=True)
    (tests / "test_l99_demo.py").write_text(
        "from tpedu.course.grading import implementation\n\n\n"
        "def test_double():\n"
        "    assert implementation('l99_demo').double(2) == 5, 'double(2) is not 5\\nmore'\n\n\n"
        "def test_triple():\n"
        "    assert implementation('l99_demo').triple(2) == 6\n\n\n"
        "def test_fine():\n"
        "    pass\n"
    )
    (s,) = grading.grade("exercises", names=["l99_demo"])
    assert (s.passed, s.failed, s.unfinished, s.status) == (1, 2, 1, "in progress")
    assert s.failures[0] == ("test_double", "AssertionError: double(2) is not 5")
    assert s.failures[1][0] == "test_triple" and "NotImplementedError" in s.failures[1][1]


# ---- a check the tests cannot run is named, not counted as passed


def test_the_capstones_author_check_is_named_as_run_only_in_the_notebook():
    """make grade runs tests/exercises/test_l20_capstone.py, whose check_capstone has no
    exercise module: the seventh check (the choice is your code's) never runs there. The table
    says so, and all tests passing does not read "done"."""
    from tpedu.course import capstone

    notebook, checks = grading.IN_NOTEBOOK["l20_capstone"]
    assert (ROOT / notebook).exists() and checks[0].startswith(capstone.AUTHOR_CHECK + ":")
    s = grading.Score("l20_capstone", passed=5, in_notebook=checks)
    text = grading.table([s, grading.Score("l01_matmul_split", passed=3)])
    rows = {r.split()[0]: r for r in text.splitlines()[2:4]}
    assert rows["l20_capstone"].endswith("tests pass; 1 check in notebook"), text
    assert rows["l01_matmul_split"].endswith("done")
    block = text[text.index("l20_capstone: not run here") :]
    assert f"only by running {notebook} to its end:\n    {capstone.AUTHOR_CHECK}:" in block
    assert max(map(len, text.splitlines())) <= 110


def test_the_exercise_tests_run_every_check_but_the_authors(tmp_path):
    """What the note above rests on: without an exercise module, check_capstone runs its six
    artefact checks and not the author check."""
    from tpedu.course import capstone

    names = [c.name for c in capstone.check_capstone(tmp_path)]  # nothing there: all fail
    assert names == [n for n, _ in capstone.CHECKS] and capstone.AUTHOR_CHECK not in names


def test_grade_marks_what_only_the_notebook_checks(demo_course, monkeypatch):
    tests = demo_course.parents[1] / "tests" / "exercises"
    tests.mkdir(parents=True)
    (tests / "test_l99_demo.py").write_text("def test_fine():\n    pass\n")
    monkeypatch.setitem(grading.IN_NOTEBOOK, "l99_demo", ("notebooks/99.ipynb", ["the proof"]))
    (s,) = grading.grade("exercises", names=["l99_demo"])
    assert (s.passed, s.in_notebook, s.status) == (
        1,
        ["the proof"],
        "tests pass; 1 check in notebook",
    )
    monkeypatch.delitem(grading.IN_NOTEBOOK, "l99_demo")
    (s,) = grading.grade("exercises", names=["l99_demo"])
    assert (s.in_notebook, s.status) == ([], "done")


# ---- every lesson says whose code its checks ran


def _picked_uses(path):
    """(exercise, piece) for each exercise piece a code cell of notebook `path` calls on a
    module `pick` returned, and the notebook's stored output lines that say "the reference's"
    (what `ran` prints when TPEDU_IMPL=solutions ran the notebook)."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    picked, uses, said = {}, set(), []
    for cell in (c for c in cells if c["cell_type"] == "code"):
        source = "".join(cell["source"])
        for var, name in re.findall(r"(\w+) = pick\(\"(\w+)\"\)", source):
            picked[var] = grading.resolve(name)
        for var, name in picked.items():
            parts = {p.name for p in grading._parts(ROOT / "exercises" / f"{name}.py")}
            uses |= {(name, a) for a in re.findall(rf"\b{var}\.(\w+)", source) if a in parts}
        for out in cell.get("outputs", []):
            said += [
                ln for ln in "".join(out.get("text", "")).splitlines() if "the reference's" in ln
            ]
    return uses, said


NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_picked_piece_a_lesson_runs_is_named_by_whose_it_is(path):
    uses, said = _picked_uses(path)
    unnamed = [a for _, a in sorted(uses) if not any(re.search(rf"\b{a}\b", ln) for ln in said)]
    assert not unnamed, f"{path.name}: no ran()/whose() line names {unnamed}"
