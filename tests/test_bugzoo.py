"""The bug zoo's mutation tests: every check passes on tpedu and fails under its bug; and the
hunt built on six of them (tpedu/course/hunt.py).

A check that passed under its bug would be a test that cannot catch that failure; a check that
failed on tpedu would be a false alarm. Both directions are asserted for every bug in the zoo.

The hunt: each case's bug fails its check and the reference fix passes it; the suspects are
functions that really ran on the failing path, the edited one shown as it ran; nothing a learner
reads (case texts, reports, stubs, error messages, the notebook) names or locates a case's bug;
"closed" only for the learner's own fix that passes, "not written yet" for a stub.
"""

import json
import re
import sys
import threading
import types

import pytest
import torch

from tpedu import launch
from tpedu.course import grading, hunt
from tpedu.course.bugzoo import BUGS, EDITS, LATER, broken, catalogue, run_check
from tpedu.course.hunt_cases import CASES
from tpedu.cp import context, ring
from tpedu.model import gpt
from tpedu.parallel import mesh, pipeline, zero
from tpedu.parallel.pipeline import schedules
from tpedu.tp import attention, vocab_parallel
from tpedu.tp import operators as tp_ops
from tpedu.train import optim


def _zoo_worker(names):
    checks = {}  # each distinct check once on plain tpedu, then every bug's broken run
    for n in names:
        checks.setdefault(BUGS[n].check, n)
    clean = {n: run_check(n, with_bug=False) for n in checks.values()}
    return clean, {n: run_check(n, with_bug=True) for n in names}


def _assert_caught(results, names):
    for rank, (clean, _) in enumerate(results):
        for n, (ok, detail) in clean.items():
            assert ok, f"rank {rank}: {n}'s check fails on plain tpedu: {detail}"
    for n in names:
        verdicts = [r[1][n] for r in results]
        assert not all(ok for ok, _ in verdicts), f"{n} slipped through its check: {verdicts}"


@pytest.mark.parametrize("world", [2, 4])
def test_every_bug_is_caught_and_tpedu_passes(world):
    names = [n for n, b in BUGS.items() if b.world == world and n != "pipeline_warmup_reversed"]
    assert names
    _assert_caught(launch(_zoo_worker, world, names, timeout=120), names)


def test_pipeline_bug_hangs_into_a_clear_timeout():
    def worker():
        return run_check("pipeline_warmup_reversed", False), run_check(
            "pipeline_warmup_reversed", True
        )

    results = launch(worker, 2, timeout=60)
    assert all(clean[0] for clean, _ in results)
    for stage, (_, (ok, detail)) in enumerate(results):
        assert not ok and detail.startswith(f"pipeline stage {stage}"), detail
    assert "gradient" in results[0][1][1] and "activation" in results[1][1][1]


def test_patches_are_undone_and_names_checked():
    def current():
        return [
            tp_ops.CopyToTPRegion.__dict__["backward"],
            tp_ops.ReduceFromTPRegion.__dict__["forward"],
            gpt.all_reduce_sequence_parallel_grads,
            vocab_parallel._mask_padding,
            vocab_parallel.vocab_parallel_argmax,
            attention.split_qkv,
            attention.local_heads,
            attention.ParallelAttention.all_reduce_replicated_kv_grads,
            mesh.Layout.axis_groups,
            schedules.one_f_one_b,
            gpt.index_dropout,
            ring.merge_partials,
            context.chunk_positions,
            zero.FlatBuffer.finish_grads,
            zero.ShardedDataParallel.step,
            zero.GatherForBackward.__dict__["backward"],
            optim.gradient_group,
        ]

    def code(value):  # the hunt's bugs swap a function's code, the others the function
        return getattr(value, "__func__", value).__code__

    originals = current()
    codes = [code(v) for v in originals]

    for name in BUGS:
        with broken(name):
            now = current()
            changed = [
                a is not b or c is not code(b)
                for a, b, c in zip(originals, now, codes, strict=True)
            ]
            assert sum(changed) == 1, f"{name} must patch exactly one thing, patched {changed}"
        assert all(a is b for a, b in zip(originals, current(), strict=True)), name
        assert all(c is code(v) for c, v in zip(codes, current(), strict=True)), name
    # a patch is undone even when the block raises
    with pytest.raises(ZeroDivisionError), broken("fused_qkv_naive_split"):
        _ = 1 / 0
    assert attention.split_qkv is originals[5]
    with pytest.raises(ValueError, match="unknown bug 'nope'; the zoo has: no_backward_all_reduce"):
        broken("nope")
    assert all(name in catalogue() for name in BUGS)
    assert catalogue(["wrong_group"]).splitlines()[2].startswith("wrong_group ")
    assert len(catalogue(["wrong_group"]).splitlines()) == 3


def test_the_naive_variants_are_the_documented_mistakes():
    # The broken pieces really are the mistakes named, not arbitrary noise: checked by value.
    w = torch.arange(24.0).reshape(12, 2)  # fused [q|k|v], 2 heads, head_dim 2
    with broken("fused_qkv_naive_split"):
        naive = attention.split_qkv(w, 2, 2, 2, 0)
    assert torch.equal(naive, w[:6])  # rank 0 got q0 q1 k0: the first half of the rows
    assert torch.equal(attention.split_qkv(w, 2, 2, 2, 0), w[[0, 1, 4, 5, 8, 9]])
    layout = mesh.Layout(tp=2, pp=1, dp=2)
    with broken("seed_tp_groups"):  # the loops swapped: each axis gets the other axes' groups
        assert layout.axis_groups("tp") == [[0, 2], [1, 3]]  # the second seed's "TP groups"
        assert layout.axis_groups("dp") == [[0, 1], [2, 3]]  # the real TP groups
        assert layout.axis_groups("pp") == [[0, 1, 2, 3]]
        assert mesh.Layout(tp=4).axis_groups("tp") == [[0], [1], [2], [3]]  # one rank each
    assert layout.axis_groups("tp") == [[0, 1], [2, 3]]
    assert layout.axis_groups("dp") == [[0, 2], [1, 3]]
    shard = torch.zeros(2, 10)  # columns 30..39 of a vocabulary of 37 at tp 4: 37, 38, 39 pad
    with broken("padded_vocab_unmasked"):
        masked = torch.isinf(vocab_parallel._mask_padding(shard, 30, 37)[0])
    assert masked.tolist() == [False] * 8 + [True] * 2  # the first padding column stays
    assert torch.isinf(vocab_parallel._mask_padding(shard, 30, 37)[0]).tolist()[7:] == [True] * 3
    with broken("pipeline_warmup_reversed"):
        assert pipeline.schedule("1f1b", 2, 2, 0) == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    assert pipeline.schedule("1f1b", 2, 2, 0) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]


def test_the_zero_bugs_show_their_documented_symptoms():
    """Against plain DP: the summed gradient is exactly N× (norm ratio 2 at dp 2), the double
    update leaves step 0 right and moves step 1, and backward over a freed block crashes."""

    def worker():
        names = ("zero_grads_summed", "zero_shard_updated_twice", "zero3_no_backward_gather")
        return {n: run_check(n, with_bug=True)[1] for n in names}

    for detail in launch(worker, 2, timeout=120):
        assert (
            detail["zero_grads_summed"].startswith("step 0")
            and "(× 2.000)" in detail["zero_grads_summed"]
        ), detail
        assert detail["zero_shard_updated_twice"].startswith("step 1: "), detail
        assert "storage of size 0" in detail["zero3_no_backward_gather"], detail


# ---- the hunt's bugs: one edit of tpedu's own source each (tpedu/course/mutation.py)


def test_each_edit_is_one_small_edit_of_tpedus_own_function():
    assert set(EDITS) == {c.bug for c in CASES} and len(CASES) == 6
    for name, edit in EDITS.items():
        original = edit.suspect.original
        assert edit.suspect.source().count(edit.old) == 1, name
        fn = edit.function()
        assert fn is not original and fn.__name__ == original.__name__, name
        assert fn.__globals__ is original.__globals__, name  # runs in tpedu's own module
        code, ref = fn.__code__, original.__code__
        assert (code.co_filename, code.co_firstlineno) == (ref.co_filename, ref.co_firstlineno)
        assert "#" not in edit.new and "bug" not in edit.new.lower(), name  # nothing marks it
        changed = [
            line
            for line in edit.diff().splitlines()[2:]
            if line[:1] in "+-" and not line.startswith("@@")
        ]
        assert 1 <= len(changed) <= 6, (name, changed)
        assert BUGS[name].patch == edit.patch, name  # the zoo's bug is the same edit


# ---- the hunt's cases (tpedu/course/hunt.py, tpedu/course/hunt_cases.py)


def _calls(fn, *args):
    """fn(*args) and every (file, first line, name) of the Python functions it called."""
    seen = set()

    def profile(frame, event, arg):
        if event == "call":
            c = frame.f_code
            seen.add((c.co_filename, c.co_firstlineno, c.co_name))

    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        out = fn(*args)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return out, seen


def _hunt_worker(cases):
    ref = grading.implementation("l16_bug_hunt", "solutions")
    out = {}
    for k in cases:
        broken_run, called = _calls(hunt.run_case, k, None, True)
        fixed_run = hunt.run_case(k, getattr(ref, f"case_{k}")(), False)
        out[k] = (broken_run, fixed_run, called)
    return out


def _key(suspect):
    code = suspect.original.__code__
    return (code.co_filename, code.co_firstlineno, code.co_name)


@pytest.mark.parametrize("world", [2, 4])
def test_each_case_fails_with_its_bug_passes_with_the_fix_and_its_suspects_ran(world):
    cases = [k for k in hunt.numbers() if hunt.world(k) == world]
    assert cases
    results = launch(_hunt_worker, world, cases, timeout=300)
    ref = grading.implementation("l16_bug_hunt", "solutions")
    for k in cases:
        broken_runs = [r[k][0] for r in results]
        fixed_runs = [r[k][1] for r in results]
        shown = hunt.broken_report(k, broken_runs)
        assert not shown.ok and "FAILS" in str(shown), (k, str(shown))  # the bug shows
        assert all(r["fixed"][0] for r in fixed_runs), (k, fixed_runs)  # the fix removes it
        name = getattr(ref, f"case_{k}")()[0]
        as_yours = hunt.verdict(k, "yours", fixed_runs, name)
        as_reference = hunt.verdict(k, "reference", fixed_runs, name)
        assert as_yours.closed and not as_reference.closed
        for text in (str(shown), str(as_reference)):
            _assert_blind(text, f"case {k}")
        called = set().union(*(r[k][2] for r in results))
        for s in CASES[k - 1].suspects(k):
            assert _key(s) in called, f"case {k}: suspect {s.name} never ran"
        if k in (1, 3, 4, 5):  # the cases that compare training runs draw their loss curves
            runs = shown.observed.runs.values()
            assert runs and all(len(a) == len(b) > 1 for a, b in runs), k


def _secrets():
    found = []
    for c in CASES:  # a method's bare name ("backward") is every autograd Function's: not a secret
        module_level = isinstance(c.edit.owner, types.ModuleType)
        found += [c.bug, c.edit.suspect.name, *c.secrets] + ([c.edit.attr] if module_level else [])
    return sorted({s.lower() for s in found})


def _assert_blind(text, where):
    low = text.lower()
    leaks = [s for s in _secrets() if s in low]
    assert not leaks, f"{where} names a bug: {leaks} in\n{text}"


def test_the_suspects_show_the_code_as_it_ran_unmarked():
    header = re.compile(r"^# ── (\S+) · reads from its module: (.+)$")
    positions = []
    listed = {}  # a function listed by several cases: the same listing in each
    for k in hunt.numbers():
        c = CASES[k - 1]
        found = c.suspects(k)
        assert [s.name for s in found] == [s.name for s in c.suspects(k)]  # a fixed order
        assert [s for s in found if s == c.edit.suspect] == [c.edit.suspect]  # exactly one
        positions.append(found.index(c.edit.suspect))
        text = hunt.suspects(k)
        heads = [header.match(line) for line in text.splitlines() if line.startswith("# ──")]
        assert all(heads) and [h.group(1) for h in heads] == [s.name for s in found], text
        shown_as_it_ran = c.edit.source().rstrip() in text and c.edit.old not in text
        assert shown_as_it_ran, k
        for s in found:
            if s != c.edit.suspect:
                assert s.source().rstrip() in text, (k, s.name)
            shown = c.edit.source() if s == c.edit.suspect else s.source()
            assert listed.setdefault(s.name, shown) == shown, f"{s.name} listed two ways"
        _assert_blind(text.split("\n\n# ──")[0], f"suspects({k})'s heading")
        # nothing locates a suspect: no file, no line, no word on where the working code is
        heading, listings = text.split("\n\n# ──", 1)
        path = c.edit.suspect.where()[0]
        assert path not in text and ".py" not in listings and ", line " not in text, k
        assert "files" not in heading, k
    assert len(set(positions)) > 2, f"the broken suspect sits at the same places: {positions}"


def _fake_runs(world, broken_ok, fixed_ok):
    return [{"broken": (broken_ok, "b"), "fixed": (fixed_ok, "f"), "shown": None}] * world


def test_closed_only_for_your_own_fix_that_passes_where_the_bug_failed():
    for k in hunt.numbers():
        w = hunt.world(k)
        yours = hunt.verdict(k, "yours", _fake_runs(w, False, True), "X")
        assert yours.closed and str(yours).startswith(f"Case {k} closed: with your X")
        still = hunt.verdict(k, "yours", _fake_runs(w, False, False), "X")
        assert not still.closed and "still open" in str(still) and "closed" not in str(still)
        nothing_to_fix = hunt.verdict(k, "yours", _fake_runs(w, True, True), "X")
        assert not nothing_to_fix.closed
        ref = hunt.verdict(k, "reference", _fake_runs(w, False, True), "X")
        assert not ref.closed and "closed" not in str(ref) and "X" not in str(ref)
        assert str(ref).startswith(f"Case {k}: not written yet") and "reference fix ran" in str(ref)
        with pytest.raises(AssertionError, match="reference fix must pass"):
            hunt.verdict(k, "reference", _fake_runs(w, False, False), "X")
        stub = hunt.verdict(k, "unwritten", [])
        assert not stub.closed and "not written yet" in str(stub) and "closed" not in str(stub)
        for text in map(str, (yours, still, ref, stub)):
            _assert_blind(text, f"case {k}'s verdict")


def test_an_unwritten_stub_says_not_written_yet(monkeypatch):
    stubs = grading.implementation("l16_bug_hunt", "exercises")
    for k in hunt.numbers():
        with pytest.raises(NotImplementedError):
            getattr(stubs, f"case_{k}")()
        report = hunt.check(k, stubs)  # nothing launches
        assert str(report).startswith(f"Case {k}: not written yet") and "Nothing ran" in str(report)
        assert not report.closed and not report.ok


def _learner(**cases):
    """A module like pick's: case functions of the learner's own."""
    module = types.ModuleType("picked_l16_bug_hunt")
    for name, fn in cases.items():
        setattr(module, name, fn)
    return module


def _my_mask(logits_shard, start, vocab_size):
    cols = torch.arange(start, start + logits_shard.shape[-1], device=logits_shard.device)
    return logits_shard.masked_fill(cols >= vocab_size, float("-inf"))


def _my_padded_vocab(vocab_size, tp):
    return -(-vocab_size // tp) * tp  # right, and not what broke


def test_check_closes_a_case_with_your_fix_only(monkeypatch, capsys):
    mine = _learner(case_3=lambda: ("_mask_padding", _my_mask))
    assert grading.whose(mine, "case_3") == "yours"
    closed = hunt.check(3, mine)
    assert closed.closed and str(closed).startswith("Case 3 closed: with your _mask_padding")
    other = hunt.check(3, _learner(case_3=lambda: ("padded_vocab", _my_padded_vocab)))
    assert not other.closed and "still open" in str(other) and "closed" not in str(other)
    monkeypatch.delenv("TPEDU_IMPL", raising=False)
    mixed = grading.pick("l16_bug_hunt")  # the stub file untouched: every case_k the reference's
    capsys.readouterr()
    assert grading.whose(mixed, "case_3") == "reference"
    ref = hunt.check(3, mixed)
    assert ref.ok and not ref.closed and "closed" not in str(ref)
    assert "not written yet" in str(ref) and "The reference fix ran" in str(ref)


def test_a_fix_that_is_no_rewrite_is_refused():
    from tpedu.tp import vocab_parallel as vp

    bad = {  # what case_3 returned -> what the error says
        "a pair": lambda: _my_mask,
        "not one of case 3's suspects": lambda: ("softmax", _my_mask),
        "not a function": lambda: ("_mask_padding", 3),
        "tpedu's own": lambda: ("_mask_padding", vp._mask_padding),
    }
    for message, make in bad.items():
        with pytest.raises(ValueError, match=message) as e:
            hunt.check(3, _learner(case_3=make))
        # it may repeat the name you returned and list the suspects; beyond them, nothing
        text = str(e.value)
        for s in CASES[2].suspects(3):
            text = text.replace(s.name, "")
        _assert_blind(text, f"the error {text!r}")
    with pytest.raises(ValueError, match="has no function case_3"):
        hunt.check(3, _learner())


def test_what_a_learner_reads_names_no_bug():
    texts = {f"case {k}'s story": c.story for k, c in enumerate(CASES, 1)}
    texts |= {f"case {k}'s check": c.compares for k, c in enumerate(CASES, 1)}
    texts |= {f"repr of case {k}": repr(c) for k, c in enumerate(CASES, 1)}
    texts["the stub file"] = (grading.ROOT / "exercises" / "l16_bug_hunt.py").read_text()
    texts["hint 1"] = str(grading.hint("l16", 1))
    texts["hunt's docstring"] = hunt.__doc__
    for where, text in texts.items():
        _assert_blind(text, where)


def test_mystery_numbers_are_checked():
    for bad in (0, 7, "1", True):
        with pytest.raises(ValueError, match="mystery cases 1 to 6"):
            hunt.world(bad)


def test_answers_come_from_a_call_and_the_notebook_stores_none():
    for k in hunt.numbers():
        c, text = CASES[k - 1], hunt.answer(k)
        assert c.edit.suspect.name in text and c.bug in text and c.explain in text
        assert "(as it ran)" in text and c.edit.diff() in text
    nb = json.loads((grading.ROOT / "notebooks" / "16_bug_hunt.ipynb").read_text())
    sources = ["".join(cell["source"]) for cell in nb["cells"]]
    hunting = [i for i, t in enumerate(sources) if "hunt.case(" in t or "hunt.check(" in t]
    guide = [i for i, t in enumerate(sources) if "troubleshoot.GUIDE" in t]
    assert guide and min(guide) > max(hunting), "the field guide names causes: after the hunt"
    for name in BUGS:  # the lesson shows no bug of what a later lesson teaches
        if name in LATER:
            assert name not in json.dumps(nb), f"lesson 16 shows {name}, taught later"
    for i, cell in enumerate(nb["cells"]):
        source = "".join(cell["source"])
        if cell["cell_type"] == "code":
            assert "answer(" not in source, f"cell {i} calls the answers"
        outputs = "".join(
            "".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/plain", ""))
            for o in cell.get("outputs", [])
        )
        if "hunt.suspects(" in source or "troubleshoot.GUIDE" in source:
            continue  # the code that ran (it names its functions), the field guide (kinds)
        _assert_blind(source + outputs, f"notebook cell {i}")


def test_the_lesson_tours_only_what_earlier_lessons_taught():
    """Expert parallelism comes after lesson 16: its bug stays in the zoo (and in the tests
    above), out of the lesson's tour."""
    assert LATER and LATER <= set(BUGS)
    assert not LATER & set(hunt.unhunted())
    assert LATER <= set(hunt.unhunted(later=True))
    assert set(hunt.unhunted(later=True)) | {c.bug for c in CASES} == set(BUGS)
