"""Grades exercises/l18_expert_dispatch.py: the order of the kept assignments, the rows per
rank, the two all-to-alls of dispatch and the way back of combine, then the four pieces put
together as an expert-parallel layer against DenseMoE on 1, 2 and 4 gloo ranks.

Orders, counts and the dispatched rows are compared exactly (the rows are copies, integer-
valued). The layer is compared in float64 with 1e-12 absolute (its values and gradients are
O(0.01-1)): EP runs each expert's GEMM on another batch of rows and sums the router's
gradient over the ranks in another order, a few ulps; a row sent to the wrong rank or expert,
or combined into the wrong token, is off by O(0.01) or more. tpedu's own expert-parallel layer
(tpedu.moe.expert_parallel) and its count exchange refuse to run while the learner's pieces do,
so a wrapper or an alias of them fails; all_to_all_tokens is the learner's to use.
"""

import functools

import pytest
import torch
import torch.distributed as dist

import tpedu
from tests.exercises import refusing
from tpedu.comm.tracer import CommTracer
from tpedu.course.grading import implementation
from tpedu.moe.dense import DenseMoE
from tpedu.moe.dispatch import all_to_all_tokens, exchange_counts, expert_major
from tpedu.moe.expert_parallel import ExpertParallelMoE
from tpedu.moe.router import keep_mask

NAME = "l18_expert_dispatch"
H, F, E, T = 6, 10, 8, 12  # E = 8: 2 experts per rank at ep 4; T tokens per rank
TOL = 1e-12
CASES = [(2, None), (2, 1.0), (1, None), (1, 0.75)]  # (top_k, capacity factor)
TWINS = (ExpertParallelMoE.forward, exchange_counts)


def loop_order(experts, keep):
    """sort_by_expert written as loops: for each expert, its kept assignments in a order."""
    flat, kept = experts.reshape(-1).tolist(), keep.reshape(-1).tolist()
    n = max(flat) + 1 if flat else 0
    return [a for e in range(n) for a in range(len(flat)) if flat[a] == e and kept[a]]


def routing(seed, tokens=T, top_k=2, experts=E, drop=0.3):
    """A random top-k without repeats (experts [T, k]) and a random keep mask [T, k]."""
    g = torch.Generator().manual_seed(seed)
    experts_ = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    return experts_, torch.rand(tokens, top_k, generator=g) >= drop


@refusing(*TWINS)
def test_sort_by_expert_worked_example():
    f = implementation(NAME).sort_by_expert
    experts = torch.tensor([[2, 0], [0, 1], [2, 1]])
    order = f(experts, torch.ones(3, 2, dtype=torch.bool))
    assert order.dtype == torch.int64
    assert order.tolist() == [1, 2, 3, 5, 0, 4]
    keep = torch.tensor([[True, False], [True, True], [False, True]])
    assert f(experts, keep).tolist() == [2, 3, 5, 0], "dropped assignments must not be sent"


@pytest.mark.parametrize("top_k", [1, 2])
@refusing(*TWINS)
def test_sort_by_expert_is_stable_and_drops(top_k):
    f = implementation(NAME).sort_by_expert
    for seed in range(5):
        experts, keep = routing(seed, tokens=40, top_k=top_k)
        got = f(experts, keep).tolist()
        assert got == loop_order(experts, keep), (
            f"seed {seed}: not the kept assignments by expert, then in token order "
            "(is the sort stable?)"
        )
    nothing = f(*routing(0, top_k=top_k, drop=1.0))
    assert nothing.numel() == 0 and nothing.dtype == torch.int64


@refusing(*TWINS)
def test_send_counts():
    f = implementation(NAME).send_counts
    kept = torch.tensor([3, 1, 0, 2])
    assert f(kept, 2) == [4, 2]
    assert f(kept, 1) == [6]
    assert f(kept, 4) == [3, 1, 0, 2]
    got = f(torch.tensor([5, 0, 2, 7, 1, 1, 0, 4]), 4)
    assert got == [5, 9, 2, 4], "rank d holds a contiguous block of experts, not e % ep == d"
    assert all(type(c) is int for c in got), "Python ints (all_to_all_variable takes a list)"


@refusing(*TWINS)
def test_send_counts_refuses_an_uneven_split():
    with pytest.raises(ValueError, match=r"(6.*4|4.*6)"):
        implementation(NAME).send_counts(torch.tensor([1, 2, 3, 4, 5, 6]), 4)


# On ranks: one launch per check and world size; a check returns its problems as strings.


def coded_rows(rank, tokens=T):
    """x [T, H] whose row t names (rank, t): integer-valued, so every copy is exact."""
    x = torch.zeros(tokens, H, dtype=torch.float64)
    x[:, 0], x[:, 1] = rank, torch.arange(tokens, dtype=torch.float64)
    return x


def check_dispatch(m, ep, rank):
    k = 2
    routes = [routing(100 + s, top_k=k) for s in range(ep)]  # every rank's, known to all
    experts, keep = routes[rank]
    order = torch.tensor(loop_order(experts, keep), dtype=torch.long)
    kept = torch.bincount(experts[keep], minlength=E)
    rows = coded_rows(rank)[order // k]
    with CommTracer() as trace, refusing(*TWINS):
        got, received = m.dispatch(rows, kept, None)
    local, bad = E // ep, []
    want_counts = torch.stack(
        [torch.bincount(ex[kp], minlength=E).reshape(ep, local)[rank] for ex, kp in routes]
    )
    if not torch.equal(received.long(), want_counts):
        bad.append(f"received_counts {received.tolist()}, want {want_counts.tolist()}")
    want = []  # source-major; within a source, by expert, in token order (as sent)
    for s, (ex, kp) in enumerate(routes):
        x_s = coded_rows(s)
        for a in loop_order(ex, kp):
            if int(ex.reshape(-1)[a]) // local == rank:
                want.append(x_s[a // k])
    want = torch.stack(want) if want else torch.zeros(0, H, dtype=torch.float64)
    if got.shape != want.shape or not torch.equal(got, want):
        names = lambda t: [tuple(int(v) for v in r[:2]) for r in t]  # (source rank, token)
        bad.append(f"received rows (rank, token) {names(got)}, want {names(want)}")
    calls = [(r.op, r.numel) for r in trace.records]
    if calls != [("all_to_all", E), ("all_to_all", len(order) * H)]:
        bad.append(
            f"traced collectives {calls}: want an all-to-all of the E = {E} counts, then one "
            f"of the {len(order)}·{H} row elements (tpedu.comm.collectives, all_to_all_tokens)"
        )
    return bad


def check_combine(m, ep, rank):
    """Expert e multiplies by (e + 1): y[t] = Σ_kept weights[t, j]·(experts[t, j] + 1)·x[t]. The
    rows are dispatched with the package's own all-to-alls, so only combine is graded here."""
    k, local = 2, E // ep
    experts, keep = routing(200 + rank, top_k=k)
    x = coded_rows(rank) + 1.0
    weights = torch.rand(T, k, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    weights.requires_grad_()
    order = torch.tensor(loop_order(experts, keep), dtype=torch.long)
    kept = torch.bincount(experts[keep], minlength=E)
    received = exchange_counts(kept)
    send, recv = kept.reshape(ep, -1).sum(1).tolist(), received.sum(1).tolist()
    got = all_to_all_tokens(x[order // k], send, recv)
    expert_of_row = rank * local + torch.arange(local).repeat(ep)
    expert_of_row = torch.repeat_interleave(expert_of_row, received.reshape(-1))
    out = got * (expert_of_row + 1).double()[:, None]
    with refusing(*TWINS):
        y = m.combine(out, received, kept, order, weights, None)
    want = (weights.detach() * (experts + 1) * keep).sum(1, keepdim=True) * x
    bad = []
    if y.shape != want.shape:
        return [f"y has shape {tuple(y.shape)}, want {tuple(want.shape)}"]
    if (y - want).abs().max() > TOL:
        bad.append(f"max |combine - Σ weight·output| = {(y - want).abs().max().item():.3e}")
    y.sum().backward()
    grad = ((experts + 1) * keep).double() * x.sum(1, keepdim=True)
    if weights.grad is None or (weights.grad - grad).abs().max() > TOL:
        bad.append(
            "the gradient of the weights is wrong (or missing): combine must stay in autograd"
        )
    return bad


@refusing(*TWINS)
def ep_forward(m, dense, x, ep, rank):
    """The four pieces as an expert-parallel layer; the router and the experts are the
    package's (this rank's E/ep experts of `dense`)."""
    e, k, local = dense.n_experts, dense.top_k, dense.n_experts // ep
    r = dense.router(x)
    keep = keep_mask(r.experts, e, dense.capacity_factor)
    kept = torch.bincount(r.experts[keep], minlength=e)
    order = m.sort_by_expert(r.experts, keep)
    got, received = m.dispatch(x[order // k], kept, None)
    by_expert = expert_major(received)
    slices = got[by_expert].split(received.sum(0).tolist())
    out = torch.cat([dense.experts[rank * local + j](s) for j, s in enumerate(slices)])
    return m.combine(out[torch.argsort(by_expert)], received, kept, order, r.weights, None)


def check_layer(m, ep, rank, top_k, capacity_factor):
    torch.manual_seed(0)
    dense = DenseMoE(
        H, F, E, top_k, capacity_factor=capacity_factor, groups=ep, dtype=torch.float64
    )
    g = torch.Generator().manual_seed(1)
    x_all = torch.randn(ep * T, H, generator=g, dtype=torch.float64)
    g_all = torch.randn(ep * T, H, generator=g, dtype=torch.float64)
    mine = slice(rank * T, (rank + 1) * T)
    xd = x_all.clone().requires_grad_()
    out = dense(xd)
    (out.y * g_all).sum().backward()  # J = Σ_r L_r: the ranks' losses added
    want_router = dense.router.gate.weight.grad.clone()
    local = E // ep
    want_experts = [
        p.grad.clone()
        for i in range(rank * local, (rank + 1) * local)
        for p in dense.experts[i].parameters()
    ]
    dense.zero_grad()
    xe = x_all[mine].clone().requires_grad_()
    y = ep_forward(m, dense, xe, ep, rank)
    (y * g_all[mine]).sum().backward()
    router = dense.router.gate.weight.grad.clone()
    dist.all_reduce(router)  # replicated: each rank holds its own tokens' part
    experts = [
        p.grad
        for i in range(rank * local, (rank + 1) * local)
        for p in dense.experts[i].parameters()
    ]
    diffs = {
        "y": (y - out.y[mine]).abs().max().item(),
        "dL/dx": (xe.grad - xd.grad[mine]).abs().max().item(),
        "router gradient": (router - want_router).abs().max().item(),
        "expert gradients": max(
            (a - b).abs().max().item() for a, b in zip(experts, want_experts, strict=True)
        ),
    }
    where = f"top_k {top_k}, capacity factor {capacity_factor}"
    assert (out.dropped > 0) == (capacity_factor is not None), f"{where}: the set-up drops"
    return [f"{where}: max |EP - dense| of {n} = {d:.3e}" for n, d in diffs.items() if d > TOL]


def worker(check):
    m = implementation(NAME)
    ep, rank = dist.get_world_size(), dist.get_rank()
    try:
        if check == "layer":
            return [p for case in CASES for p in check_layer(m, ep, rank, *case)]
        return {"dispatch": check_dispatch, "combine": check_combine}[check](m, ep, rank)
    except Exception as e:  # reported as this check's problem, with its type
        return [f"{type(e).__name__}: {e}"]


@functools.cache
def results(check, ep):
    """One launch per check and world size, its outcome (a hang's too) kept for the tests."""
    try:
        return tpedu.launch(worker, ep, check, timeout=30)  # a hung all-to-all fails in 30 s
    except Exception as e:  # a rank died or the ranks hung: every test of this check says so
        return e


def assert_clean(ep, check):
    out = results(check, ep)
    if isinstance(out, Exception):
        raise AssertionError(
            f"ep {ep}: the ranks failed ({type(out).__name__}); unequal send and receive counts "
            f"make an all-to-all wait forever: {out}"
        )
    for rank, bad in enumerate(out):
        assert not bad, f"ep {ep}, rank {rank}: " + "; ".join(bad)


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_dispatch_sends_each_row_to_its_experts_rank(ep):
    """Counts first (an all-to-all of E), then the rows (A·H): rank d gets, from every source
    in rank order, the rows for its experts, by expert, in token order."""
    assert_clean(ep, "dispatch")


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_combine_brings_every_output_home_weighted(ep):
    assert_clean(ep, "combine")


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_the_pieces_make_an_expert_parallel_layer_equal_to_dense(ep):
    """Forward and backward against DenseMoE(groups=ep) fed all ranks' tokens, float64:
    top-1 and top-2, dropless and dropping."""
    assert_clean(ep, "layer")
