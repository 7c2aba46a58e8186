"""Course infrastructure: graded exercises: choose which implementation the tests and notebooks
use, and score it.

`exercises/X.py` (the learner's stubs) and `solutions/X.py` (the reference) have the same names.
Tests never import either directly; they call `implementation("X")`, which follows the
environment variable TPEDU_IMPL ("solutions" by default, "exercises" under `make grade`). This is
the one indirection (an adapter, as in Stanford CS336) that lets the same tests grade both.
Notebooks call `pick("X")` instead: each function or class of exercises/X.py the learner has
written, the reference's for each one that still raises NotImplementedError (run inside the
learner's module, so it calls the learner's helpers), and a printed line saying which.

    python -m tpedu.course.grading            # score exercises/ (what `make grade` runs)
    python -m tpedu.course.grading solutions  # the reference must get full marks
    python -m tpedu.course.grading l01        # just one exercise (or l01_matmul_split)
    python -m tpedu.course.grading hint l03 1 # the first hint for lesson 03

Hints come in levels, each closer to the code than the one before (1: the idea, 2: the shapes
and the collectives, 3: the steps, short of the code itself). They live in one Markdown file per
exercise, exercises/hints/<name>.md, apart from the stub: a learner reading the stub sees none
of them, and asks for the next one only when stuck.
"""

from __future__ import annotations
import __future__

import ast
import contextlib
import functools
import importlib
import importlib.util
import json
import os
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
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


def _raises_not_implemented(node: ast.AST) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Raise) and sub.exc is not None:
            target = sub.exc.func if isinstance(sub.exc, ast.Call) else sub.exc
            if isinstance(target, ast.Name) and target.id == "NotImplementedError":
                return True
    return False


def stubs(name: str) -> list[str]:
    """Functions in exercises/`name`.py that still `raise NotImplementedError` (a class's
    methods under their own names)."""
    tree = ast.parse((ROOT / "exercises" / f"{name}.py").read_text(encoding="utf-8"))
    return [
        node.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and _raises_not_implemented(node)
    ]


@dataclass
class _Part:
    """A public top-level function or class of an exercise file."""

    name: str
    is_class: bool
    methods: list[str]  # a class's methods; [] for a function
    unwritten: list[str]  # what still raises NotImplementedError: [name] or some methods


def _parts(path: Path) -> list[_Part]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if not node.name.startswith("_"):
                stub = [node.name] if _raises_not_implemented(node) else []
                found.append(_Part(node.name, False, [], stub))
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            methods = [
                f for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            ]
            stub = [f.name for f in methods if _raises_not_implemented(f)]
            found.append(_Part(node.name, True, [f.name for f in methods], stub))
    return found


def _load_learner(name: str) -> ModuleType:
    """A fresh module run from exercises/`name`.py, registered in sys.modules as
    `picked_<name>` (forked ranks import it by that name). Read anew on every call, so an edit
    counts without restarting the kernel; the module the grader tests,
    `implementation(name, "exercises")`, is a different object and stays as the file made it."""
    path = ROOT / "exercises" / f"{name}.py"
    module_name = f"picked_{name}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    code = compile(path.read_text(encoding="utf-8"), str(path), "exec", dont_inherit=True)
    sys.modules[module_name] = module
    try:
        exec(code, module.__dict__)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    return module


def borrowed(path: Path) -> list[str]:
    """Where the file at `path` reaches into solutions/ (an import, or a module name in a
    string): "line 3: from solutions.l04_parallel_linear import *". Code that does is the
    reference's, not the learner's, however it is wrapped."""
    text = path.read_text(encoding="utf-8")
    tree, lines, found = ast.parse(text), text.splitlines(), []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
            names += [a.name for a in node.names] if node.module is None else []  # from . import
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value]
        if any(n == "solutions" or n.startswith("solutions.") for n in names):
            found.append(f"line {node.lineno}: {lines[node.lineno - 1].strip()}")
    return sorted(set(found), key=lambda s: int(s.split(":")[0].removeprefix("line ")))


def _files(obj: object) -> set[Path]:
    """The files the code of function or class `obj` was written in (empty for data)."""
    if isinstance(obj, type):
        codes = [getattr(getattr(f, "__func__", f), "__code__", None) for f in vars(obj).values()]
    else:
        codes = [getattr(obj, "__code__", None)]
    return {Path(c.co_filename) for c in codes if c is not None}


def _written_in(obj: object, path: Path) -> bool:
    """Whether function or class `obj` was written in the file at `path` (data: True)."""
    files = _files(obj)
    return not files or files == {path}


def _from_solutions(obj: object) -> bool:
    return any(f.is_relative_to(ROOT / "solutions") for f in _files(obj))


def _rebuild(module: ModuleType, reference: ModuleType, names: list[str]) -> None:
    """Run the reference's definitions of `names` again inside `module`: their globals are then
    the learner's, so a reference function that calls a helper calls the learner's helper
    (when written), and everything they need that the learner's file lacks is copied in."""
    path = Path(reference.__file__)
    nodes = {
        n.name: n
        for n in ast.parse(path.read_text(encoding="utf-8")).body
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    }
    for key, value in vars(reference).items():  # imports, constants, private helpers
        if key not in module.__dict__ and not key.startswith("__"):
            module.__dict__[key] = value
    helpers = [
        k
        for k, v in vars(module).items()
        if k in nodes and k not in names and v is getattr(reference, k, None)
    ]
    body = [nodes[n] for n in nodes if n in names or n in helpers]  # the reference's order
    tree = ast.Module(body=body, type_ignores=[])
    flags = __future__.annotations.compiler_flag
    exec(compile(tree, str(path), "exec", flags=flags, dont_inherit=True), module.__dict__)
    for n in names:
        if n not in nodes:  # not defined by the reference itself (imported there): as it is
            setattr(module, n, getattr(reference, n))
    module.__dict__.setdefault(_RECORD, {}).update(dict.fromkeys(names + helpers, "reference"))


_RECORD = "__picked__"  # in a picked module: {name: "yours" | "reference"}


def _raise(n: int) -> str:
    return "still raises NotImplementedError" if n == 1 else "still raise NotImplementedError"


def pick(name: str) -> ModuleType:
    """For notebooks: exercise `name` ("l05_qkv_split" or "l05") with each function or class
    you have written, and the reference's (solutions/`name`.py) for each one that still raises
    NotImplementedError. Prints one line saying whose code runs, function by function.

    The reference's pieces are run again inside your module, so they call your functions: a
    reference function whose helper you have written runs your helper. A class is one piece:
    it is yours once none of its methods raises NotImplementedError. A file that imports
    solutions/ counts as the reference throughout. Your file is read again on every call: after
    editing it, run the cell with `pick` again. `whose(module, "fn")` says whose `fn` ran.

    TPEDU_IMPL=solutions (set by `make test` and when the notebooks are regenerated) runs the
    reference for everything, so the stored notebook outputs do not depend on the learner's
    progress; TPEDU_IMPL=exercises runs your module alone, unwritten functions included.
    """
    name = resolve(name)
    forced = os.environ.get("TPEDU_IMPL")
    if forced is not None and forced not in KINDS:
        raise ValueError(f"TPEDU_IMPL must be one of {KINDS}, got {forced!r}")
    path = ROOT / "exercises" / f"{name}.py"
    parts = _parts(path)
    kinds = sorted({p.is_class for p in parts})  # False (functions) first
    every = "every " + " and ".join("class" if k else "function" for k in kinds or [False])
    if forced == "solutions":
        names = ", ".join(p.name for p in parts)
        print(f"{name}: the reference runs for {every} (TPEDU_IMPL=solutions): {names}")
        return implementation(name, "solutions")
    if forced == "exercises":
        left = [p.name for p in parts if p.unwritten]
        tail = f"; {', '.join(left)} {_raise(len(left))}" if left else ""
        print(f"{name}: your code runs for {every} (TPEDU_IMPL=exercises){tail}")
        return implementation(name, "exercises")

    module = _load_learner(name)
    reference = implementation(name, "solutions")
    borrows = borrowed(path)
    names = [p.name for p in parts]
    names += [p.name for p in _parts(Path(reference.__file__)) if p.name not in names]
    own = vars(module)
    missing = [n for n in names if n not in own]  # deleted from the file, or never there
    imported = [n for n in names if n in own and not _written_in(own[n], path)]
    stubbed = [p.name for p in parts if p.unwritten and p.name not in imported]
    theirs = [n for n in names if borrows or n in missing + imported + stubbed]
    yours = [n for n in names if n not in theirs]
    module.__dict__[_RECORD] = dict.fromkeys(yours, "yours")
    _rebuild(module, reference, theirs)
    if not theirs:
        print(f"{name}: your code runs for {every}: {', '.join(yours)}")
        return module
    if borrows:
        notes = [f"your file uses solutions/ ({borrows[0]}), so none of it counts as yours"]
    else:
        notes = [_raise(len(stubbed))] if stubbed else []
        notes += [
            f"{p.name} runs as a whole class: {', '.join(p.unwritten)} not written yet"
            for p in parts
            if p.name in stubbed and p.is_class and len(p.unwritten) < len(p.methods)
        ]
        notes += [f"{', '.join(imported)} not written in your file"] if imported else []
        notes += [f"{', '.join(missing)} not in your file"] if missing else []
    print(
        f"{name}: yours: {', '.join(yours) or 'none yet'} · "
        f"reference: {', '.join(theirs)} ({'; '.join(notes)})"
    )
    return module


def whose(module: ModuleType, attribute: str) -> str:
    """Whose code `module.<attribute>` is: "reference" when the reference's code runs for it
    (pick put it in, or it comes from solutions/), else "yours"."""
    record = getattr(module, _RECORD, {})
    if attribute in record:
        return record[attribute]
    if module.__name__.startswith("solutions."):
        return "reference"
    file = getattr(module, "__file__", None)
    if file and Path(file).parent == ROOT / "exercises" and borrowed(Path(file)):
        return "reference"  # TPEDU_IMPL=exercises: the learner's module, using solutions/
    return "reference" if _from_solutions(getattr(module, attribute)) else "yours"


def ran(module: ModuleType, *attributes: str) -> str:
    """Whose pieces `attributes` of a picked module are, for a printed line: "your f, g",
    "the reference's f, g", or both parts when they differ."""
    groups: dict[str, list[str]] = {}
    for a in attributes:
        groups.setdefault(whose(module, a), []).append(a)
    owner = {"yours": "your", "reference": "the reference's"}
    return " and ".join(f"{owner[w]} {', '.join(names)}" for w, names in groups.items())


@contextlib.contextmanager
def watch(module: ModuleType, *names: str) -> Iterator[list[str]]:
    """Within the block, note which of `module`'s functions `names` are called: the list it
    yields gains each name at its first call, so `ran(module, *called)` names only what ran.
    Calls the functions make to each other by their global names count too (a reference
    function, run inside the learner's module, calling the learner's helper). The module's
    functions are restored afterwards."""
    called: list[str] = []
    saved = {n: getattr(module, n) for n in names}

    def noted(name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(*args: object, **kwargs: object) -> object:
            if name not in called:
                called.append(name)
            return fn(*args, **kwargs)

        return call

    for n, fn in saved.items():
        setattr(module, n, noted(n, fn))
    try:
        yield called
    finally:
        for n, fn in saved.items():
            setattr(module, n, fn)


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


# Checks that an exercise's tests cannot run, because they need what its notebook makes. `make
# grade` names them, so that passing every test does not read as passing the whole exercise.
IN_NOTEBOOK = {  # exercise: (its notebook, the checks only it runs)
    "l20_capstone": (
        "notebooks/20_capstone.ipynb",
        ["the choice is your code's: your survey and choose, asked again, give your choice.json"],
    ),
}


@dataclass
class Score:
    exercise: str
    passed: int = 0
    failed: int = 0
    unfinished: int = 0  # failures caused by NotImplementedError
    failures: list[tuple[str, str]] = field(default_factory=list)  # (test, its message's line 1)
    borrowed: list[str] = field(default_factory=list)  # where exercises/ uses solutions/
    in_notebook: list[str] = field(default_factory=list)  # checks only its notebook runs

    @property
    def total(self) -> int:
        return self.passed + self.failed

    @property
    def status(self) -> str:
        if self.total == 0:
            return "no tests"
        if self.borrowed:
            return "uses solutions/"
        if self.passed == self.total:
            left = len(self.in_notebook)
            return f"tests pass; {left} check in notebook" if left else "done"
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
            crash = getattr(report.longrepr, "reprcrash", None)
            message = crash.message if crash is not None else str(report.longrepr)
            first = (message.strip().splitlines() or [""])[0]
            score.failures.append((report.nodeid.rpartition("::")[2], first))


def grade(
    kind: str = "exercises", quiet: bool = True, names: list[str] | None = None
) -> list[Score]:
    """Run tests/exercises against `kind` and return one Score per exercise (never raises).

    `names` limits the run to some exercises (default: all of them). An exercise file that
    uses solutions/ gets no passed tests: what passed was the reference.
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
    scores = [collector.scores.get(name, Score(name)) for name in names]
    for s in scores if kind == "exercises" else []:
        s.borrowed = borrowed(ROOT / "exercises" / f"{s.exercise}.py")
        s.in_notebook = list(IN_NOTEBOOK.get(s.exercise, ("", []))[1])
        if s.borrowed:
            s.failed, s.passed = s.total, 0
    return scores


def short(name: str) -> str:
    """The shortest name that selects exercise `name` alone: "l04", or the full name."""
    prefix = name.split("_")[0]
    return prefix if [n for n in exercise_names() if n.split("_")[0] == prefix] == [name] else name


SHOWN = 5  # failing tests listed per exercise; the rest are counted


def _clip(text: str, width: int = 110) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def table(scores: list[Score]) -> str:
    """The score table `make grade` prints, then what failed in each exercise in progress."""
    lines = [f"{'exercise':<26} {'passed':>6} {'tests':>6}  status", "-" * 52]
    for s in scores:
        lines.append(f"{s.exercise:<26} {s.passed:>6} {s.total:>6}  {s.status}")
    passed, total = sum(s.passed for s in scores), sum(s.total for s in scores)
    lines += [
        "-" * 52,
        f"{'total':<26} {passed:>6} {total:>6}  {100 * passed / max(total, 1):.0f}%",
    ]
    for s in scores:
        if s.status not in ("in progress", "uses solutions/"):
            continue
        lines += ["", f"{s.exercise}: {s.failed} of {s.total} tests fail"]
        if s.borrowed:
            lines.append(f"    it uses solutions/ ({s.borrowed[0]}): the reference, not yours")
        for test, message in s.failures[:SHOWN]:
            lines.append(_clip(f"    {test}: {(message.splitlines() or [''])[0]}"))
        if len(s.failures) > SHOWN:
            lines.append(f"    ... and {len(s.failures) - SHOWN} more")
        lines.append(f"    grade it alone: make grade EX={short(s.exercise)}")
    for s in scores:
        if s.in_notebook:
            where = IN_NOTEBOOK.get(s.exercise, ("its notebook",))[0]
            lines += ["", f"{s.exercise}: not run here, only by running {where} to its end:"]
            lines += [_clip(f"    {c}") for c in s.in_notebook]
    if passed < total:
        lines += [
            "",
            "Stuck? Every exercise has hints, each closer to the code than the one before:",
            "    python -m tpedu.course.grading hint l03 1      (then 2, then 3)",
            "or, in Python or a notebook: from tpedu.grading import hint; hint('l03', 1)",
        ]
    return "\n".join(lines)


USAGE = """usage: python -m tpedu.course.grading [exercises|solutions] [NAME ...] [--json]
       python -m tpedu.course.grading hint NAME [LEVEL]

Grades exercises/ (or solutions/) with tests/exercises and prints a score table, then the
failing tests of each exercise in progress. NAME picks exercises: the full name
(l04_parallel_linear) or the lesson (l04; l12 grades both of lesson 12's). `make grade EX=l04`
runs the same. `hint NAME LEVEL` prints one hint (levels 1, 2, 3, ...)."""


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


def select(args: list[str]) -> list[str]:
    """The exercises `args` name: full names, or lesson prefixes ("l04", "l12": both of its)."""
    names, found = exercise_names(), []
    for a in args:
        match = [a] if a in names else [n for n in names if n.split("_")[0] == a]
        if not match:
            raise ValueError(f"unknown exercise {a!r}; choose from {names} or their lessons (l04)")
        found += [n for n in match if n not in found]
    return found


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "hint":
        return _hint_command(argv[1:])
    if {"-h", "--help"} & set(argv):
        print(USAGE)
        return 0
    kind = argv[0] if argv and argv[0] in KINDS else "exercises"
    rest = [a for a in argv[1 if argv and argv[0] in KINDS else 0 :] if a != "--json"]
    try:
        names = select(rest)
    except ValueError as e:
        print(f"{e}\n\n{USAGE}", file=sys.stderr)
        return 2
    scores = grade(kind, names=names or None)
    if "--json" in argv:
        print(json.dumps([asdict(s) | {"total": s.total, "status": s.status} for s in scores]))
    else:
        print(f"Grading {kind}/ with tests/exercises\n")
        print(table(scores))
    return 0


if __name__ == "__main__":
    sys.exit(main())
