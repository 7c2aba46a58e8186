"""Lesson 16's hunt cannot be passed without a diagnosis (tpedu/course/hunt.py).

A case closes only for a function that does the work itself, on the shown run and on runs the
case never shows. Each cheat below is refused, and the reference fixes still close every case:

- an alias of tpedu's own function (itself, as a staticmethod, a bound method, a partial), a
  wrapper that calls it (a lambda over it, functools.wraps, a default argument), or a new
  function on its code object: refused by name before anything runs (`hunt.fix_of`), for every
  case and every suspect;
- a wrapper that hides the reference where the static look does not reach (a class attribute):
  while the check runs, tpedu's function object runs the code under suspicion and counts its
  calls, so the case stays open with a message that says so (every case, every suspect);
- case 2: GPipe's order (it finishes, and is not 1F1B);
- a rewrite that fixes only the shown run (its shape, vocabulary, layout, rows): the runs the
  case never shows fail it;
- a rewrite of another suspect that works around the broken one (case 1: qkv_rows choosing
  its own KV heads);
- a function that raises: "still open", with the error.
"""

import functools
import types

import pytest
import torch

from tpedu import launch
from tpedu.course import grading, hunt
from tpedu.course.hunt_cases import CASES
from tpedu.course.hunt_checks import order_breaks
from tpedu.parallel.pipeline import schedules

REF = grading.implementation("l16_bug_hunt", "solutions")


def _ref(k):
    return getattr(REF, f"case_{k}")()


# ---- refused before anything runs: aliases and wrappers a look at the function finds


def _disguises(original):
    """(what it is, a function that is or calls tpedu's own `original`)."""

    @functools.wraps(original)
    def wrapped(*a, **kw):
        return original(*a, **kw)

    def by_default(*a, _f=original, **kw):
        return _f(*a, **kw)

    cells = original.__closure__
    code_copy = types.FunctionType(original.__code__, original.__globals__, "mine", None, cells)
    renamed = original.__code__.replace(co_name="mine")
    renamed = types.FunctionType(renamed, original.__globals__, "mine", None, cells)
    return {
        "the function itself": original,
        "as a staticmethod": staticmethod(original),
        "as a bound method": types.MethodType(original, object()),
        "a partial": functools.partial(original),
        "a lambda over it": lambda *a, **kw: original(*a, **kw),
        "functools.wraps": wrapped,
        "a default argument": by_default,
        "a new function on its code": code_copy,
        "its code renamed": renamed,
        "a lambda over a list of it": (lambda fs: lambda *a, **kw: fs[0](*a, **kw))([original]),
    }


@pytest.mark.parametrize("k", hunt.numbers())
def test_an_alias_or_a_wrapper_of_tpedus_own_is_refused_by_name(k):
    for s in CASES[k - 1].suspects(k):
        for what, fn in _disguises(s.original).items():
            with pytest.raises(ValueError, match=f"tpedu's own {s.name}") as e:
                hunt.fix_of(k, lambda s=s, fn=fn: (s.name, fn))
            assert "closed" not in str(e.value), (k, s.name, what)
    name, fix = hunt.fix_of(k, lambda: _ref(k))  # the reference is a rewrite: accepted
    assert name == _ref(k)[0] and fix is not None


# ---- refused while it runs: what each case says to a cheat, on every rank


def _hidden(original):
    """A wrapper that reaches tpedu's own function through an object's attribute."""
    holder = types.SimpleNamespace(f=original)
    return lambda *a, **kw: holder.f(*a, **kw)


def _gpipe(n_micro, n_stages, stage):
    return schedules.gpipe(n_micro, n_stages, stage)


def _shown_only(k):
    """A rewrite that is right on the run case k shows and tpedu's broken code elsewhere:
    (suspect name, function)."""
    name, right = _ref(k)
    broken = CASES[k - 1].edit.function()
    shown = {
        1: lambda n_heads, n_kv_heads, tp, rank: (n_heads, n_kv_heads) == (4, 2),
        2: lambda n_micro, n_stages, stage: (n_micro, n_stages) == (2, 2),
        3: lambda logits_shard, start, vocab_size: vocab_size == 37,
        4: lambda self, axis: (self.tp, self.dp, self.pp, self.cp) == (2, 2, 1, 1),
        5: lambda ctx, grad: grad.shape[0] == 3 and grad.shape[-1] == 16,
        6: lambda logits_shard, vocab_size, group=None: logits_shard.shape[0] == 16,
    }[k]

    def fix(*a, **kw):
        return (right if shown(*a, **kw) else broken)(*a, **kw)

    return name, fix


def _compensates():
    """Case 1 worked around in the function that reads the broken one: qkv_rows with its own KV
    heads (the loss comes out right; what else reads the broken function does not)."""
    from tpedu.tp.attention import local_heads

    def qkv_rows(n_heads, n_kv_heads, head_dim, tp, rank):
        q, kv = local_heads(n_heads, n_kv_heads, tp, rank)
        if tp > n_kv_heads:
            kv = [rank // (tp // n_kv_heads)]
        k_base, v_base = n_heads * head_dim, (n_heads + n_kv_heads) * head_dim
        heads = [h * head_dim for h in q] + [k_base + h * head_dim for h in kv]
        heads += [v_base + h * head_dim for h in kv]
        rows = torch.tensor(heads, dtype=torch.int64)[:, None] + torch.arange(head_dim)
        return rows.flatten()

    return "qkv_rows", qkv_rows


def _raises(*a, **kw):
    raise RuntimeError("not yet")


def _cheats_worker(cases):
    """{case: {what: (run_case's result on this rank)}} for the reference and every cheat, and
    the case's runs it never shows, under the bug ("unseen"). The broken run is the same for
    every fix (case 2's hangs for the receives' timeout): the reference's run_case runs it, with
    the unseen runs, and each cheat gets that result and hunt.judge_fix's verdict on it."""
    out = {}
    for k in cases:
        c = CASES[k - 1]
        ref = hunt.run_case(k, _ref(k), False, unseen=True)
        broken = {"shown": None, "broken": ref["broken"], "unseen": None}
        tries = {"shown only": _shown_only(k)}
        tries |= {
            f"hidden wrapper of {s.name}": (s.name, _hidden(s.original)) for s in c.suspects(k)
        }
        tries |= {"raises": (c.edit.suspect.name, _raises)}
        if k == 1:
            tries["compensates"] = _compensates()
        if k == 2:
            tries["gpipe"] = ("one_f_one_b", _gpipe)
        out[k] = {"reference": ref} | {
            what: broken | hunt.judge_fix(k, fix) for what, fix in tries.items()
        }
    return out


@pytest.fixture(scope="module")
def launched():
    """world -> every rank's _cheats_worker result for the cases of that world (one launch
    each, shared by the tests below)."""
    cache = {}

    def get(world):
        if world not in cache:
            cases = [k for k in hunt.numbers() if hunt.world(k) == world]
            assert cases, world
            cache[world] = cases, launch(_cheats_worker, world, cases, timeout=600)
        return cache[world]

    return get


@pytest.mark.parametrize("world", [2, 4])
def test_each_cheat_stays_open_and_the_reference_closes(world, launched):
    cases, results = launched(world)
    for k in cases:
        c = CASES[k - 1]
        verdicts = {
            what: hunt.verdict(k, "yours", [r[k][what] for r in results], name)
            for what, name in [(w, _name(k, w)) for w in results[0][k]]
        }
        assert verdicts["reference"].closed, str(verdicts["reference"])
        for what, v in verdicts.items():
            if what == "reference":
                continue
            text = str(v)
            assert not v.closed and "still open" in text and "closed" not in text, (k, what, text)
            if what == f"hidden wrapper of {c.edit.suspect.name}":  # the others: never closed
                assert "calls tpedu's own" in text.splitlines()[0], (k, what, text)
        shown = [r[k]["shown only"]["fixed"][1] for r in results]
        assert any("runs you have not seen fail" in d for d in shown), (k, shown)
        raised = [r[k]["raises"]["fixed"][1] for r in results]
        assert all("your function raised RuntimeError: not yet" in d for d in raised), raised
        if k == 2:  # GPipe's order finishes the step, and is refused for its order
            details = [r[k]["gpipe"]["fixed"][1] for r in results]
            assert all("the step finished" in d for d in details), details
            # the shown check itself refuses it, not only the runs the case never shows
            assert details[1].startswith("stage 1 runs F0 F1 B0 B1: F1 with 1 in flight"), details
        if k == 1:
            assert "compensates" in verdicts and not verdicts["compensates"].closed


def _name(k, what):
    if what == "reference":
        return _ref(k)[0]
    if what.startswith("hidden wrapper of "):
        return what.removeprefix("hidden wrapper of ")
    return {"gpipe": "one_f_one_b", "compensates": "qkv_rows"}.get(
        what, CASES[k - 1].edit.suspect.name
    )


# ---- the checks themselves: what they refuse, and that tpedu is restored


def test_the_1f1b_order_check():
    for m in range(1, 9):
        for p in range(1, 7):
            for s in range(p):
                assert order_breaks(schedules.one_f_one_b(m, p, s), m, p, s) == "", (m, p, s)
                gpipe = order_breaks(schedules.gpipe(m, p, s), m, p, s)
                assert (gpipe == "") == (m <= p - s), (m, p, s, gpipe)  # GPipe: m in flight
    assert "out of micro-batch order" in order_breaks([("F", 1), ("F", 0)], 2, 2, 0)
    assert "out of micro-batch order" in order_breaks([("F", 0), ("B", 1)], 2, 2, 0)
    assert "while a forward may still run" in order_breaks([("F", 0), ("B", 0)], 2, 2, 0)
    assert "at most 1 on stage 1" in order_breaks([("F", 0), ("F", 1)], 2, 2, 1)
    assert "1 forwards and 0 backwards" in order_breaks([("F", 0)], 1, 2, 1)
    assert "B0 before its forward" in order_breaks([("B", 0), ("F", 0)], 1, 2, 1)
    assert "neither" in order_breaks([("W", 0)], 1, 2, 1)


def test_tpedus_function_object_is_restored_after_a_case():
    originals = [(s.original, s.original.__code__) for c in CASES for s in c.suspects(1)]
    for k in hunt.numbers():
        c = CASES[k - 1]
        s = c.edit.suspect
        before = s.original.__code__, s.original.__defaults__
        with c.edit.patch():
            assert s.original.__code__ is not before[0]
            with s.install(lambda *a, **kw: None) as reached:
                assert reached.calls == 0
        assert (s.original.__code__, s.original.__defaults__) == before
    assert all(fn.__code__ is code for fn, code in originals)


@pytest.mark.parametrize("world", [2, 4])
def test_unseen_runs_fail_under_every_bug(world, launched):
    cases, results = launched(world)  # the reference's run_case ran them under the bug
    for k in cases:
        unseen = [r[k]["reference"]["unseen"] for r in results]
        assert not all(ok for ok, _ in unseen), (k, unseen)
