"""Grades exercises/l04_parallel_linear.py: column- and row-parallel linear forward (and the
backward they get from the conjugate operators) against one dense nn.Linear.

Tolerances (float64, values O(1-10)): 1e-12 absolute. A parallel layer computes the same dot
products as the dense one, but CPU BLAS picks other kernels for other widths (a few ulps), and
the row layer's partial sums are added across ranks in another order (~1e-14). Any real mistake
(wrong shard, missing sum, bias counted t times) is O(1).

tpedu's own layers (tpedu.tp.layers, tpedu.tp.overlap) refuse to run while the learner's code
does, so a wrapper or an alias of them fails.
"""

import torch
import torch.distributed as dist
from torch import nn

import tpedu
from tests.exercises import parity_group, refusing
from tests.helpers import calls, randn
from tpedu.comm.tracer import CommTracer
from tpedu.course.grading import implementation
from tpedu.tp import layers, overlap

NAME = "l04_parallel_linear"
TWINS = (
    layers.column_parallel_linear,
    layers.row_parallel_linear,
    layers.ColumnParallelLinear.forward,
    layers.RowParallelLinear.forward,
    overlap.LinearWithAsyncGradAllreduce.forward,  # lesson 15's column layer
    overlap.LinearWithAsyncGradAllreduce.backward,
)
TOL = 1e-12
BATCH = (3, 5)
N_IN, N_OUT = 7, 12  # column: 7 -> 12 (12 splits over 2, 3, 4); row: 12 -> 7


def dense(n_in: int, n_out: int, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(n_in, n_out, dtype=torch.float64).to(tpedu.device())


def _cmp(bad: list, what: str, got, want) -> None:
    if got is None:
        bad.append(f"{what}: got None")
    elif got.shape != want.shape:
        bad.append(f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    elif not (d := (got - want).abs().max().item()) <= TOL:  # NaN fails too
        bad.append(f"{what}: max |difference| = {d:.3e}")


def _check(worker, world_sizes) -> None:
    for t in world_sizes:
        for rank, bad in enumerate(tpedu.launch(worker, t, timeout=30)):
            assert not bad, f"world size {t}, rank {rank}: " + "; ".join(bad)


def _col(r: int, t: int, a: torch.Tensor, dim: int) -> torch.Tensor:
    n = a.shape[dim] // t
    return a.narrow(dim, r * n, n)


@refusing(*TWINS)
def _column_forward_worker() -> list[str]:
    m = implementation(NAME)
    r, t = dist.get_rank(), dist.get_world_size()
    lin, x, bad = dense(N_IN, N_OUT, 0), randn(1, (*BATCH, N_IN)), []
    with torch.no_grad():
        want = lin(x)
        y = m.column_parallel_linear(x, _col(r, t, lin.weight, 0), _col(r, t, lin.bias, 0))
        _cmp(bad, "output (with bias)", y, _col(r, t, want, -1))
        y = m.column_parallel_linear(x, _col(r, t, lin.weight, 0), None)
        _cmp(bad, "output (bias None)", y, _col(r, t, want - lin.bias, -1))
    return bad


def test_column_forward() -> None:
    """Rank r's output is columns [r·out/t, (r+1)·out/t) of the dense output, with and without bias."""
    _check(_column_forward_worker, (3,))


@refusing(*TWINS)
def _column_backward_worker() -> list[str]:
    m = implementation(NAME)
    r, t = dist.get_rank(), dist.get_world_size()
    lin, x, g, bad = dense(N_IN, N_OUT, 2), randn(3, (*BATCH, N_IN)), randn(4, (*BATCH, N_OUT)), []
    xd = x.clone().requires_grad_()
    (lin(xd) * g).sum().backward()
    xp = x.clone().requires_grad_()
    w = _col(r, t, lin.weight.detach(), 0).clone().requires_grad_()
    b = _col(r, t, lin.bias.detach(), 0).clone().requires_grad_()
    with CommTracer() as tr:
        y = m.column_parallel_linear(xp, w, b)
        fwd = calls(tr)
        (y * _col(r, t, g, -1)).sum().backward()
    _cmp(bad, "dL/dx", xp.grad, xd.grad)
    _cmp(bad, "dL/dweight shard", w.grad, _col(r, t, lin.weight.grad, 0))
    _cmp(bad, "dL/dbias shard", b.grad, _col(r, t, lin.bias.grad, 0))
    if fwd:
        bad.append(f"forward must not communicate, ran {fwd}")
    if calls(tr)[len(fwd) :] != [("all_reduce", "backward", x.numel())]:
        bad.append(f"backward must run 1 all-reduce of x's size, ran {calls(tr)}")
    return bad


def test_column_backward_and_communication() -> None:
    """Gradients equal the dense ones; forward 0 collectives, backward 1 all-reduce of x."""
    _check(_column_backward_worker, (2,))


@refusing(*TWINS)
def _column_gather_worker() -> list[str]:
    m = implementation(NAME)
    r, t = dist.get_rank(), dist.get_world_size()
    lin, x, bad = dense(N_IN, N_OUT, 5), randn(6, (*BATCH, N_IN)), []
    with torch.no_grad(), CommTracer() as tr:
        y = m.column_parallel_linear(
            x, _col(r, t, lin.weight, 0), _col(r, t, lin.bias, 0), gather_output=True
        )
    _cmp(bad, "gathered output", y, lin(x).detach())
    if calls(tr) != [("all_gather", "forward", x.shape[0] * x.shape[1] * N_OUT)]:
        bad.append(f"gather_output must run 1 all-gather of the output, ran {calls(tr)}")
    return bad


def test_column_gather_output() -> None:
    """gather_output=True gives the full dense output (rank order) with 1 all-gather."""
    _check(_column_gather_worker, (4,))


@refusing(*TWINS)
def _row_forward_worker() -> list[str]:
    m = implementation(NAME)
    r, t = dist.get_rank(), dist.get_world_size()
    lin, x, bad = dense(N_OUT, N_IN, 7), randn(8, (*BATCH, N_OUT)), []
    with torch.no_grad():
        lin.bias.mul_(10)  # a large bias: counted t times instead of once is obvious
        with CommTracer() as tr:
            y = m.row_parallel_linear(_col(r, t, x, -1), _col(r, t, lin.weight, 1), lin.bias)
        _cmp(bad, "output", y, lin(x))
        y = m.row_parallel_linear(_col(r, t, x, -1), _col(r, t, lin.weight, 1), None)
        _cmp(bad, "output (bias None)", y, lin(x) - lin.bias)
    if calls(tr) != [("all_reduce", "forward", x.shape[0] * x.shape[1] * N_IN)]:
        bad.append(f"forward must run 1 all-reduce of the output's size, ran {calls(tr)}")
    return bad


def test_row_forward_bias_added_once() -> None:
    """The partial products are summed over ranks (1 all-reduce), then the bias added once."""
    _check(_row_forward_worker, (3,))


@refusing(*TWINS)
def _row_backward_worker() -> list[str]:
    m = implementation(NAME)
    r, t = dist.get_rank(), dist.get_world_size()
    lin, x, g, bad = (
        dense(N_OUT, N_IN, 9),
        randn(10, (*BATCH, N_OUT)),
        randn(11, (*BATCH, N_IN)),
        [],
    )
    xd = x.clone().requires_grad_()
    (lin(xd) * g).sum().backward()
    xp = _col(r, t, x, -1).clone().requires_grad_()
    w = _col(r, t, lin.weight.detach(), 1).clone().requires_grad_()
    b = lin.bias.detach().clone().requires_grad_()
    y = m.row_parallel_linear(xp, w, b)
    with CommTracer() as tr:
        (y * g).sum().backward()
    _cmp(bad, "dL/dx shard", xp.grad, _col(r, t, xd.grad, -1))
    _cmp(bad, "dL/dweight shard", w.grad, _col(r, t, lin.weight.grad, 1))
    _cmp(bad, "dL/dbias", b.grad, lin.bias.grad)
    if tr.records:
        bad.append(f"backward must not communicate, ran {calls(tr)}")
    return bad


def test_row_backward_no_communication() -> None:
    """Gradients of the input shard, weight shard and full bias equal the dense ones; 0 collectives."""
    _check(_row_backward_worker, (4,))


@refusing(*TWINS)
def _group_worker() -> list[str]:
    m = implementation(NAME)
    rank = dist.get_rank()
    # Each group gets its own layers and input, so a sum over all 4 ranks mixes in the other
    # group's numbers.
    group, _ = parity_group()
    k = rank % 2
    r, t = dist.get_rank(group), dist.get_world_size(group)
    bad = []
    lin, x, g = (
        dense(N_IN, N_OUT, 20 + k),
        randn(21 + k, (*BATCH, N_IN)),
        randn(22 + k, (*BATCH, N_OUT)),
    )
    xd = x.clone().requires_grad_()
    (lin(xd) * g).sum().backward()
    xp = x.clone().requires_grad_()
    w, b = _col(r, t, lin.weight.detach(), 0), _col(r, t, lin.bias.detach(), 0)
    (m.column_parallel_linear(xp, w, b, group) * _col(r, t, g, -1)).sum().backward()
    _cmp(bad, "column: dL/dx summed over the group", xp.grad, xd.grad)
    with torch.no_grad():
        y = m.column_parallel_linear(x, w, b, group, gather_output=True)
        _cmp(bad, "column: output gathered over the group", y, lin(x))
        lin, x = dense(N_OUT, N_IN, 23 + k), randn(24 + k, (*BATCH, N_OUT))
        y = m.row_parallel_linear(_col(r, t, x, -1), _col(r, t, lin.weight, 1), lin.bias, group)
        _cmp(bad, "row: output summed over the group", y, lin(x))
    return bad


def test_group_argument() -> None:
    """On groups {0, 2} and {1, 3} of 4 ranks (tp = 2 each) every collective stays in the group."""
    _check(_group_worker, (4,))
