"""Course infrastructure: graded exercises: choose which implementation the tests and notebooks
use, and score it.

`exercises/X.py` (the learner's stubs) and `solutions/X.py` (the reference) have the same names.
Tests never import either directly; they call `implementation("X")`, which follows the
environment variable TPEDU_IMPL ("solutions" by default, "exercises" under `make grade`). This is
the one indirection (an adapter, as in Stanford CS336) that lets the same tests grade both.

    python -m tpedu.course.grading            # score exercises/ (what `make grade` runs)
    python -m tpedu.course.grading solutions  # the reference must get full marks
    python -m tpedu.course.grading exercises l01_matmul_split   # just one exercise
    python -m tpedu.course.grading hint l03 1                   # the first hint for lesson 03

Hints come in levels, each closer to the code than the one before (1: the idea, 2: the shapes
and the collectives, 3: the steps, short of the code itself). They live in one Markdown file per
exercise, exercises/hints/<name>.md, apart from the stub: a learner reading the stub sees none
of them, and asks for the next one only when stuck.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]  # the repository: exercises/, solutions/
KINDS = ("exercises", "solutions")
HINTS = ROOT / "exercises" / "hints"  # <exercise name>.md, sections "## Hint 1", "## Hint 2", ...
_HINT_HEADING = re.compile(r"^## Hint (\d+)[ \t]*$", re.MULTILINE)


def _ensure_root_on_path() -> None:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


def implementation(name: str, kind: str | None = None) -> ModuleType:
    """The module `name` from exercises/ or solutions/ (TPEDU_IMPL decides when kind is None)."""
    kind = kind or os.environ.get("TPEDU_IMPL", "solutions")
    if kind not in KINDS:
        raise ValueError(f"TPEDU_IMPL must be one of {KINDS}, got {kind!r}")
    _ensure_root_on_path()
    return importlib.import_module(f"{kind}.{name}")


def stubs(name: str) -> list[str]:
    """Functions in exercises/`name`.py that still `raise NotImplementedError`."""
    tree = ast.parse((ROOT / "exercises" / f"{name}.py").read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in ast.walk(node):
                if isinstance(sub, ast.Raise) and sub.exc is not None:
                    target = sub.exc.func if isinstance(sub.exc, ast.Call) else sub.exc
                    if isinstance(target, ast.Name) and target.id == "NotImplementedError":
                        found.append(node.name)
                        break
    return found


def pick(name: str) -> ModuleType:
    """For notebooks: the learner's exercise if it is complete, else the reference; says which.

    TPEDU_IMPL=solutions (set by `make test` and `make notebooks`) forces the reference, so the
    stored notebook outputs do not depend on the learner's progress.
    """
    forced = os.environ.get("TPEDU_IMPL")
    left = stubs(name)
    if forced == "solutions" or (forced is None and left):
        why = "TPEDU_IMPL=solutions" if forced == "solutions" else f"still to do: {', '.join(left)}"
        print(f"Using the reference solutions/{name}.py ({why}).")
        return implementation(name, "solutions")
    print(f"Using your exercises/{name}.py.")
    return implementation(name, "exercises")


def exercise_names() -> list[str]:
    """Every exercise module, in lesson order (file names sort by lesson)."""
    return sorted(p.stem for p in (ROOT / "exercises").glob("*.py") if p.stem != "__init__")


def resolve(name: str) -> str:
    """The exercise module named `name`: its full name ("l03_conjugate_ops") or its lesson
    prefix ("l03") when only one exercise has it."""
    names = exercise_names()
    if name in names:
        return name
    found = [n for n in names if n.split("_")[0] == name]
    if len(found) == 1:
        return found[0]
    if found:
        raise ValueError(f"{name!r} names several exercises {found}: use the full name")
    raise ValueError(f"no exercise {name!r}; choose from {names} (or their prefixes, e.g. 'l03')")


def hints(name: str) -> list[str]:
    """Every hint of exercise `name` (full name or "lNN"), level 1 first."""
    name = resolve(name)
    path = HINTS / f"{name}.md"
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    if not path.exists():
        raise ValueError(f"exercise {name} has no hints file {shown}")
    parts = _HINT_HEADING.split(path.read_text(encoding="utf-8"))
    levels, texts = [int(k) for k in parts[1::2]], [t.strip() for t in parts[2::2]]
    if levels != list(range(1, len(levels) + 1)):
        raise ValueError(f"{shown}: hint levels must be 1, 2, ..., got {levels}")
    return texts


class Hint(str):
    """A hint's text; shows as plain text (not a quoted string) in a notebook or the REPL."""

    def __repr__(self) -> str:
        return str(self)


def hint(name: str, level: int = 1) -> Hint:
    """Hint `level` (1, 2, 3, ...) for exercise `name` ("l03" or "l03_conjugate_ops").

    Level 1 points at the idea, level 2 at the shapes and the collectives, level 3 at the steps;
    none is the code. Ask for the next level only when the one before was not enough.
    """
    texts = hints(name)
    if isinstance(level, bool) or not isinstance(level, int) or not 1 <= level <= len(texts):
        raise ValueError(
            f"{resolve(name)} has hint levels 1 to {len(texts)}, got {level!r}; "
            "start with 1 and go up one at a time"
        )
    return Hint(f"{resolve(name)}, hint {level} of {len(texts)}:\n{texts[level - 1]}")


@dataclass
class Score:
    exercise: str
    passed: int = 0
    failed: int = 0
    unfinished: int = 0  # failures caused by NotImplementedError

    @property
    def total(self) -> int:
        return self.passed + self.failed

    @property
    def status(self) -> str:
        if self.total == 0:
            return "no tests"
        if self.passed == self.total:
            return "done"
        if self.unfinished == self.total:
            return "not started"
        return "in progress"


class _Collector:
    """pytest plugin: tally each test's outcome under the exercise its file grades."""

    def __init__(self) -> None:
        self.scores: dict[str, Score] = {}

    def pytest_runtest_logreport(self, report) -> None:  # pytest hook
        if report.when != "call" and not (report.when == "setup" and report.failed):
            return
        name = Path(report.fspath).stem.removeprefix("test_")
        score = self.scores.setdefault(name, Score(name))
        if report.passed:
            score.passed += 1
        elif report.failed:
            score.failed += 1
            if "NotImplementedError" in str(report.longrepr):
                score.unfinished += 1


def grade(
    kind: str = "exercises", quiet: bool = True, names: list[str] | None = None
) -> list[Score]:
    """Run tests/exercises against `kind` and return one Score per exercise (never raises).

    `names` limits the run to some exercises (default: all of them).
    """
    import pytest

    os.environ["TPEDU_IMPL"] = kind
    names = names or exercise_names()
    collector = _Collector()
    files = [str(ROOT / "tests" / "exercises" / f"test_{n}.py") for n in names]
    args = [*files, "-p", "no:cacheprovider", "-o", "addopts="]
    args += ["-p", "no:terminal"] if quiet else []
    with open(os.devnull, "w") as devnull:
        saved = sys.stdout
        sys.stdout = devnull if quiet else saved
        try:
            pytest.main(args, plugins=[collector])
        finally:
            sys.stdout = saved
    return [collector.scores.get(name, Score(name)) for name in names]


def table(scores: list[Score]) -> str:
    """The score table `make grade` prints."""
    lines = [f"{'exercise':<26} {'passed':>6} {'tests':>6}  status", "-" * 52]
    for s in scores:
        lines.append(f"{s.exercise:<26} {s.passed:>6} {s.total:>6}  {s.status}")
    passed, total = sum(s.passed for s in scores), sum(s.total for s in scores)
    lines += [
        "-" * 52,
        f"{'total':<26} {passed:>6} {total:>6}  {100 * passed / max(total, 1):.0f}%",
    ]
    if passed < total:
        lines += [
            "",
            "Stuck? Every exercise has hints, each closer to the code than the one before:",
            "    python -m tpedu.course.grading hint l03 1      (then 2, then 3)",
            "or, in Python or a notebook: from tpedu.grading import hint; hint('l03', 1)",
        ]
    return "\n".join(lines)


def _hint_command(args: list[str]) -> int:
    """`hint NAME [LEVEL]`: print one hint; exit code 2 with the reason on bad input."""
    try:
        if not 1 <= len(args) <= 2:
            raise ValueError(
                "usage: python -m tpedu.course.grading hint NAME [LEVEL], e.g. hint l03 1"
            )
        if len(args) == 2 and not args[1].isdigit():
            raise ValueError(f"LEVEL must be a number (1, 2, 3, ...), got {args[1]!r}")
        print(hint(args[0], int(args[1]) if len(args) == 2 else 1))
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "hint":
        return _hint_command(argv[1:])
    kind = argv[0] if argv and argv[0] in KINDS else "exercises"
    unknown = [a for a in argv if a not in KINDS and a != "--json" and a not in exercise_names()]
    if unknown:
        print(f"unknown exercise(s) {unknown}; choose from {exercise_names()}", file=sys.stderr)
        return 2
    scores = grade(kind, names=[a for a in argv if a in exercise_names()] or None)
    if "--json" in argv:
        print(json.dumps([asdict(s) | {"total": s.total, "status": s.status} for s in scores]))
    else:
        print(f"Grading {kind}/ with tests/exercises\n")
        print(table(scores))
    return 0


if __name__ == "__main__":
    sys.exit(main())
