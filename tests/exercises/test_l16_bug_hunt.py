"""Grades exercises/l16_bug_hunt.py: the fixed versions of the bug zoo's broken functions, each
checked directly and through its mystery case of notebook 15 (the case's check, run with the
learner's function in place of the broken one).

Each test would fail on the broken twin in tpedu/course/bugzoo.py (the bug zoo's own tests prove the
zoo's checks catch them; these check the learner's fixes directly). float64 throughout: a
correct f gives dense's dL/dx up to reordered sums (~1e-16 relative), so 1e-12 absolute.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tpedu
from tests.exercises import parity_group
from tpedu.comm.tracer import CommTracer
from tpedu.course import hunt
from tpedu.course.grading import implementation
from tpedu.parallel.pipeline.schedules import peak_in_flight, simulate

NAME = "l16_bug_hunt"


def _f_worker(x, w, dy):
    m = implementation(NAME)
    x, w, dy = (a.to(tpedu.device()) for a in (x, w, dy))  # made on the CPU by the test
    t, r = dist.get_world_size(), dist.get_rank()
    n = w.shape[0] // t
    x = x.clone().requires_grad_()
    with CommTracer() as tr:
        y = F.linear(m.copy_to_tp_region(x, None), w[r * n : (r + 1) * n])
        same = torch.equal(m.copy_to_tp_region(x, None).detach(), x.detach())
        (y * dy[..., r * n : (r + 1) * n]).sum().backward()
    return x.grad, same, tr.count("all_reduce", "forward"), tr.numel("all_reduce", "backward")


def test_copy_to_tp_region_all_reduces_the_gradient_once():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 7, generator=g, dtype=torch.float64)
    w = torch.randn(12, 7, generator=g, dtype=torch.float64)
    dy = torch.randn(3, 5, 12, generator=g, dtype=torch.float64)
    xd = x.clone().requires_grad_()
    (F.linear(xd, w) * dy).sum().backward()
    for tp in (2, 3):
        for r, (grad, same, fwd, bwd) in enumerate(tpedu.launch(_f_worker, tp, x, w, dy)):
            assert same, "f must not change x in the forward"
            diff = (grad - xd.grad).abs().max().item()
            assert diff < 1e-12, f"tp={tp} rank {r}: max |dL/dx - dense| = {diff:.3e}"
            assert fwd == 0, f"f's forward must not communicate ({fwd} all-reduces)"
            # the second f in the worker gets no gradient: only one all-reduce of x's size
            assert bwd == x.numel(), f"backward all-reduced {bwd} elements, expected {x.numel()}"


def test_mask_padding():
    m = implementation(NAME)
    g = torch.Generator().manual_seed(1)
    shard = torch.randn(2, 3, 5, generator=g, dtype=torch.float64)
    before = shard.clone()
    out = m.mask_padding(shard, 10, 13)  # columns 10..14: 13 and 14 are padding
    assert torch.equal(shard, before), "do not modify the input in place"
    assert torch.isneginf(out[..., 3:]).all(), "columns >= vocab_size must be -inf"
    assert torch.equal(out[..., :3], shard[..., :3]), "real columns must be unchanged"
    assert torch.equal(m.mask_padding(shard, 0, 13), shard), "a shard without padding"
    assert torch.isneginf(m.mask_padding(shard, 15, 13)).all(), "a shard of padding only"


def _argmax_worker(full, vocab):
    m = implementation(NAME)
    full = full.to(tpedu.device())
    t, r = dist.get_world_size(), dist.get_rank()
    n = -(-vocab // t)
    padded = torch.cat([full, full.new_full((*full.shape[:-1], n * t - vocab), 1e4)], -1)
    with CommTracer() as tr:
        ids = m.vocab_parallel_argmax(padded[..., r * n : (r + 1) * n].contiguous(), vocab, None)
    return ids, max((rec.numel for rec in tr.records), default=0)


def test_vocab_parallel_argmax_is_the_global_one():
    g = torch.Generator().manual_seed(2)
    vocab = 37
    full = torch.randn(4, 6, vocab, generator=g, dtype=torch.float64)
    full[0, 0, [3, 20, 30]] = 9.0  # a tie across shards: the lowest id wins
    full[1, 1, 36] = 9.0  # the last real column
    ref = full.argmax(-1)
    for tp in (2, 3, 4):
        for r, (ids, biggest) in enumerate(tpedu.launch(_argmax_worker, tp, full, vocab)):
            wrong = int((ids != ref).sum())
            assert wrong == 0, f"tp={tp} rank {r}: {wrong} of {ref.numel()} ids differ from dense"
            assert biggest <= 2 * ref.numel() * tp, "never gather the logits themselves"


def test_kv_heads_of_rank():
    m = implementation(NAME)
    assert [m.kv_heads_of_rank(8, 2, 4, r) for r in range(4)] == [[0], [0], [1], [1]]
    assert [m.kv_heads_of_rank(8, 2, 8, r) for r in range(8)] == [[0]] * 4 + [[1]] * 4
    assert [m.kv_heads_of_rank(4, 1, 2, r) for r in range(2)] == [[0], [0]]
    assert [m.kv_heads_of_rank(8, 4, 2, r) for r in range(2)] == [[0, 1], [2, 3]]
    assert [m.kv_heads_of_rank(6, 6, 3, r) for r in range(3)] == [[0, 1], [2, 3], [4, 5]]


def test_tp_groups():
    m = implementation(NAME)
    assert m.tp_groups(8, 2, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert m.tp_groups(4, 2) == [[0, 1], [2, 3]]  # the seed's grouping gives [[0, 2], [1, 3]]
    assert m.tp_groups(12, 3, 2) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert m.tp_groups(8, 4, 1) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert m.tp_groups(3, 1) == [[0], [1], [2]]


def test_one_f_one_b_runs_without_deadlock():
    m = implementation(NAME)
    assert m.one_f_one_b(4, 2, 0) == [
        ("F", 0),
        ("F", 1),
        ("B", 0),
        ("F", 2),
        ("B", 1),
        ("F", 3),
        ("B", 2),
        ("B", 3),
    ]
    assert m.one_f_one_b(3, 2, 1) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]
    assert m.one_f_one_b(2, 4, 0) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    for p, mb in ((2, 2), (3, 5), (4, 6)):
        plans = [[tuple(a) for a in m.one_f_one_b(mb, p, s)] for s in range(p)]
        simulate(plans)  # raises "the schedules deadlock" if the sends and receives mismatch
        assert [peak_in_flight(a) for a in plans] == [min(mb, p - s) for s in range(p)]


def _group_worker(full, vocab):
    m = implementation(NAME)
    rank = dist.get_rank()
    group, _ = parity_group()
    k = rank % 2
    t, r = dist.get_world_size(group), dist.get_rank(group)
    x = torch.ones(4, dtype=torch.float64, device=tpedu.device(), requires_grad=True)
    (m.copy_to_tp_region(x, group) * (rank + 1)).sum().backward()
    logits = full[k].to(tpedu.device())  # this group's logits
    n = -(-vocab // t)
    padded = torch.cat([logits, logits.new_full((*logits.shape[:-1], n * t - vocab), 1e4)], -1)
    ids = m.vocab_parallel_argmax(padded[..., r * n : (r + 1) * n].contiguous(), vocab, group)
    return x.grad, ids


def test_group_argument():
    """On groups {0, 2} and {1, 3} of 4 ranks: f sums the gradient over the group only, and the
    argmax is the one of the group's own logits."""
    g = torch.Generator().manual_seed(3)
    vocab = 37
    full = torch.randn(2, 4, 6, vocab, generator=g, dtype=torch.float64)  # one batch per group
    for rank, (grad, ids) in enumerate(tpedu.launch(_group_worker, 4, full, vocab)):
        members = [rank % 2, rank % 2 + 2]
        want = sum(q + 1 for q in members)  # integers: exact
        assert torch.equal(grad, torch.full((4,), float(want), dtype=torch.float64)), (
            f"rank {rank}: f's backward gave {grad.tolist()}, the sum over {members} is {want}"
        )
        wrong = int((ids != full[rank % 2].argmax(-1)).sum())
        assert wrong == 0, (
            f"rank {rank}: {wrong} of {ids.numel()} ids differ from the group's dense argmax"
        )


def _case_worker(k):
    return hunt.run_case(k, implementation(NAME), show=False)[1:]


@pytest.mark.parametrize("case", range(1, len(hunt.CASES) + 1))
def test_mystery_case_passes_with_your_fix(case):
    """The notebook's case, its check run with your function in place of the broken one (the
    zoo's tests prove the broken one fails this check)."""
    results = tpedu.launch(_case_worker, hunt.world(case), case, timeout=120)
    bad = [f"rank {r}: {detail}" for r, (ok, detail) in enumerate(results) if not ok]
    assert not bad, f"case {case} still fails: " + "; ".join(bad)
