"""tpedu.comm.ring: the send/recv ring all-reduce equals the library's all-reduce and moves 2(t-1)/t·n.

Two kinds of data. Integer-valued float64 (|values| < 100): every partial sum is an exact integer,
so any summation order gives the same bits and ring == library must hold exactly (0.0). Random
normal float64: the ring adds chunk k in the order k+1, k+2, ..., k while gloo uses its own order;
each order of t terms is off by at most (t-1)·u·Σ|x_i| (u = 2^-53), so the two differ by at most
2(t-1)·u·Σ|x_i| elementwise: that bound (with eps = 2u, a 2x margin) is the tolerance.
"""

import pytest
import torch
import torch.distributed as dist

import tpedu
from tpedu.comm.ring import ring_all_gather, ring_all_reduce, ring_reduce_scatter
from tpedu.comm.tracer import CommTracer
from tpedu.comm.volumes import ring_bytes

SHAPES = [(0,), (1,), (2,), (7,), (5, 3, 2), (13, 11)]
EPS = torch.finfo(torch.float64).eps


def data(rank: int, shape: tuple, integer: bool) -> torch.Tensor:
    """Rank `rank`'s input: different on every rank and reproducible anywhere."""
    g = torch.Generator().manual_seed(1000 * rank + sum(shape) * 7 + len(shape))
    if integer:
        return torch.randint(-99, 100, shape, generator=g).double()
    return torch.randn(shape, generator=g, dtype=torch.float64)


def _compare_worker(shapes: list[tuple]) -> list[str]:
    """For each shape and data kind: ring vs dist.all_reduce; returns failure messages."""
    rank, t = dist.get_rank(), dist.get_world_size()
    bad = []
    for shape in shapes:
        for integer in (True, False):
            x = data(rank, shape, integer).to(tpedu.device())
            ref = x.clone()
            dist.all_reduce(ref)
            scale = x.abs()
            dist.all_reduce(scale)
            out = ring_all_reduce(x)
            if out is not x:
                bad.append(f"{shape}: ring_all_reduce did not return its input (not in place)")
            diff = (x - ref).abs()
            tol = torch.zeros_like(scale) if integer else 2 * (t - 1) * EPS * scale
            if not (diff <= tol).all():  # NaN fails too
                bad.append(
                    f"{shape} integer={integer}: max |ring - library| = {diff.max().item():.3e}"
                )
        # A non-contiguous input (a transpose) must be reduced in place as well.
        if len(shape) == 2:
            base = data(rank, shape, True).to(tpedu.device())
            xt = base.t()
            ref = xt.clone()
            dist.all_reduce(ref)
            ring_all_reduce(xt)
            if not torch.equal(xt, ref):
                bad.append(
                    f"{shape} transposed: max |ring - library| = "
                    f"{(xt - ref).abs().max().item():.3e}"
                )
    return bad


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ring_matches_library_all_reduce(world_size: int) -> None:
    results = tpedu.launch(_compare_worker, world_size, SHAPES, timeout=30)
    for rank, bad in enumerate(results):
        assert not bad, f"rank {rank} of {world_size}: " + "; ".join(bad)


def _subgroup_worker() -> tuple[list[str], float]:
    rank = dist.get_rank()
    # Every rank creates every group, in the same order, even groups it is not in.
    odd, even = dist.new_group([1, 3]), dist.new_group([0, 2])
    members = [1, 3] if rank % 2 else [0, 2]
    group = odd if rank % 2 else even
    shape = (3, 5)
    x = data(rank, shape, False).to(tpedu.device())
    ring_all_reduce(x, group=group)
    # Expected: the sum over the group's members only, regenerated locally in the ring's order
    # for the 2-rank case (a + b == b + a exactly in IEEE arithmetic, so order does not matter).
    expected = data(members[0], shape, False) + data(members[1], shape, False)
    diff = (x.cpu() - expected).abs().max().item()
    world = data(rank, shape, False).to(tpedu.device())
    ring_all_reduce(world)  # the world ring still works after the subgroups were used
    return [] if diff == 0.0 else [f"max |ring - members' sum| = {diff:.3e}"], world.sum().item()


def test_ring_on_subgroups() -> None:
    results = tpedu.launch(_subgroup_worker, 4, timeout=30)
    for rank, (bad, _) in enumerate(results):
        assert not bad, f"rank {rank}: " + "; ".join(bad)
    world_sums = [s for _, s in results]
    assert all(s == world_sums[0] for s in world_sums), f"world ring disagrees: {world_sums}"


def _bytes_worker(numel: int) -> tuple[int, int, int, int]:
    x = torch.ones(numel, dtype=torch.float32, device=tpedu.device())
    with CommTracer() as tr:
        ring_all_reduce(x)
    assert torch.equal(x, torch.full_like(x, dist.get_world_size()))
    other = len(tr.records) - tr.count("send") - tr.count("recv")
    return tr.bytes("send"), tr.count("send"), tr.bytes("recv"), other


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_bytes_sent_match_ring_formula(world_size: int) -> None:
    t = world_size
    for numel in (24, 25, 26):  # 24 divides by 2, 3 and 4; 25 and 26 give uneven chunks
        results = tpedu.launch(_bytes_worker, t, numel, timeout=30)
        formula = ring_bytes("all_reduce", numel * 4, t)
        sent = [r[0] for r in results]
        assert all(r[3] == 0 for r in results), "the ring must use send/recv only"
        assert all(r[1] == 2 * (t - 1) for r in results), (
            f"sends per rank: {[r[1] for r in results]}"
        )
        # Every byte sent is received: the ring is closed.
        assert sum(sent) == sum(r[2] for r in results)
        # Over all ranks the total is exact whatever the rounding: t · 2(t-1)/t · n = 2(t-1)·n.
        assert sum(sent) == 2 * (t - 1) * numel * 4 == pytest.approx(t * formula), (sent, formula)
        if numel % t == 0:
            assert all(s == formula for s in sent), f"sent {sent}, formula {formula}"
        else:  # chunks differ by one element: each rank skips two chunks, so within 2 elements
            assert all(abs(s - formula) < 2 * 4 for s in sent), f"sent {sent}, formula {formula}"


def _phases_worker() -> list[str]:
    rank, t = dist.get_rank(), dist.get_world_size()
    n = 11  # 3 ranks: chunks of 4, 4, 3
    bad = []
    chunks = list(data(rank, (n,), True).tensor_split(t))
    ring_reduce_scatter(chunks)
    mine = sum(data(r, (n,), True) for r in range(t)).tensor_split(t)[rank]
    if not torch.equal(chunks[rank], mine):
        bad.append(f"reduce-scatter: max diff {(chunks[rank] - mine).abs().max().item():.3e}")
    pieces = [
        torch.full((k.numel(),), float("nan"), dtype=torch.float64)
        for k in data(0, (n,), True).tensor_split(t)
    ]
    pieces[rank].copy_(data(rank, (n,), True).tensor_split(t)[rank])
    ring_all_gather(pieces)
    want = torch.cat([data(r, (n,), True).tensor_split(t)[r] for r in range(t)])
    if not torch.equal(torch.cat(pieces), want):
        bad.append("all-gather: chunks differ from every rank's own chunk")
    try:
        ring_all_gather(pieces[:-1])
        bad.append("a wrong number of chunks was accepted")
    except ValueError as e:
        if "chunks for a group of" not in str(e):
            bad.append(f"unclear error: {e}")
    return bad


def test_reduce_scatter_and_all_gather_phases() -> None:
    for rank, bad in enumerate(tpedu.launch(_phases_worker, 3, timeout=30)):
        assert not bad, f"rank {rank}: " + "; ".join(bad)


def _outsider_worker() -> str:
    group = dist.new_group([0])
    if dist.get_rank() == 0:
        return "member"
    try:
        ring_all_reduce(torch.ones(3), group=group)
    except ValueError as e:
        return str(e)
    return "no error"


def test_non_member_gets_clear_error() -> None:
    _, message = tpedu.launch(_outsider_worker, 2, timeout=30)
    assert "not a member of the group" in message
