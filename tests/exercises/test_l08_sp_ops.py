"""Grades exercises/l08_sp_ops.py: the sequence-parallel operators and the gradient all-reduce.

Exactness: inputs and gradients are random integers stored as float64, so every sum is exact in
any order: results must equal the expected values bit for bit (0.0). Shapes are uneven and the
ranks' tensors differ, so a concatenation in the wrong order or a missing sum cannot pass.

tpedu's own operators (tpedu.tp.sequence_parallel) refuse to run while the learner's code does,
so a wrapper or an alias of them fails.
"""

import torch
import torch.distributed as dist

import tpedu
from tests.exercises import parity_group, refusing
from tests.helpers import calls
from tpedu.comm.tracer import CommTracer
from tpedu.course.grading import implementation
from tpedu.tp import sequence_parallel as sp

NAME = "l08_sp_ops"
TWINS = (
    sp.ScatterToSPRegion.forward,
    sp.ScatterToSPRegion.backward,
    sp.GatherFromSPRegion.forward,
    sp.GatherFromSPRegion.backward,
    sp.ReduceScatterToSPRegion.forward,
    sp.ReduceScatterToSPRegion.backward,
    sp.scatter_to_sp_region,
    sp.gather_from_sp_region,
    sp.reduce_scatter_to_sp_region,
    sp.all_reduce_sequence_parallel_grads,
)
B, N, H = 2, 3, 5  # [b, s/t, H] per rank: s = 3t


def ints(seed: int, shape: tuple) -> torch.Tensor:
    """Random integers in [-9, 9] as float64; any rank can rebuild any other rank's tensor."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-9, 10, shape, generator=g).double().to(tpedu.device())


def _diff(name: str, got: torch.Tensor | None, want: torch.Tensor) -> list[str]:
    if got is None:
        return [f"{name}: got None"]
    if got.shape != want.shape:
        return [f"{name}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"]
    d = (got - want).abs().max().item()
    return [f"{name}: max |difference| = {d:.3e}"] if d != 0 else []


def _check(worker, world_sizes=(2, 3)) -> None:
    for t in world_sizes:
        for rank, bad in enumerate(tpedu.launch(worker, t, timeout=30)):
            assert not bad, f"world size {t}, rank {rank}: " + "; ".join(bad)


@refusing(*TWINS)
def _scatter_worker() -> list[str]:
    m = implementation(NAME)
    t, r = dist.get_world_size(), dist.get_rank()
    x = ints(0, (B, N * t, H)).requires_grad_()  # the same on every rank
    grads = [ints(10 + i, (B, N, H)) for i in range(t)]  # rank i's gradient
    with CommTracer() as trace:
        y = m.scatter_to_sp_region(x, None)
        y.backward(grads[r])
    bad = _diff("forward", y, x.detach()[:, r * N : (r + 1) * N])
    bad += _diff("backward", x.grad, torch.cat(grads, dim=1))
    if calls(trace) != [("all_gather", "backward", B * N * t * H)]:
        bad.append(f"expected only 1 all-gather in backward, traced {calls(trace)}")
    return bad


def test_scatter_keeps_own_chunk_and_gathers_grads() -> None:
    _check(_scatter_worker)


@refusing(*TWINS)
def _gather_worker() -> list[str]:
    m = implementation(NAME)
    t, r = dist.get_world_size(), dist.get_rank()
    shards = [ints(20 + i, (B, N, H)) for i in range(t)]
    grads = [ints(30 + i, (B, N * t, H)) for i in range(t)]  # each rank's partial gradient
    bad = []
    for tp_grad in (True, False):
        x = shards[r].clone().requires_grad_()
        with CommTracer() as trace:
            y = m.gather_from_sp_region(x, None, 1, tp_grad)
            y.backward(grads[r])
        bad += _diff("forward", y, torch.cat(shards, dim=1))
        own = slice(r * N, (r + 1) * N)
        want = sum(grads)[:, own] if tp_grad else grads[r][:, own]
        bad += _diff(f"backward (tensor_parallel_output_grad={tp_grad})", x.grad, want)
        expected = [("all_gather", "forward", B * N * t * H)]
        expected += [("reduce_scatter", "backward", B * N * t * H)] if tp_grad else []
        if calls(trace) != expected:
            bad.append(
                f"tensor_parallel_output_grad={tp_grad}: expected {expected}, traced {calls(trace)}"
            )
    return bad


def test_gather_all_gathers_and_reduce_scatters_grads() -> None:
    _check(_gather_worker)


@refusing(*TWINS)
def _reduce_scatter_worker() -> list[str]:
    m = implementation(NAME)
    t, r = dist.get_world_size(), dist.get_rank()
    partial = [ints(40 + i, (B, N * t, H)) for i in range(t)]
    grads = [ints(50 + i, (B, N, H)) for i in range(t)]
    x = partial[r].clone().requires_grad_()
    with CommTracer() as trace:
        y = m.reduce_scatter_to_sp_region(x, None)
        y.backward(grads[r])
    bad = _diff("forward", y, sum(partial)[:, r * N : (r + 1) * N])
    bad += _diff("backward", x.grad, torch.cat(grads, dim=1))
    expected = [
        ("reduce_scatter", "forward", B * N * t * H),
        ("all_gather", "backward", B * N * t * H),
    ]
    if calls(trace) != expected:
        bad.append(f"expected {expected}, traced {calls(trace)}")
    return bad


def test_reduce_scatter_sums_and_shards() -> None:
    _check(_reduce_scatter_worker)


@refusing(*TWINS)
def _dim_worker() -> list[str]:
    """The sequence dimension is an argument: dim 0 of a [s, b·H] tensor, dim -1 of [b, H, s],
    forward and backward (dim -1 of a 3-D tensor is not the default dim 1)."""
    m = implementation(NAME)
    t, r = dist.get_world_size(), dist.get_rank()
    own = slice(r * N, (r + 1) * N)
    shards = [ints(60 + i, (N, 4)) for i in range(t)]
    grads = [ints(65 + i, (N * t, 4)) for i in range(t)]  # each rank's partial gradient
    x = shards[r].clone().requires_grad_()
    y = m.gather_from_sp_region(x, None, 0)
    y.backward(grads[r])
    bad = _diff("gather dim=0", y, torch.cat(shards, dim=0))
    bad += _diff("gather dim=0 backward (reduce-scatter dim 0)", x.grad, sum(grads)[own])
    partial = [ints(70 + i, (2, 3, N * t)) for i in range(t)]
    grads = [ints(75 + i, (2, 3, N)) for i in range(t)]
    x = partial[r].clone().requires_grad_()
    z = m.reduce_scatter_to_sp_region(x, None, -1)
    z.backward(grads[r])
    bad += _diff("reduce_scatter dim=-1", z, sum(partial)[..., own])
    bad += _diff(
        "reduce_scatter dim=-1 backward (all-gather dim -1)", x.grad, torch.cat(grads, dim=-1)
    )
    x = partial[0].clone().requires_grad_()
    w = m.scatter_to_sp_region(x, None, -1)
    w.backward(grads[r])
    bad += _diff("scatter dim=-1", w, partial[0][..., own])
    return bad + _diff(
        "scatter dim=-1 backward (all-gather dim -1)", x.grad, torch.cat(grads, dim=-1)
    )


def test_any_sequence_dimension() -> None:
    _check(_dim_worker, (2, 3, 4))


@refusing(*TWINS)
def _group_worker() -> list[str]:
    m = implementation(NAME)
    rank = dist.get_rank()
    group, members = parity_group()
    r, t = dist.get_rank(group), dist.get_world_size(group)
    n = 4 * N // t  # s = 4N divides by 4 too: a learner who ignores group gets wrong values
    own = slice(r * n, (r + 1) * n)
    x = ints(0, (B, n * t, H))  # the same on every rank
    bad = _diff(
        "scatter (own chunk by group rank)",
        m.scatter_to_sp_region(x, group),
        x[:, own],
    )
    shards = {q: ints(90 + q, (B, n, H)) for q in members}
    grads = {q: ints(100 + q, (B, n * t, H)) for q in members}
    x = shards[rank].clone().requires_grad_()
    y = m.gather_from_sp_region(x, group)
    bad += _diff("gather over the group", y, torch.cat([shards[q] for q in members], dim=1))
    if y.shape == grads[rank].shape:  # else backward() would raise before any message
        y.backward(grads[rank])
        bad += _diff(
            "gather backward (reduce-scatter over the group)", x.grad, sum(grads.values())[:, own]
        )
    partial = {q: ints(110 + q, (B, n * t, H)) for q in members}
    z = m.reduce_scatter_to_sp_region(partial[rank], group)
    bad += _diff("reduce_scatter over the group", z, sum(partial.values())[:, own])
    p = torch.nn.Parameter(torch.zeros(5, dtype=torch.float64))
    p.grad = ints(120 + rank, (5,))
    m.all_reduce_sequence_parallel_grads([p], group)
    return bad + _diff(
        "gradient all-reduce over the group", p.grad, sum(ints(120 + q, (5,)) for q in members)
    )


def test_group_argument() -> None:
    """On groups {0, 2} and {1, 3} of 4 ranks every operator shards and sums within its group."""
    _check(_group_worker, (4,))


@refusing(*TWINS)
def _grads_worker() -> list[str]:
    m = implementation(NAME)
    t, r = dist.get_world_size(), dist.get_rank()
    shapes = [(5,), (3, 2), (4,)]
    params = [torch.nn.Parameter(torch.zeros(s, dtype=torch.float64)) for s in shapes]
    for i, p in enumerate(params[:2]):
        p.grad = ints(80 + 10 * r + i, shapes[i])  # rank-specific partial gradients
    with CommTracer() as trace:
        m.all_reduce_sequence_parallel_grads(params, None)
    bad = []
    for i, p in enumerate(params[:2]):
        want = sum(ints(80 + 10 * k + i, shapes[i]) for k in range(t))
        bad += _diff(f"param {i} grad", p.grad, want)
    if params[2].grad is not None:
        bad.append("a parameter without a gradient must stay without one")
    if calls(trace) != [("all_reduce", "forward", 11)]:
        bad.append(f"expected ONE all-reduce of 5 + 6 elements, traced {calls(trace)}")
    return bad


def test_sequence_parallel_grads_are_summed_in_one_all_reduce() -> None:
    _check(_grads_worker)
