"""Grades exercises/l12_zero.py: ZeRO's reduce-scatter of a gradient, ZeRO-3's gather/free of a
block's parameters, and the ZeRO memory formula.

The gradients are integer-valued float64: their sums are exact, so the mean (one division) is
compared with 1e-15 relative, while a sum instead of a mean is off by a factor N. The gathered
parameters are copies of the whole tensor and compared exactly. The formula is checked against
the ZeRO paper's Figure 1 (7.5 B parameters, 64 ranks) and against tpedu's ledger (taken
before: tpedu's own ZeRO, tpedu.parallel.zero's FlatBuffer, and its ledger refuse to run while
the learner's code does, so a wrapper or an alias of them fails).
"""

import pytest
import torch
import torch.distributed as dist

import tpedu
from tests.exercises import parity_group, refusing
from tpedu.analysis import memory
from tpedu.analysis.memory import ledger
from tpedu.analysis.shape import ModelShape
from tpedu.comm.tracer import CommTracer
from tpedu.course.grading import implementation
from tpedu.parallel import zero

NAME = "l12_zero"
TWINS = (
    zero.FlatBuffer.gather,
    zero.FlatBuffer.free,
    zero.FlatBuffer.reduce_grads,
    zero.FlatBuffer.finish_grads,
    zero.held_bytes,
    memory.ledger,
)
NUMEL = 10  # uneven on 3 and 4 ranks: padding


def gradient(rank):
    g = torch.Generator().manual_seed(rank + 1)
    return torch.randint(-50, 50, (NUMEL,), generator=g).double()


def padded_mean(ranks, size):
    n = -(-NUMEL // size)
    mean = sum(gradient(r) for r in ranks) / len(ranks)
    return torch.nn.functional.pad(mean, (0, n * size - NUMEL)), n


def test_reduce_scatter_mean_gives_each_rank_its_shard_of_the_mean():
    @refusing(*TWINS)
    def worker():
        flat = gradient(dist.get_rank()).to(tpedu.device())
        before = flat.clone()
        with CommTracer() as t:
            out = implementation(NAME).reduce_scatter_mean(flat, None)
        return out.cpu(), t.count("reduce_scatter"), torch.equal(flat, before)

    for size in (1, 2, 3, 4):
        want, n = padded_mean(range(size), size)
        for rank, (out, calls, unchanged) in enumerate(tpedu.launch(worker, size, timeout=30)):
            assert calls == 1, f"{calls} reduce-scatters: one for the whole flat gradient"
            assert unchanged, "the input gradient must not be modified"
            assert out.shape == (n,), f"N = {size}: shard of {n} elements, got {tuple(out.shape)}"
            expect = want[rank * n : (rank + 1) * n]
            diff = (out - expect).abs().max().item()
            assert diff <= 1e-15 * want.abs().max().item(), (
                f"N = {size}, rank {rank}: max |got - mean| = {diff:.2e} (a sum is N× the mean)"
            )


def test_reduce_scatter_mean_over_its_group_only():
    @refusing(*TWINS)
    def worker():
        group, _ = parity_group()
        return implementation(NAME).reduce_scatter_mean(gradient(dist.get_rank()), group)

    for rank, out in enumerate(tpedu.launch(worker, 4, timeout=30)):
        members = [rank % 2, rank % 2 + 2]
        want, n = padded_mean(members, 2)
        k = members.index(rank)
        diff = (out - want[k * n : (k + 1) * n]).abs().max().item()
        assert diff <= 1e-15 * want.abs().max().item(), f"rank {rank}: not the mean over {members}"


@refusing(*TWINS)
def _lazy_worker():
    size, rank = dist.get_world_size(), dist.get_rank()
    n = -(-NUMEL // size)
    whole = torch.arange(NUMEL, dtype=torch.float64) * 1.5 - 4
    shard = torch.nn.functional.pad(whole, (0, n * size - NUMEL))[rank * n : (rank + 1) * n]
    lazy = implementation(NAME).LazyParams(shard.clone(), NUMEL)
    out = {"rest": lazy.held_bytes()}
    with CommTracer() as t:
        first = lazy.gather()
        out["whole"] = torch.equal(first, whole)
        out["held"] = lazy.held_bytes()
        out["again"] = torch.equal(lazy.gather(), whole)
    out["gathers"] = t.count("all_gather")
    # as in ZeRO-3: a parameter living in the buffer is saved by autograd in "forward", the
    # buffer freed and re-gathered, and the saved view read in "backward"
    x = torch.ones(3, 5, dtype=torch.float64, requires_grad=True)
    w = torch.nn.Parameter(torch.empty(0, dtype=torch.float64))
    w.data = lazy.gather().view(2, 5)
    y = x @ w.t()
    lazy.free()
    out["freed"] = lazy.held_bytes()
    lazy.gather()
    out["view_after_regather"] = torch.equal(first, whole)
    y.sum().backward()
    out["backward"] = torch.equal(x.grad, whole.view(2, 5).sum(0).expand(3, 5))
    lazy.free()
    out["freed_again"] = lazy.held_bytes()
    return out


@pytest.mark.parametrize("size", [1, 3])
def test_lazy_params_gather_whole_and_hold_nothing_after_free(size):
    n = -(-NUMEL // size)
    for rank, r in enumerate(tpedu.launch(_lazy_worker, size, timeout=30)):
        assert r["rest"] == 0, f"rank {rank}: {r['rest']} bytes held at rest (expect 0)"
        assert r["whole"], f"rank {rank}: gather() is not the whole parameter tensor"
        assert r["held"] == 8 * n * size, f"rank {rank}: {r['held']} bytes gathered"
        assert r["again"] and r["gathers"] == 1, (
            f"rank {rank}: {r['gathers']} all-gathers for two gather() calls: the second must "
            "reuse the gathered buffer"
        )
        assert r["freed"] == 0 and r["freed_again"] == 0, f"rank {rank}: memory left after free()"
        assert r["view_after_regather"], (
            f"rank {rank}: a view from before free() does not see the re-gathered values: keep "
            "one buffer and release its storage instead of replacing the tensor"
        )
        assert r["backward"], f"rank {rank}: backward through a freed, re-gathered view is wrong"


@refusing(*TWINS)
def test_zero_memory_formula_matches_the_paper():
    f = implementation(NAME).zero_bytes_per_rank
    gb = [sum(f(7.5e9, 64, stage)) / 1e9 for stage in range(4)]
    assert [round(x, 1) for x in gb] == [120.0, 31.4, 16.6, 1.9], gb
    assert f(100, 4, 0) == (200, 200, 1200)
    assert f(100, 4, 1) == (200, 200, 300)
    assert f(100, 4, 2) == (200, 50, 300)
    assert f(100, 4, 3) == (50, 50, 300)
    assert f(100, 1, 3) == (200, 200, 1200)  # one rank: nothing to shard
    assert f(10, 2, 3, weight_bytes=4, grad_bytes=4, optimizer_bytes=8) == (20, 20, 40)


def test_zero_memory_formula_matches_the_ledger():
    shape = ModelShape(vocab_size=1000, hidden=64, n_layers=4, n_heads=4, seq_len=32, micro_batch=1)
    f = implementation(NAME).zero_bytes_per_rank
    for dp in (2, 8):
        for stage in range(4):
            want = ledger(shape, dp=dp, zero=stage)
            with refusing(*TWINS):
                got = f(want.params, dp, stage)
            expect = (want.weights, want.gradients, want.optimizer)
            assert got == pytest.approx(expect, rel=1e-12), (dp, stage, got, expect)


@pytest.mark.parametrize("bad", [{"stage": 4}, {"stage": -1}, {"dp": 0}])
@refusing(*TWINS)
def test_zero_memory_formula_rejects_bad_input(bad):
    args = {"psi": 100, "dp": 2, "stage": 1} | bad
    with pytest.raises(ValueError, match=str(next(iter(bad.values())))):
        implementation(NAME).zero_bytes_per_rank(**args)
