"""Lesson 16: the blind bug hunt: six broken runs of tpedu, shown only by what they do.

Each case runs tpedu with one function edited (the bug), shows what a practitioner would see and
the check that fails, and lists the code that ran; nothing it prints names the bug.

    print(r := case(1)); plot(r)    # the broken run: its story, what it shows, the failing check
    print(suspects(1))              # the functions that ran on the failing path, as they ran
    print(check(1, m))              # m = pick("l16_bug_hunt"): the case again, with your case_1
    print(answer(1))                # the answer (which function, the edit, why it shows so)

In exercises/l16_bug_hunt.py, `case_k()` returns (the name of the suspect you found wrong, as
`suspects(k)` heads it; your rewrite of it). `check` says "closed" only when that function of
yours passes the check where the broken run failed, passes it on runs the case never shows
(other shapes, layouts, seeds), and keeps tpedu without the bug passing; while case_k still
raises NotImplementedError it says "not written yet" (and, if pick put the reference's case_k
in, that the reference fix ran). `case`, `check` launch their ranks themselves; `run_case` is
the worker.

A fix is judged by what it does. While it runs, tpedu's own function is the broken one wherever
it is reached: its code object is replaced (tpedu.course.mutation), so a wrapper or an alias of
it runs the bug, and a fix that calls it is refused by name.
"""

from __future__ import annotations

import functools
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType, FunctionType, MethodType, ModuleType
from typing import TYPE_CHECKING

from tpedu.course import bugzoo, grading
from tpedu.course.bugzoo import GPT2, example_batch
from tpedu.course.hunt_cases import CASES, Case, Observation, unhunted
from tpedu.course.mutation import FLAGS, Suspect, globals_read
from tpedu.course.troubleshoot import TOLERANCE
from tpedu.launcher import launch

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# GPT2, example_batch: the small model every case's check runs, and its batches
__all__ = [
    "GPT2",
    "answer",
    "case",
    "check",
    "example_batch",
    "fix_of",
    "judge_fix",
    "numbers",
    "plot",
    "run_case",
    "suspects",
    "unhunted",
]

EXERCISE = "exercises/l16_bug_hunt.py"
PACKAGE = Path(__file__).resolve().parents[1]  # tpedu/


def numbers() -> range:
    """The case numbers: 1 to 6."""
    return range(1, len(CASES) + 1)


def _case(k: int) -> Case:
    if isinstance(k, bool) or not isinstance(k, int) or k not in numbers():
        raise ValueError(f"there are mystery cases 1 to {len(CASES)}, got {k!r}")
    return CASES[k - 1]


def world(k: int) -> int:
    """How many ranks case k runs on."""
    return _case(k).world


@dataclass
class Report:
    """What `case` or `check` found; print it for the text. `ok`: the check passed on every
    rank (the broken run's, for `case`; the one with the fix, for `check`). `closed`: your own
    fix passed where the broken run failed."""

    text: str
    ok: bool
    closed: bool = False
    observed: Observation = field(default_factory=Observation)

    def __str__(self) -> str:
        return self.text


# ------------------------------------------------------------------------------ on every rank


def _raised(e: Exception) -> tuple[bool, str]:
    msg = str(e).splitlines()[0][:160] if str(e) else ""
    return False, f"your function raised {type(e).__name__}: {msg}"


def run_case(
    k: int, fix: tuple[str, Callable] | None = None, show: bool = True, unseen: bool = False
) -> dict[str, object]:
    """Worker body, on every rank of case k's launch, with the case's bug in place:
    {"shown": the Observation (show=True), "broken": the check's (ok, detail), "unseen": the
    case's runs on inputs it never shows, under the bug (unseen=True, else None), "fixed": the
    verdict on `fix` = (suspect name, function) in place of that suspect (None without a fix),
    "reached": how often the fix ran tpedu's own function of that name}.

    The fix passes when, with it in place, the shown check and the unseen runs pass under the
    bug and the shown check passes on tpedu without the bug, and it never ran tpedu's own
    function (under the bug, the broken one)."""
    case = _case(k)
    out: dict[str, object] = {"shown": None, "fixed": None, "unseen": None, "reached": 0}
    with case.edit.patch():
        out["shown"] = case.observe() if show else None
        out["broken"] = case.check()
        out["unseen"] = case.unseen() if unseen else None
    if fix is not None:
        out |= judge_fix(k, fix)
    return out


def judge_fix(k: int, fix: tuple[str, Callable]) -> dict[str, object]:
    """run_case's verdict on `fix` alone, on every rank of case k's launch (the broken run's
    check is not run again): {"fixed": (ok, detail), "reached": how often the fix ran tpedu's
    own function of that name}. A caller judging several fixes of one case runs the broken run
    once (run_case without a fix) and this once per fix."""
    case = _case(k)
    name, fn = fix
    suspect = next(s for s in case.suspects(k) if s.name == name)
    verdicts, trips = [], []
    try:
        with case.edit.patch(), suspect.install(fn) as calls:
            trips.append(calls)
            verdicts += [case.check(), case.unseen()]
        with suspect.install(fn) as calls:  # no bug: a fix must keep tpedu right
            trips.append(calls)
            ok, detail = case.check()
        if not ok:  # a rewrite that only makes up for the bug elsewhere breaks healthy tpedu
            verdicts.append((ok, f"without the bug: {detail}"))
    except Exception as e:  # the learner's code: report it as the check's failure
        verdicts.append(_raised(e))
    reached = sum(t.calls for t in trips)
    if reached:
        fixed = (False, f"your {name} called tpedu's own {name}, the code under suspicion")
    else:
        fixed = (all(ok for ok, _ in verdicts), "; ".join(d for _, d in verdicts))
    return {"fixed": fixed, "reached": reached}


# ------------------------------------------------------------------------------ what is printed


def _verdicts(per_rank: list[dict], key: str, label: str = "") -> list[str]:
    label = f"{label:<9} " if label else ""
    return [
        f"  rank {q}: {label}{'passes' if r[key][0] else 'FAILS '}  {r[key][1]}"
        for q, r in enumerate(per_rank)
    ]


def broken_report(k: int, per_rank: list[dict]) -> Report:
    """Case k's broken run from every rank's `run_case` (rank 0's observation)."""
    c = _case(k)
    ok = all(r["broken"][0] for r in per_rank)
    seen = per_rank[0]["shown"] or Observation()
    text = [f"Case {k} ({c.world} ranks). {c.story}", ""]
    text += [seen.text, ""] if seen.text else []
    text += [f"The check: {c.compares}. It {'passes' if ok else 'fails'}:"]
    text += _verdicts(per_rank, "broken")
    text += ["", f"The code that ran: print(hunt.suspects({k}))."]
    return Report("\n".join(text), ok, observed=seen)


def verdict(k: int, by: str, per_rank: list[dict], name: str = "") -> Report:
    """Case k's answer to a fix: by = "yours" (your case_k ran, as `name`), "reference" (pick
    put the reference's case_k in: yours is not written yet) or "unwritten" (nothing ran).
    "closed" only for your own fix that passes where the broken run failed."""
    fn = f"case_{k}"
    if by == "unwritten":
        text = (
            f"Case {k}: not written yet ({fn} in {EXERCISE} still raises NotImplementedError). "
            "Nothing ran."
        )
        return Report(text, False)
    broke = not all(r["broken"][0] for r in per_rank)
    fixed = all(r["fixed"][0] for r in per_rank)
    reached = any(r.get("reached") for r in per_rank)
    lines = _verdicts(per_rank, "broken", "broken") + _verdicts(
        per_rank, "fixed", "your fix" if by == "yours" else "reference"
    )
    lines.sort(key=lambda s: int(s.split(":")[0].split()[-1]))  # rank by rank
    if by == "reference":
        if not (broke and fixed):
            raise AssertionError(f"case {k}: the reference fix must pass where the bug failed")
        head = (
            f"Case {k}: not written yet ({fn} still raises NotImplementedError, so pick put the "
            "reference's in). The reference fix ran, and the check passes with it. The case "
            "stays open until yours passes."
        )
        return Report("\n".join([head, *lines]), fixed)
    closed = broke and fixed and not reached
    if closed:
        head = (
            f"Case {k} closed: with your {name}, the check passes where the broken run failed, "
            "and on runs you have not seen."
        )
    elif reached:
        head = (
            f"Case {k} still open: your {name} calls tpedu's own {name}, and here that is the "
            f"code under suspicion. A fix is your own rewrite of {name}: write its body."
        )
    else:
        head = f"Case {k} still open: with your {name}, the check still fails."
    return Report("\n".join([head, *lines]), fixed, closed)


# ------------------------------------------------------------------------------ the learner's calls


def case(k: int, timeout: float = 120) -> Report:
    """Launch case k broken: its story, what it shows, the check that fails (asserted: the bug
    must show). `plot(report)` draws its loss curves."""
    per_rank = launch(run_case, world(k), k, None, True, timeout=timeout)
    report = broken_report(k, per_rank)
    if report.ok:
        raise AssertionError(f"case {k}: its check passed: the broken run shows nothing")
    return report


def _reads(s: Suspect, source: str) -> str:
    """The module-level names `source` (a function's) reads in its body, for a rewrite's imports."""
    fn = s.original
    module_code = compile(source, "<suspect>", "exec", FLAGS, True)  # annotations: not read
    bodies = [c for c in module_code.co_consts if hasattr(c, "co_names")]
    names = [n for c in bodies for n in globals_read(c, fn.__globals__)]
    names = [n for i, n in enumerate(names) if n not in names[:i] and n != fn.__name__]
    return ", ".join(names) or "nothing"


def suspects(k: int) -> str:
    """The functions that ran on case k's failing path, in a fixed shuffled order, each as it
    ran: one of them with the edit that broke the run, none marked."""
    c = _case(k)
    found = c.suspects(k)
    head = (
        f"Case {k}: {len(found)} functions that ran on the failing path, each as it ran. One of "
        "them is wrong. Your fix: in "
        f'{EXERCISE}, case_{k}() returns ("<the name it is headed with>", your rewrite of it: '
        "same arguments, same contract)."
    )
    parts = [textwrap.fill(head, 100)]
    for s in found:
        source = c.edit.source() if s == c.edit.suspect else s.source()
        shown = f"# ── {s.name} · reads from its module: {_reads(s, source)}"
        parts += ["", shown, source.rstrip()]
    return "\n".join(parts)


def _calls_own(fn: object, target: FunctionType, depth: int = 4) -> bool:
    """Whether `fn` is `target`, or reaches it without a call to run: through a method or
    staticmethod, functools.partial or wraps, a closure, a default, or a name its code (or a
    function it reads, `depth` deep) reads from its globals; or whether it holds target's code."""
    seen: set[int] = set()
    stack: list[tuple[object, int]] = [(fn, depth)]
    while stack:
        obj, left = stack.pop()
        if id(obj) in seen or left < 0:
            continue
        seen.add(id(obj))
        if obj is target or obj is target.__code__:
            return True
        if isinstance(obj, (staticmethod, classmethod, MethodType)):
            stack.append((obj.__func__, left))
        elif isinstance(obj, functools.partial):
            stack += [(obj.func, left), *((a, left) for a in obj.args)]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack += [(x, left) for x in obj]
        elif isinstance(obj, dict):
            stack += [(x, left) for x in obj.values()]
        elif isinstance(obj, CodeType):
            own = target.__code__  # its code under another name is still its code
            where = (obj.co_filename, obj.co_firstlineno, obj.co_code)
            if where == (own.co_filename, own.co_firstlineno, own.co_code):
                return True
            stack += [(c, left) for c in obj.co_consts if isinstance(c, CodeType)]
        elif isinstance(obj, FunctionType):
            stack.append((obj.__code__, left))
            if _tpedus(obj.__code__):  # tpedu's others call the name, which holds the fix
                continue
            stack += [(c.cell_contents, left) for c in obj.__closure__ or () if _full(c)]
            stack += [(d, left) for d in (obj.__defaults__ or ())]
            stack += [(d, left) for d in (obj.__kwdefaults__ or {}).values()]
            if hasattr(obj, "__wrapped__"):
                stack.append((obj.__wrapped__, left))
            names = globals_read(obj.__code__, obj.__globals__)
            stack += [(obj.__globals__[n], left - 1) for n in names]
    return False


def _tpedus(code: CodeType) -> bool:
    """Whether the code was compiled from one of tpedu's files (its __module__ can be copied)."""
    return Path(code.co_filename).resolve().is_relative_to(PACKAGE)


def _full(cell: object) -> bool:
    try:
        cell.cell_contents  # noqa: B018 (an empty cell raises)
    except ValueError:
        return False
    return True


def fix_of(k: int, make: Callable[[], object]) -> tuple[str, Callable]:
    """(suspect name, function) from case_k(); a ValueError says what is wrong with it."""
    names = [s.name for s in _case(k).suspects(k)]
    got = make()
    if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], str)):
        raise ValueError(
            f"case_{k}() must return a pair: a suspect's name as hunt.suspects({k}) heads it, "
            f"and your function; got {type(got).__name__}"
        )
    name, fn = got
    if name not in names:
        raise ValueError(f"{name!r} is not one of case {k}'s suspects: {', '.join(names)}")
    if not callable(fn):
        raise ValueError(f"case_{k}() returned {type(fn).__name__} for {name}, not a function")
    suspect = next(s for s in _case(k).suspects(k) if s.name == name)
    if getattr(fn, "__func__", fn) is suspect.original:
        raise ValueError(f"case_{k}() returned tpedu's own {name}, not your rewrite of it")
    if _calls_own(fn, suspect.original):
        raise ValueError(
            f"case_{k}() returned a function that calls tpedu's own {name} (or runs its code): "
            f"while the case runs, that is the code under suspicion. Return your rewrite of "
            f"{name}, its body written out."
        )
    return name, fn


def check(k: int, module: ModuleType, timeout: float = 120) -> Report:
    """Case k with the fix `module.case_k()` returns (module: pick("l16_bug_hunt")): the broken
    run's check and the check with the fix, on every rank."""
    fn = f"case_{k}"
    _case(k)
    if not callable(getattr(module, fn, None)):
        raise ValueError(f"{module.__name__} has no function {fn}")
    by = grading.whose(module, fn)
    try:
        name, fix = fix_of(k, getattr(module, fn))
    except NotImplementedError:
        return verdict(k, "unwritten", [])
    per_rank = launch(run_case, world(k), k, (name, fix), False, timeout=timeout)
    return verdict(k, by, per_rank, name)


def answer(k: int) -> str:
    """Case k's answer: the function that ran broken, the edit, why it shows as it does."""
    c = _case(k)
    bug = bugzoo.BUGS[c.bug]
    path, line = c.edit.suspect.where()
    return "\n".join(
        [
            f"Case {k}, the answer: {bug.title} (the zoo's {c.bug}).",
            f"The function that ran broken: {c.edit.suspect.name} ({path}, line {line}). The edit:",
            c.edit.diff(),
            "",
            c.explain,
            f"Reported: {bug.source}.",
        ]
    )


def plot(report: Report) -> Figure | None:
    """The loss curves of a broken run next to tp=1's (each on the same batches), their relative
    gap per step, and (when it has them) every parameter's gradient gap at step 0. None when the
    case compares no runs."""
    import matplotlib.pyplot as plt

    seen = report.observed
    if not seen.runs:
        return None
    n = 3 if seen.grads else 2
    fig, axes = plt.subplots(1, n, figsize=(4.6 * n, 3.3), width_ratios=[1, 1, 1.6][:n])
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, (tp, dense)) in enumerate(seen.runs.items()):
        col = colours[i % len(colours)]
        axes[0].plot(dense, color=col, ls="--", lw=1, label=f"tp=1 beside {label}")
        axes[0].plot(tp, color=col, marker=".", lw=1.4, label=label)
        gap = [max(abs(a - b) / abs(b), 1e-17) for a, b in zip(tp, dense, strict=True)]
        axes[1].plot(gap, color=col, marker=".", label=label)
    axes[0].set(xlabel="step", ylabel="training loss", title="loss, next to tp=1's")
    axes[0].legend(fontsize=7)
    axes[1].axhline(TOLERANCE, color="k", ls=":", lw=0.8, label="1e-9: more is a bug")
    axes[1].set(xlabel="step", ylabel="|loss - tp=1 loss| / tp=1 loss", yscale="log")
    axes[1].set(title="gap to tp=1 (float64)", ylim=(1e-17, 1))
    axes[1].legend(fontsize=7)
    if seen.grads:
        names = list(seen.grads)
        short = [
            s.replace("blocks.", "b").replace(".weight", ".w").replace(".bias", ".b") for s in names
        ]
        axes[2].bar(range(len(names)), [max(seen.grads[s], 1e-17) for s in names])
        axes[2].axhline(TOLERANCE, color="k", ls=":", lw=0.8)
        axes[2].set_xticks(range(len(names)), short, rotation=75, fontsize=6)
        axes[2].set(yscale="log", ylim=(1e-17, 10), title="each gradient vs tp=1's, step 0")
        axes[2].set_ylabel("|grad - tp=1 grad| / |tp=1 grad|", fontsize=8)
    fig.tight_layout()
    return fig
