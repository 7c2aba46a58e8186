"""Grades exercises/l02_ring_allreduce.py: the ring reduce-scatter, all-gather and all-reduce.

Exactness: integer-valued float64 inputs make every partial sum an exact integer, so the result
must equal the reference bit for bit (0.0) whatever order the ring adds in. Random normal float64
is compared with the library's all-reduce within 2(t-1)·eps·Σ|x_i|: each of the two summation
orders of t terms is off by at most (t-1)·u·Σ|x_i| (u = eps/2), so this bound has a 2x margin.
tpedu's own ring (tpedu.comm.ring) refuses to run while the learner's does, so a wrapper or an
alias of it fails.
"""

import torch
import torch.distributed as dist

import tpedu
from tests.exercises import parity_group, refusing
from tpedu.comm import ring
from tpedu.comm.tracer import CommTracer
from tpedu.comm.volumes import ring_bytes
from tpedu.course.grading import implementation

NAME = "l02_ring_allreduce"
EPS = torch.finfo(torch.float64).eps
TWINS = (ring.ring_reduce_scatter, ring.ring_all_gather, ring.ring_all_reduce, ring._step)


def data(rank: int, shape: tuple, integer: bool = True) -> torch.Tensor:
    """Rank `rank`'s input: different on every rank and reproducible on any rank."""
    g = torch.Generator().manual_seed(31 * rank + 7 * sum(shape) + len(shape))
    if integer:
        return torch.randint(-99, 100, shape, generator=g).double()
    return torch.randn(shape, generator=g, dtype=torch.float64)


def _check_all(worker, world_sizes, *args) -> None:
    for t in world_sizes:
        results = tpedu.launch(worker, t, *args, timeout=30)  # a deadlocked ring fails in 30 s
        for rank, bad in enumerate(results):
            assert not bad, f"world size {t}, rank {rank}: " + "; ".join(bad)


@refusing(*TWINS)
def _reduce_scatter_worker() -> list[str]:
    m = implementation(NAME)
    rank, t = dist.get_rank(), dist.get_world_size()
    bad = []
    for n in (11, 4 * t):  # 11 gives uneven chunks on 2, 3 and 4 ranks
        chunks = list(data(rank, (n,)).to(tpedu.device()).tensor_split(t))
        m.ring_reduce_scatter(chunks)
        want = sum(data(r, (n,)) for r in range(t)).tensor_split(t)[rank]
        got = chunks[rank].cpu()
        if got.shape != want.shape or not torch.equal(got, want):
            diff = (got - want).abs().max().item() if got.shape == want.shape else float("nan")
            bad.append(
                f"n={n}: chunks[{rank}] is not the sum over ranks of chunk {rank}: "
                f"max |difference| = {diff:.3e}"
            )
    return bad


def test_ring_reduce_scatter() -> None:
    """After the reduce-scatter phase rank r holds chunk r summed over all ranks."""
    _check_all(_reduce_scatter_worker, (2, 3, 4))


@refusing(*TWINS)
def _all_gather_worker() -> list[str]:
    m = implementation(NAME)
    rank, t = dist.get_rank(), dist.get_world_size()
    n = 11
    sizes = [c.numel() for c in torch.empty(n).tensor_split(t)]
    # Only our own chunk is set; the rest is NaN, so a chunk never received shows up.
    chunks = [
        torch.full((k,), float("nan"), dtype=torch.float64, device=tpedu.device()) for k in sizes
    ]
    chunks[rank].copy_(data(rank, (n,)).tensor_split(t)[rank])
    m.ring_all_gather(chunks)
    want = torch.cat([data(r, (n,)).tensor_split(t)[r] for r in range(t)])
    got = torch.cat([c.cpu() for c in chunks])
    if torch.equal(got, want):
        return []
    wrong = [r for r in range(t) if not torch.equal(chunks[r].cpu(), want.tensor_split(t)[r])]
    return [
        f"chunks {wrong} differ from the owning ranks' chunks: "
        f"max |difference| = {(got - want).abs().nan_to_num(float('inf')).max().item():.3e}"
    ]


def test_ring_all_gather() -> None:
    """After the all-gather phase every rank holds chunk r of rank r, for every r."""
    _check_all(_all_gather_worker, (2, 3, 4))


@refusing(*TWINS)
def _all_reduce_worker() -> list[str]:
    m = implementation(NAME)
    rank, t = dist.get_rank(), dist.get_world_size()
    bad = []
    for shape in [(1,), (3,), (7,), (5, 3, 2), (13, 11)]:
        for integer in (True, False):
            x = data(rank, shape, integer).to(tpedu.device())
            ref, scale = x.clone(), x.abs()
            dist.all_reduce(ref)
            dist.all_reduce(scale)
            out = m.ring_all_reduce(x)
            if out is not x:
                bad.append(f"{shape}: must reduce in place and return x")
            tol = torch.zeros_like(scale) if integer else 2 * (t - 1) * EPS * scale
            diff = (x - ref).abs()
            if not (diff <= tol).all():  # NaN fails too
                bad.append(
                    f"shape {shape}, integer={integer}: max |ring - dist.all_reduce| = "
                    f"{diff.max().item():.3e}"
                )
    xt = data(rank, (6, 5)).to(tpedu.device()).t()  # not contiguous
    ref = xt.clone()
    dist.all_reduce(ref)
    m.ring_all_reduce(xt)
    if not torch.equal(xt, ref):
        bad.append(f"transposed input: max |difference| = {(xt - ref).abs().max().item():.3e}")
    return bad


def test_ring_all_reduce_matches_library() -> None:
    """ring_all_reduce == dist.all_reduce on 1-4 ranks, uneven sizes, any shape, in place."""
    _check_all(_all_reduce_worker, (1, 2, 3, 4))


@refusing(*TWINS)
def _subgroup_worker() -> list[str]:
    m = implementation(NAME)
    rank = dist.get_rank()
    group, members = parity_group()
    x = data(rank, (4, 3)).to(tpedu.device())
    m.ring_all_reduce(x, group=group)
    want = data(members[0], (4, 3)) + data(members[1], (4, 3))
    if torch.equal(x.cpu(), want):
        return []
    return [
        f"on group {members}: max |ring - sum over the group| = "
        f"{(x.cpu() - want).abs().max().item():.3e} (did you send to group-local ranks? "
        "send/recv need dist.get_global_rank(group, r))"
    ]


def test_ring_all_reduce_on_subgroup() -> None:
    """On groups {0, 2} and {1, 3} of 4 ranks each group sums only its own members."""
    _check_all(_subgroup_worker, (4,))


@refusing(*TWINS)
def _volume_worker(numels: list[int]) -> tuple[list[str], list[int]]:
    m = implementation(NAME)
    t = dist.get_world_size()
    bad, sent = [], []
    for numel in numels:
        x = torch.ones(numel, dtype=torch.float32, device=tpedu.device())
        with CommTracer() as tr:
            m.ring_all_reduce(x)
        others = sorted({r.op for r in tr.records} - {"send", "recv"})
        if others:
            bad.append(f"uses {others}: only send/recv (isend/irecv) are allowed")
        if not torch.equal(x, torch.full_like(x, t)):
            bad.append(f"n={numel}: wrong sum")
        sent.append(tr.bytes("send"))
    return bad, sent


def test_ring_all_reduce_sends_ring_volume() -> None:
    """Each rank sends 2(t-1)/t·n (exact when t divides n); all ranks together 2(t-1)·n."""
    numels = [60, 62]  # 60 divides by 2, 3, 4; 62 does not by 3 or 4
    for t in (2, 3, 4):
        results = tpedu.launch(_volume_worker, t, numels, timeout=30)
        for rank, (bad, _) in enumerate(results):
            assert not bad, f"world size {t}, rank {rank}: " + "; ".join(bad)
        for i, numel in enumerate(numels):
            sent = [s[i] for _, s in results]
            formula = ring_bytes("all_reduce", numel * 4, t)
            assert sum(sent) == 2 * (t - 1) * numel * 4, (
                f"t={t}, n={numel}: ranks sent {sent} bytes, {sum(sent)} in all; "
                f"the ring sends 2(t-1)·n·4 = {2 * (t - 1) * numel * 4} bytes in all"
            )
            assert all(abs(s - formula) < 2 * 4 for s in sent), (
                f"t={t}, n={numel}: ranks sent {sent} bytes, formula 2(t-1)/t·n·4 = {formula:g}"
            )
