"""The bug zoo's mutation tests: every check passes on tpedu and fails under its bug.

A check that passed under its bug would be a test that cannot catch that failure; a check that
failed on tpedu would be a false alarm. Both directions are asserted for every bug in the zoo.
"""

import pytest
import torch

from tpedu import launch
from tpedu.course import hunt
from tpedu.course.bugzoo import BUGS, broken, catalogue, run_check
from tpedu.cp import ring
from tpedu.model import gpt
from tpedu.parallel import mesh, pipeline, zero
from tpedu.parallel.pipeline import schedules
from tpedu.tp import attention, vocab_parallel
from tpedu.tp import operators as tp_ops


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
            gpt.all_reduce_context_parallel_grads,
            gpt.chunk_positions,
            zero.FlatBuffer.finish_grads,
            zero.ShardedDataParallel.step,
            zero.GatherForBackward.__dict__["backward"],
        ]

    originals = current()

    for name in BUGS:
        with broken(name):
            changed = [a is not b for a, b in zip(originals, current(), strict=True)]
            assert sum(changed) == 1, f"{name} must patch exactly one thing, patched {changed}"
        assert all(a is b for a, b in zip(originals, current(), strict=True)), name
    # a patch is undone even when the block raises
    with pytest.raises(ZeroDivisionError), broken("fused_qkv_naive_split"):
        _ = 1 / 0
    assert attention.split_qkv is originals[5]
    with pytest.raises(ValueError, match="unknown bug 'nope'; the zoo has: no_backward_all_reduce"):
        broken("nope")
    assert all(name in catalogue() for name in BUGS)


def test_the_naive_variants_are_the_documented_mistakes():
    # The broken pieces really are the mistakes named, not arbitrary noise: checked by value.
    w = torch.arange(24.0).reshape(12, 2)  # fused [q|k|v], 2 heads, head_dim 2
    with broken("fused_qkv_naive_split"):
        naive = attention.split_qkv(w, 2, 2, 2, 0)
    assert torch.equal(naive, w[:6])  # rank 0 got q0 q1 k0: the first half of the rows
    assert torch.equal(attention.split_qkv(w, 2, 2, 2, 0), w[[0, 1, 4, 5, 8, 9]])
    layout = mesh.Layout(tp=2, pp=1, dp=2)
    with broken("seed_tp_groups"):
        assert layout.axis_groups("tp") == layout.axis_groups("dp") == [[0, 2], [1, 3]]
        assert layout.axis_groups("pp") == [[0], [1], [2], [3]]  # the other axes unchanged
    assert layout.axis_groups("tp") == [[0, 1], [2, 3]]
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


# ---- the mystery cases of the hunt (tpedu/course/hunt.py)


def _hunt_worker(cases):
    from tpedu.course.grading import implementation

    fix = implementation("l16_bug_hunt", "solutions")
    return {k: (hunt.run_case(k), hunt.run_case(k, fix)) for k in cases}


@pytest.mark.parametrize("world", [2, 4])
def test_each_mystery_fails_with_its_bug_and_passes_with_the_fix(world):
    cases = [k for k in range(1, len(hunt.CASES) + 1) if hunt.world(k) == world]
    assert cases
    results = launch(_hunt_worker, world, cases, timeout=120)
    for k in cases:
        case = hunt.CASES[k - 1]
        broken_run = hunt.report(k, [r[k][0] for r in results], fixed=False)
        fixed_run = hunt.report(k, [r[k][1] for r in results], fixed=True)
        assert not broken_run.ok and fixed_run.ok, (k, str(broken_run), str(fixed_run))
        assert "FAILS" in str(broken_run) and "Case closed" in str(fixed_run)
        for text in (str(broken_run), str(fixed_run)):
            # the case names neither its bug nor the function to fix, nor the broken twin
            secrets = [case.bug, case.function, "BUG"]
            assert not [s for s in secrets if s in text], (k, text)
    assert {c.bug for c in hunt.CASES} <= set(BUGS) and len({c.bug for c in hunt.CASES}) == 6


def test_mystery_numbers_are_checked():
    for bad in (0, 7, "1", True):
        with pytest.raises(ValueError, match="mystery cases 1 to 6"):
            hunt.world(bad)
