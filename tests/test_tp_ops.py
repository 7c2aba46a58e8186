"""The four TP region operators (f, f̄, scatter, gather) against their definitions, forward and
backward, at tp 1-4, with the collectives each one runs (CommTracer).

Inputs are random INTEGERS stored as float64: every sum of them is exact whatever order the
backend adds in, so all comparisons here are exact (tolerance 0).
"""

import pytest
import torch
import torch.distributed as dist

import tpedu
from tests.helpers import calls
from tpedu import RankError, launch
from tpedu.comm.tracer import CommTracer
from tpedu.tp.operators import (
    CopyToTPRegion,
    ReduceFromTPRegion,
    copy_to_tp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    scatter_to_tp_region,
)

SHAPE = (2, 3, 5)  # uneven, non-symmetric


# Tests call (y * g).sum().backward(), not y.backward(g): the latter imports sympy lazily,
# which costs ~1-3 s in every freshly forked rank.


def ints(seed, shape):
    """Random integers in [-9, 9] as float64, the same on whichever rank asks for `seed`."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-9, 10, shape, generator=g).to(torch.float64).to(tpedu.device())


def ops_worker():
    t, r = dist.get_world_size(), dist.get_rank()
    out = {}

    # f: forward identity, backward sum of every rank's (different) upstream gradient.
    x = ints(0, SHAPE).requires_grad_()
    with CommTracer() as tr:
        y = copy_to_tp_region(x)
        out["copy_fwd"] = y.detach().clone()
        (y * ints(100 + r, SHAPE)).sum().backward()
    out["copy_grad"], out["copy_calls"] = x.grad, calls(tr)

    # f̄: forward sum of every rank's partial result, backward identity; input left untouched.
    x = ints(200 + r, SHAPE).requires_grad_()
    with CommTracer() as tr:
        y = reduce_from_tp_region(x)
        out["reduce_fwd"] = y.detach().clone()
        (y * ints(300, SHAPE)).sum().backward()  # y is replicated, so is its gradient
    out["reduce_input_after"], out["reduce_grad"], out["reduce_calls"] = (
        x.detach().clone(),
        x.grad,
        calls(tr),
    )

    # scatter: keep own chunk of the last dim; backward all-gathers the gradient chunks.
    full = (*SHAPE[:-1], 2 * t + 1 if t == 1 else 2 * t)  # 3 or 2t columns
    x = ints(400, full).requires_grad_()
    with CommTracer() as tr:
        y = scatter_to_tp_region(x)
        out["scatter_fwd"] = y.detach().clone()
        (y * ints(500 + r, y.shape)).sum().backward()
    out["scatter_grad"], out["scatter_calls"] = x.grad, calls(tr)

    # gather: all-gather the last dim in rank order; backward keeps own chunk.
    x = ints(600 + r, SHAPE).requires_grad_()
    with CommTracer() as tr:
        y = gather_from_tp_region(x)
        out["gather_fwd"] = y.detach().clone()
        (y * ints(700, (*SHAPE[:-1], SHAPE[-1] * t))).sum().backward()
    out["gather_grad"], out["gather_calls"] = x.grad, calls(tr)

    # A reused leaf: f used three times per forward, two iterations. A Function acts once per
    # use on its own branch; the seed's register_hook version would all-reduce repeatedly.
    w = ints(800, SHAPE).requires_grad_()
    for step in range(2):
        loss = sum(
            (copy_to_tp_region(w) * ints(900 + 10 * step + k, SHAPE) * (r + 1)).sum()
            for k in range(3)
        )
        loss = loss + w.sum()  # a replicated branch (a residual): must NOT be all-reduced
        loss.backward()
    out["reuse_grad"] = w.grad
    out["hooks"] = w._backward_hooks
    return out


@pytest.mark.parametrize("t", [1, 2, 3, 4])
def test_operators_match_definitions(t):
    res = launch(ops_worker, t)
    for r, o in enumerate(res):
        n = SHAPE[-1]
        assert torch.equal(o["copy_fwd"], ints(0, SHAPE))
        assert torch.equal(o["copy_grad"], sum(ints(100 + q, SHAPE) for q in range(t)))
        assert o["copy_calls"] == [("all_reduce", "backward", 30)]

        assert torch.equal(o["reduce_fwd"], sum(ints(200 + q, SHAPE) for q in range(t)))
        assert torch.equal(o["reduce_input_after"], ints(200 + r, SHAPE)), "f̄ modified its input"
        assert torch.equal(o["reduce_grad"], ints(300, SHAPE))
        assert o["reduce_calls"] == [("all_reduce", "forward", 30)]

        cols = 3 if t == 1 else 2 * t
        full = ints(400, (*SHAPE[:-1], cols))
        c = cols // t
        assert torch.equal(o["scatter_fwd"], full[..., r * c : (r + 1) * c])
        grads = [ints(500 + q, (*SHAPE[:-1], c)) for q in range(t)]
        assert torch.equal(o["scatter_grad"], torch.cat(grads, dim=-1))
        assert o["scatter_calls"] == [("all_gather", "backward", 6 * cols)]

        assert torch.equal(o["gather_fwd"], torch.cat([ints(600 + q, SHAPE) for q in range(t)], -1))
        g = ints(700, (*SHAPE[:-1], n * t))
        assert torch.equal(o["gather_grad"], g[..., r * n : (r + 1) * n])
        assert o["gather_calls"] == [("all_gather", "forward", 30 * t)]

        # d/dw of Σ_steps [Σ_k Σ_ranks (w·c_{step,k}·(q+1)) + Σ w] (the sum over ranks is f's job)
        want = sum(
            ints(900 + 10 * step + k, SHAPE) * sum(q + 1 for q in range(t))
            for step in range(2)
            for k in range(3)
        ) + 2 * torch.ones(SHAPE, dtype=torch.float64)
        diff = (o["reuse_grad"] - want).abs().max().item()
        assert diff == 0.0, f"reused leaf: max |grad - dense| = {diff:.3e}"
        assert not o["hooks"], "the operators must not register hooks on their inputs"


def test_operators_are_autograd_functions():
    assert issubclass(CopyToTPRegion, torch.autograd.Function)
    assert issubclass(ReduceFromTPRegion, torch.autograd.Function)


def bad_scatter():
    scatter_to_tp_region(torch.zeros(2, 5))


def test_scatter_uneven_last_dim_is_a_clear_error():
    with pytest.raises(
        RankError, match=r"last dimension = 5 is not divisible by tp=2; valid tp values: 1, 5"
    ):
        launch(bad_scatter, 2)
