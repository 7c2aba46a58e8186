"""Exercise l16: the bug hunt. Lesson 16 shows six broken runs of tpedu, one function wrong in
each, by what they do: `hunt.case(k)` runs case k and shows its symptom and the check that
fails; `hunt.suspects(k)` prints the functions that ran on the failing path, as they ran.

For each case, find the suspect that is wrong and write it again, fixed: same name, same
arguments, same contract (its docstring states it). `case_k()` returns a pair: the suspect's
name exactly as `hunt.suspects(k)` heads it (a method as "Class.method"), and your function.
Define your function inside case_k or at the top of this file, with the imports it needs (the
suspect's header lists the names it reads from its module). A method stays a plain function
here: write its `self` or `ctx` argument as the suspect has it.

`hunt.check(k, pick("l16_bug_hunt"))` runs case k again with your function in place of that
suspect; the case is closed when the check passes where the broken run failed, also on runs the
case never shows you (other shapes, layouts, seeds), and tpedu without the bug still passes with
your function in place. Write the body yourself: while the check runs, tpedu's own version of the
suspect is the broken one wherever it is called from, so a function that calls it (or returns it)
stays open. `make grade` runs every case.

Communicate only through tpedu.comm.collectives (so the tests' tracer sees it).
"""

from __future__ import annotations

from collections.abc import Callable


def case_1() -> tuple[str, Callable]:
    """Case 1: (the name of the suspect that is wrong, your rewrite of it)."""
    raise NotImplementedError("l16: case 1 not written yet; hint: tpedu.grading.hint('l16', 1)")


def case_2() -> tuple[str, Callable]:
    """Case 2: (the name of the suspect that is wrong, your rewrite of it)."""
    raise NotImplementedError("l16: case 2 not written yet; hint: tpedu.grading.hint('l16', 1)")


def case_3() -> tuple[str, Callable]:
    """Case 3: (the name of the suspect that is wrong, your rewrite of it)."""
    raise NotImplementedError("l16: case 3 not written yet; hint: tpedu.grading.hint('l16', 1)")


def case_4() -> tuple[str, Callable]:
    """Case 4: (the name of the suspect that is wrong, your rewrite of it)."""
    raise NotImplementedError("l16: case 4 not written yet; hint: tpedu.grading.hint('l16', 1)")


def case_5() -> tuple[str, Callable]:
    """Case 5: (the name of the suspect that is wrong, your rewrite of it)."""
    raise NotImplementedError("l16: case 5 not written yet; hint: tpedu.grading.hint('l16', 1)")


def case_6() -> tuple[str, Callable]:
    """Case 6: (the name of the suspect that is wrong, your rewrite of it)."""
    raise NotImplementedError("l16: case 6 not written yet; hint: tpedu.grading.hint('l16', 1)")
