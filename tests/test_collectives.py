"""Every traced collective against the result computed locally from all ranks' inputs, at world
sizes 1-4 with uneven shapes; and the tracer's counts, bytes and phases."""

import pytest
import torch
import torch.distributed as dist

from tpedu import launch
from tpedu.comm import collectives as C
from tpedu.comm.tracer import CommTracer, phase


def rank_input(rank, shape):
    """A different, reproducible, non-symmetric tensor on each rank (float64: exact sums)."""
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def run_collectives(shape):
    rank, t = dist.get_rank(), dist.get_world_size()
    x = rank_input(rank, shape)
    with CommTracer() as trace:
        reduced = C.all_reduce(x.clone())
        gathered = [C.all_gather(x, dim=d) for d in range(len(shape))]
        # chunk j of each input is x + 10·j: a rank that keeps or sends the wrong chunk shows
        big = torch.cat([x + 10 * j for j in range(t)], dim=1)  # dim 1 divisible by t
        scattered = C.reduce_scatter(big, dim=1)
        b = C.broadcast(x.clone(), src=t - 1)
        a2a = C.all_to_all(torch.cat([x + 10 * j for j in range(t)], dim=0) + 100 * rank)
    return reduced, gathered, scattered, b, a2a, trace.records


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_collectives_match_their_definitions(world_size):
    shape = (3, 5, 2)
    out = launch(run_collectives, world_size, shape)
    xs = [rank_input(r, shape) for r in range(world_size)]
    total = sum(xs[1:], xs[0].clone())
    for rank, (reduced, gathered, scattered, b, a2a, records) in enumerate(out):
        # All-reduce sums in a backend-defined order: float64 rounding at most a few ulps.
        torch.testing.assert_close(reduced, total, rtol=1e-14, atol=1e-14)
        for d, g in enumerate(gathered):
            assert torch.equal(g, torch.cat(xs, dim=d)), f"all_gather dim {d}"
        # rank r keeps chunk r summed over the t ranks: sum_k (x_k + 10·r)
        expected = sum(xs[k] + 10 * rank for k in range(world_size))
        torch.testing.assert_close(scattered, expected, rtol=1e-14, atol=1e-14)
        assert torch.equal(b, xs[-1])
        # rank j sends its chunk i, x_j + 10·i + 100·j, to rank i; rank i stacks them in rank order
        want = torch.cat([xs[j] + 10 * rank + 100 * j for j in range(world_size)], dim=0)
        assert torch.equal(a2a, want)
        ops = [r.op for r in records]
        assert ops == ["all_reduce"] + ["all_gather"] * 3 + [
            "reduce_scatter",
            "broadcast",
            "all_to_all",
        ]
        n = xs[0].numel()
        nt = n * world_size  # gathered output, full scatter input, all-to-all input
        assert [r.numel for r in records] == [n, nt, nt, nt, nt, n, nt]
        assert all(r.bytes == 8 * r.numel and r.group == "world" for r in records)
        assert all(r.phase == "forward" for r in records)


class AllReduceInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return C.all_reduce(grad.clone())


def traced_phases():
    tp = C.name_group(dist.new_group([0, 1]), "tp")
    dist.new_group([2, 3])  # every rank creates every group, in the same order
    x = torch.ones(4, 3, requires_grad=True)
    with CommTracer() as trace:
        y = AllReduceInBackward.apply(x)
        C.all_reduce(torch.ones(2))
        y.sum().backward()
        with phase("optimizer"):
            C.all_reduce(torch.ones(5))
        if dist.get_rank() < 2:
            C.all_gather(torch.ones(3, 2), group=tp)
    return trace.summary(), trace.table(), x.grad


def test_tracer_phases_and_group_names():
    out = launch(traced_phases, 4)
    summary, table, grad = out[0]
    assert summary == {
        ("world", "all_reduce", "forward"): (1, 2, 8),
        ("world", "all_reduce", "backward"): (1, 12, 48),
        ("world", "all_reduce", "optimizer"): (1, 5, 20),
        ("tp", "all_gather", "forward"): (1, 12, 48),
    }
    assert torch.equal(grad, torch.full((4, 3), 4.0))
    assert "tp       all_gather      forward       1           12           48" in table
    assert ("tp", "all_gather", "forward") not in out[3][0]


def scatter_uneven():
    C.reduce_scatter(torch.ones(2, 5), dim=1)


def test_reduce_scatter_refuses_an_indivisible_dimension():
    from tpedu import RankError

    with pytest.raises(RankError, match="size 5, not divisible by the group size 2"):
        launch(scatter_uneven, 2)


def send_recv_ring():
    rank, t = dist.get_rank(), dist.get_world_size()
    x = torch.full((3,), float(rank))
    buf = torch.empty(3)
    with CommTracer() as trace:
        if rank % 2 == 0:  # even ranks send first, odd ranks receive first: no deadlock
            C.send(x, (rank + 1) % t)
            C.recv(buf, (rank - 1) % t)
        else:
            C.recv(buf, (rank - 1) % t)
            C.send(x, (rank + 1) % t)
    return buf, trace.wire_bytes(op="send")


def test_send_recv_and_wire_bytes():
    for rank, (buf, sent) in enumerate(launch(send_recv_ring, 4)):
        assert torch.equal(buf, torch.full((3,), float((rank - 1) % 4)))
        assert sent == 12
