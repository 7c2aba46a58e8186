"""Grades exercises/l12_bucketed_allreduce.py: bucket assignment and one all-reduce per bucket.

The bucket lists are compared exactly. The averaged tensors are integer-valued float64 sums
divided by the world size, computed the same way on every path: compared with 1e-15 relative
(the division's rounding), while a sum instead of a mean is off by a factor t. tpedu's own
buckets (tpedu.parallel.data_parallel) refuse to run while the learner's code does, so a wrapper
or an alias of them fails.
"""

import pytest
import torch
import torch.distributed as dist

import tpedu
from tests.exercises import parity_group, refusing
from tpedu.comm.tracer import CommTracer
from tpedu.course.grading import implementation
from tpedu.parallel import data_parallel

NAME = "l12_bucketed_allreduce"
TWINS = (
    data_parallel.assign_buckets,
    data_parallel.all_reduce_bucket,
    data_parallel.all_reduce_grads,
)


@refusing(*TWINS)
def test_worked_example_and_edge_cases():
    f = implementation(NAME).assign_buckets
    assert f([7, 3, 5, 2], 6) == [[3, 2], [1, 0]]
    assert f([4, 4, 4], 1) == [[2], [1], [0]]  # every tensor fills a bucket alone
    assert f([4, 4, 4], 100) == [[2, 1, 0]]  # one bucket for all
    assert f([1, 9, 2, 2, 2], 5) == [[4, 3, 2], [1], [0]]
    assert f([], 5) == []


@refusing(*TWINS)
def test_every_index_once_and_buckets_big_enough():
    f = implementation(NAME).assign_buckets
    g = torch.Generator().manual_seed(0)
    numels = torch.randint(1, 50, (23,), generator=g).tolist()
    for size in (1, 30, 77, 2000):
        buckets = f(numels, size)
        flat = [i for b in buckets for i in b]
        assert flat == list(reversed(range(23))), "indices must run from last to first, once"
        assert all(sum(numels[i] for i in b) >= size for b in buckets[:-1])
        assert all(sum(numels[i] for i in b[:-1]) < size for b in buckets), "bucket closed late"


@refusing(*TWINS)
def test_bad_bucket_size():
    with pytest.raises(ValueError, match="bucket_numel must be at least 1"):
        implementation(NAME).assign_buckets([3], 0)


def test_all_reduce_bucket_averages_with_one_all_reduce():
    shapes = [(3, 5), (7,), (2, 1, 4), ()]

    def data(rank):
        g = torch.Generator().manual_seed(rank + 1)
        return [torch.randint(-50, 50, s, generator=g).double() for s in shapes]

    @refusing(*TWINS)
    def worker():
        rank = dist.get_rank()
        grads = [x.to(tpedu.device()) for x in data(rank)]
        before = [x.clone() for x in grads]
        with CommTracer() as t:
            out = implementation(NAME).all_reduce_bucket(grads, None)
        unchanged = all(torch.equal(a, b) for a, b in zip(grads, before, strict=True))
        return out, t.count("all_reduce"), unchanged

    for n in (1, 2, 3):
        want = [sum(xs) / n for xs in zip(*(data(r) for r in range(n)), strict=True)]
        for out, calls, unchanged in tpedu.launch(worker, n, timeout=30):
            assert calls == 1, f"{calls} all-reduces: flatten the bucket into one buffer"
            assert unchanged, "the input tensors must not be modified"
            for o, w in zip(out, want, strict=True):
                assert o.shape == w.shape
                diff = (o - w).abs().max().item()
                assert diff <= 1e-15 * w.abs().max().item(), f"max |got - mean| = {diff:.2e}"


def test_all_reduce_bucket_averages_over_its_group_only():
    """On groups {0, 2} and {1, 3} of 4 ranks: the mean over the group's 2 members."""
    shapes = [(3, 5), (7,)]

    def data(rank):
        g = torch.Generator().manual_seed(rank + 1)
        return [torch.randint(-50, 50, s, generator=g).double() for s in shapes]

    @refusing(*TWINS)
    def worker():
        rank = dist.get_rank()
        group, _ = parity_group()
        grads = [x.to(tpedu.device()) for x in data(rank)]
        return implementation(NAME).all_reduce_bucket(grads, group)

    for rank, out in enumerate(tpedu.launch(worker, 4, timeout=30)):
        members = [rank % 2, rank % 2 + 2]
        want = [(a + b) / 2 for a, b in zip(*(data(q) for q in members), strict=True)]
        for o, w in zip(out, want, strict=True):
            assert o.shape == w.shape
            diff = (o.cpu() - w).abs().max().item()
            assert diff <= 1e-15 * w.abs().max().item(), (
                f"rank {rank}: max |got - mean over {members}| = {diff:.2e}"
            )
