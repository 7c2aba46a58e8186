"""Grades exercises/l03_conjugate_ops.py: f (CopyToTPRegion) and f̄ (ReduceFromTPRegion).

Exactness: inputs and gradients are random integers stored as float64, so every sum is exact in
any order: results must equal the expected values bit for bit (0.0).

tpedu's own f and f̄ (tpedu.tp.operators) refuse to run while the learner's code does, so a
wrapper or an alias of them fails.
"""

import torch
import torch.distributed as dist

import tpedu
from tests.exercises import parity_group, refusing
from tests.helpers import calls
from tpedu.comm.tracer import CommTracer
from tpedu.course.grading import implementation
from tpedu.tp import operators

NAME = "l03_conjugate_ops"
TWINS = (
    operators.CopyToTPRegion.forward,
    operators.CopyToTPRegion.backward,
    operators.ReduceFromTPRegion.forward,
    operators.ReduceFromTPRegion.backward,
)
SHAPE = (3, 2, 5)  # uneven


def ints(seed: int, shape: tuple = SHAPE) -> torch.Tensor:
    """Random integers in [-9, 9] as float64; any rank can rebuild any other rank's tensor."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-9, 10, shape, generator=g).double().to(tpedu.device())


def _diff(got: torch.Tensor, want: torch.Tensor) -> str:
    if got is None:
        return "got None"
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    return f"max |difference| = {(got - want).abs().max().item():.3e}"


def _check(worker, world_sizes) -> None:
    for t in world_sizes:
        for rank, bad in enumerate(tpedu.launch(worker, t, timeout=30)):
            assert not bad, f"world size {t}, rank {rank}: " + "; ".join(bad)


@refusing(*TWINS)
def _structure_worker() -> list[str]:
    m = implementation(NAME)
    bad = []
    for cls in (m.CopyToTPRegion, m.ReduceFromTPRegion):
        if not issubclass(cls, torch.autograd.Function):
            bad.append(f"{cls.__name__} must subclass torch.autograd.Function")
    x = ints(0).requires_grad_()
    m.CopyToTPRegion.apply(x, None)
    m.ReduceFromTPRegion.apply(x, None)
    if x._backward_hooks:
        bad.append("forward registered a hook on its input: use backward() instead")
    return bad


def test_functions_not_hooks() -> None:
    """Both are autograd Functions and leave no hooks on their input."""
    _check(_structure_worker, (2,))


@refusing(*TWINS)
def _copy_worker() -> list[str]:
    m = implementation(NAME)
    r, t = dist.get_rank(), dist.get_world_size()
    bad = []
    x = ints(1).requires_grad_()
    with CommTracer() as fwd:
        y = m.CopyToTPRegion.apply(x, None)
    if not torch.equal(y, x.detach()):
        bad.append(f"forward must return x unchanged: {_diff(y, x.detach())}")
    if fwd.records:
        bad.append(f"forward must not communicate, ran {calls(fwd)}")
    with CommTracer() as bwd:
        (y * ints(100 + r)).sum().backward()  # a different upstream gradient on each rank
    want = sum(ints(100 + q) for q in range(t))
    if x.grad is None or not torch.equal(x.grad, want):
        bad.append(
            f"backward must return the sum over ranks of the gradients: {_diff(x.grad, want)}"
        )
    if calls(bwd) != [("all_reduce", "backward", x.numel())]:
        bad.append(f"backward must run exactly 1 all-reduce of x's size, ran {calls(bwd)}")
    return bad


def test_copy_forward_identity_backward_all_reduce() -> None:
    """f: forward returns x with no communication; backward sums the ranks' gradients."""
    _check(_copy_worker, (2, 3))


@refusing(*TWINS)
def _reduce_worker() -> list[str]:
    m = implementation(NAME)
    r, t = dist.get_rank(), dist.get_world_size()
    bad = []
    x = ints(200 + r).requires_grad_()  # a different partial sum on each rank
    with CommTracer() as fwd:
        y = m.ReduceFromTPRegion.apply(x, None)
    want = sum(ints(200 + q) for q in range(t))
    if not torch.equal(y, want):
        bad.append(f"forward must return the sum over ranks: {_diff(y, want)}")
    if not torch.equal(x.detach(), ints(200 + r)):
        bad.append("forward modified its input in place: all-reduce a copy")
    if calls(fwd) != [("all_reduce", "forward", x.numel())]:
        bad.append(f"forward must run exactly 1 all-reduce of x's size, ran {calls(fwd)}")
    g = ints(300)  # the output is replicated, so its gradient is the same on every rank
    with CommTracer() as bwd:
        (y * g).sum().backward()
    if x.grad is None or not torch.equal(x.grad, g):
        bad.append(f"backward must pass the gradient through unchanged: {_diff(x.grad, g)}")
    if bwd.records:
        bad.append(f"backward must not communicate, ran {calls(bwd)}")
    return bad


def test_reduce_forward_all_reduce_backward_identity() -> None:
    """f̄: forward sums the ranks' partial results (input untouched); backward is identity."""
    _check(_reduce_worker, (2, 4))


@refusing(*TWINS)
def _reuse_worker() -> list[str]:
    m = implementation(NAME)
    r, t = dist.get_rank(), dist.get_world_size()
    w = ints(400).requires_grad_()  # a shared leaf, reused every step (like a weight)
    for step in range(3):
        # f used twice per step on the same tensor, plus a replicated residual path.
        loss = (
            sum(
                (m.CopyToTPRegion.apply(w, None) * ints(500 + 10 * step + k) * (r + 1)).sum()
                for k in range(2)
            )
            + w.sum()
        )
        loss.backward()
    ranks = sum(q + 1 for q in range(t))
    want = sum(ints(500 + 10 * s + k) * ranks for s in range(3) for k in range(2)) + 3
    if w.grad is None or not torch.equal(w.grad, want):
        return [
            "gradient of a tensor reused by f over several steps (with a residual that must not "
            f"be all-reduced) is wrong: {_diff(w.grad, want)}; hooks pile up, Functions do not"
        ]
    return []


def test_reused_tensor_gets_the_dense_gradient() -> None:
    """f on a tensor reused across calls and steps all-reduces each use exactly once."""
    _check(_reuse_worker, (2, 3))


@refusing(*TWINS)
def _shared_grad_worker() -> list[str]:
    m = implementation(NAME)
    r, t = dist.get_rank(), dist.get_world_size()
    x = ints(600).requires_grad_()
    h = 2 * x
    # A residual around f: the Add node hands the SAME gradient tensor to f's backward and to
    # the replicated branch h, so an f that all-reduces that tensor in place corrupts h's share.
    g = ints(700)  # the same on every rank
    ((m.CopyToTPRegion.apply(h, None) + h) * (r + 1) * g).sum().backward()
    ranks = sum(q + 1 for q in range(t))
    want = 2 * g * (ranks + (r + 1))  # f's share summed over ranks + this rank's own residual
    if x.grad is None or not torch.equal(x.grad, want):
        return [
            "gradient through f plus a residual is wrong: "
            f"{_diff(x.grad, want)}; all-reduce a clone of grad, never grad itself in place"
        ]
    return []


def test_gradient_shared_with_a_residual_is_not_modified() -> None:
    """z = (f(h) + h)·(r+1): f's backward must leave the gradient the residual also reads."""
    _check(_shared_grad_worker, (2, 3))


@refusing(*TWINS)
def _group_worker() -> list[str]:
    m = implementation(NAME)
    r = dist.get_rank()
    group, members = parity_group()
    bad = []
    x = ints(800).requires_grad_()
    (m.CopyToTPRegion.apply(x, group) * ints(900 + r)).sum().backward()
    want = sum(ints(900 + q) for q in members)
    if x.grad is None or not torch.equal(x.grad, want):
        bad.append(f"f's backward must sum over the group {members} only: {_diff(x.grad, want)}")
    y = m.ReduceFromTPRegion.apply(ints(1000 + r), group)
    want = sum(ints(1000 + q) for q in members)
    if not torch.equal(y, want):
        bad.append(f"f̄'s forward must sum over the group {members} only: {_diff(y, want)}")
    return bad


def test_group_argument_limits_the_sum() -> None:
    """On groups {0, 2} and {1, 3} of 4 ranks, f and f̄ sum over their own group's members."""
    _check(_group_worker, (4,))
