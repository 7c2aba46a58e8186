"""DenseMoE and ExpertParallelMoE (tpedu.moe) in float64: the dense layer's own sanity (k = E is
the probability-weighted sum of all experts; capacity drops exactly GShard's priority; the
auxiliary losses are their formulas), then EP against dense at ep 1, 2, 4 over every
combination of top-k 1/2, renormalize on/off, GELU/SwiGLU, shared expert on/off, dropless or
dropping: outputs, router logits, aux and z-loss values, counts, input gradients, router,
shared-expert and every expert's gradients; the traced all-to-alls against the routed counts;
expert gradients averaged over the whole group (the DataParallel mistake) are wrong;
construction errors.

Tolerance: 1e-12 absolute in float64 (values and gradients here are O(0.01-1)). EP adds the
same products in another order (the statistics' all-reduce, the probability sums, the
gradients of router and shared expert summed over ranks then divided by ep, the expert
gradients divided by ep) and runs each expert's GEMM on another batch of rows: all are a few
ulps, ~1e-16 relative; a token sent to the wrong expert, combined in the wrong order, dropped
by another priority, or an aux loss over the wrong tokens is O(0.01) or more. Counts (tokens
per expert, dropped, send counts, traced elements) are compared exactly.

One launch per ep size runs all 32 combinations (cached for the tests that read it).
"""

import functools
import itertools
import math

import pytest
import torch
import torch.distributed as dist

from tests.helpers import randn
from tpedu import launch
from tpedu.comm import collectives
from tpedu.comm.placement import split_over
from tpedu.comm.tracer import CommTracer
from tpedu.moe.dense import DenseMoE
from tpedu.moe.expert_parallel import ExpertParallelMoE
from tpedu.moe.router import keep_mask

H, F, E, B, S = 8, 12, 8, 2, 6  # E = 8: ep 4 holds 2 experts per rank
T = B * S  # tokens per rank
TOL = 1e-12
AUX, Z = 0.3, 0.2  # loss coefficients: large enough that a wrong aux/z gradient shows
CASES = list(
    itertools.product((1, 2), (True, False), ("gelu", "swiglu"), (False, True), (None, 1.0))
)  # (top_k, renormalize, activation, shared expert, capacity factor)


def md(a, b):
    return (a - b).abs().max().item()


def build(top_k, renormalize, activation, shared, capacity_factor, groups, experts=E):
    torch.manual_seed(0)
    return DenseMoE(
        H,
        F,
        experts,
        top_k,
        activation,
        bias=True,
        renormalize=renormalize,
        shared_expert=shared,
        capacity_factor=capacity_factor,
        groups=groups,
        dtype=torch.float64,
    )


def grad_diff(pairs):
    return max(md(p.grad, q.grad) for p, q in pairs)


def params(module):
    return list(module.parameters()) if module is not None else []


def routed_matrix(dense, x_all, ep):
    """N[src, dst]: kept assignments from rank src's tokens to experts on rank dst, from the
    dense model's routing (independent of the EP code path)."""
    with torch.no_grad():
        r = dense.router(x_all.reshape(-1, H))
    keep = keep_mask(r.experts, E, dense.capacity_factor, ep)
    src = (torch.arange(ep * T) // T)[:, None].expand_as(r.experts)
    dst = r.experts // (E // ep)
    n = torch.zeros(ep, ep, dtype=torch.long)
    n.index_put_((src[keep], dst[keep]), torch.ones_like(src[keep]), accumulate=True)
    return n


def run_case(case, ep, rank, wrong_expert_reduce=False):
    dense = build(*case, groups=ep)
    moe = ExpertParallelMoE.from_dense(dense)
    x_all, g_all = randn(1, (ep * B, S, H)), randn(2, (ep * B, S, H))
    mine = slice(rank * B, (rank + 1) * B)

    xd = x_all.clone().requires_grad_()
    od = dense(xd)
    # J: the mean over all ep·T tokens; each EP rank's loss: the mean over its own T tokens.
    ((od.y * g_all).sum() / (ep * T) + AUX * od.aux_loss + Z * od.z_loss).backward()

    xe = x_all[mine].clone().requires_grad_()
    with CommTracer() as trace:
        oe = moe(xe)
        ((oe.y * g_all[mine]).sum() / T + AUX * oe.aux_loss + Z * oe.z_loss).backward()
    if wrong_expert_reduce:  # the mutation: every gradient averaged over the whole group
        for p in moe.parameters():
            collectives.all_reduce(p.grad)
            p.grad /= ep
    else:
        moe.reduce_gradients()

    first = moe.first_expert
    expert_pairs = [
        (p, q)
        for j, mlp in enumerate(moe.experts.values())
        for p, q in zip(mlp.parameters(), dense.experts[first + j].parameters(), strict=True)
    ]
    n = routed_matrix(dense, x_all, ep)
    return dict(
        y=md(oe.y, od.y[mine]),
        logits=md(oe.logits, od.logits[rank * T : (rank + 1) * T]),
        aux=abs(oe.aux_loss - od.aux_loss).item(),
        z=abs(oe.z_loss - od.z_loss).item(),
        counts=(oe.tokens_per_expert.tolist(), od.tokens_per_expert.tolist()),
        dropped=(oe.dropped, od.dropped),
        dx=md(xe.grad, ep * xd.grad[mine]),  # dL_r/dx = ep · dJ/dx (module docstring)
        router=grad_diff(zip(params(moe.router), params(dense.router), strict=True)),
        shared=grad_diff(zip(params(moe.shared), params(dense.shared), strict=True))
        if case[3]
        else 0.0,
        experts=grad_diff(expert_pairs),
        expert_ids=list(range(first, first + moe.local_experts)),
        calls=sorted((r.op, r.phase, r.numel) for r in trace.records),
        send=moe.last_send_counts,
        routed=n.tolist(),
        names=[n for n, _ in moe.named_parameters() if n in split_over(moe, "ep")],
        n_expert_params=len(moe.expert_parameters()),
    )


def ep_worker():
    ep, rank = dist.get_world_size(), dist.get_rank()
    out = {"cases": [run_case(case, ep, rank) for case in CASES]}
    if ep > 1:
        out["wrong_reduce"] = run_case((2, True, "gelu", True, None), ep, rank, True)["experts"]
        try:
            ExpertParallelMoE(build(2, True, "gelu", False, None, ep, experts=6 if ep == 4 else 3))
            out["error"] = "no error"
        except ValueError as e:
            out["error"] = str(e)
    return out


@functools.cache
def results(ep):
    return launch(ep_worker, ep)


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_expert_parallel_matches_dense(ep):
    """Forward and backward, every combination, every rank's tokens."""
    checked = set()
    for rank, out in enumerate(results(ep)):
        for case, res in zip(CASES, out["cases"], strict=True):
            where = f"ep={ep} rank {rank} (top_k, renormalize, act, shared, cf)={case}"
            for key in ("y", "logits", "aux", "z", "dx", "router", "shared", "experts"):
                assert res[key] <= TOL, f"{where}: {key} max |EP - dense| = {res[key]:.3e}"
            assert res["counts"][0] == res["counts"][1], f"{where}: tokens per expert"
            assert res["dropped"][0] == res["dropped"][1], f"{where}: dropped"
            counts, dropped = res["counts"][1], res["dropped"][1]
            assert len(set(counts)) > 1, f"{where}: the load is uneven, not vacuous: {counts}"
            if case[4] is None:
                assert dropped == 0 and sum(counts) == ep * T * case[0], where
            else:
                assert dropped > 0, f"{where}: the capacity drops tokens"
            assert res["names"] and len(res["names"]) == res["n_expert_params"], where
            checked.update(res["expert_ids"])
    assert checked == set(range(E)), "every expert's gradient was compared"


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_traced_all_to_alls_are_the_routed_counts(ep):
    """Per forward: 1 all-reduce of the 3E + 2 statistics, an all-to-all of the E counts, the
    dispatch (A·H: this rank's kept assignments) and the combine (R·H: those it receives);
    backward: the two all-to-alls with their sizes swapped and the statistics' all-reduce. A and
    R are read off the DENSE model's routing; the elements that leave the rank are the ones
    not kept on it."""
    for rank, out in enumerate(results(ep)):
        for case, res in zip(CASES, out["cases"], strict=True):
            n = res["routed"]
            sent, received = sum(n[rank]) * H, sum(row[rank] for row in n) * H
            want = sorted(
                [
                    ("all_reduce", "forward", 3 * E + 2),
                    ("all_reduce", "backward", 3 * E + 2),
                    ("all_to_all", "forward", E),
                    ("all_to_all", "forward", sent),
                    ("all_to_all", "forward", received),
                    ("all_to_all", "backward", sent),
                    ("all_to_all", "backward", received),
                ]
            )
            assert res["calls"] == want, f"ep={ep} rank {rank} {case}"
            assert res["send"] == n[rank], f"ep={ep} rank {rank} {case}"
            off_rank = sent - n[rank][rank] * H  # what actually crosses the network
            assert (off_rank > 0) == (ep > 1), f"ep={ep} rank {rank} {case}"


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_gradients_averaged_over_the_group_are_wrong(ep):
    """Expert parameters are not replicated: averaging them over the EP group (as DataParallel
    does for replicated ones) mixes different experts' gradients."""
    for out in results(ep):
        assert out["wrong_reduce"] > 1e-3, f"ep={ep}: {out['wrong_reduce']:.3e}"


@pytest.mark.parametrize("ep", [2, 4])
def test_experts_not_divisible_by_ep_is_a_clear_error(ep):
    experts = 6 if ep == 4 else 3
    valid = "1, 2, 3, 6" if ep == 4 else "1, 3"
    assert results(ep)[0]["error"] == (
        f"experts = {experts} is not divisible by ep = {ep}; choose ep among {valid} "
        "(or a number of experts that ep divides)"
    )


# The dense layer on its own (one process, no launch)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_all_experts_chosen_is_the_probability_weighted_sum(renormalize, activation):
    dense = build(2, renormalize, activation, False, None, 1, experts=2)
    x = randn(3, (T, H))
    with torch.no_grad():
        out = dense(x)
        probs = dense.router.gate(x).softmax(-1)
        want = sum(probs[:, e, None] * dense.experts[e](x) for e in range(2))
    assert md(out.y, want) <= TOL
    assert out.dropped == 0 and out.tokens_per_expert.tolist() == [T, T]


def reference_keep(experts, capacity):
    """GShard's priority written as loops: first choices in token order, then second choices."""
    keep = torch.zeros(experts.shape, dtype=torch.bool)
    taken = [0] * E
    for j in range(experts.shape[1]):
        for t in range(experts.shape[0]):
            e = int(experts[t, j])
            if taken[e] < capacity:
                keep[t, j] = True
                taken[e] += 1
    return keep


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("top_k", [1, 2])
def test_capacity_drops_by_gshard_priority(top_k, groups):
    """With a capacity, the output is the loop reference's (dropped assignments contribute
    nothing); dropless drops none. The aux and z losses are their formulas over all tokens."""
    n, cf = 4 * T, 0.75
    x = randn(4, (n, H))
    for capacity_factor in (cf, None):
        dense = build(top_k, False, "gelu", False, capacity_factor, groups)
        with torch.no_grad():
            out = dense(x)
            logits = dense.router.gate(x)
            probs = logits.softmax(-1)
            top, experts = probs.topk(top_k, dim=-1)
            cap = math.ceil(cf * n / groups * top_k / E) if capacity_factor else n * top_k
            keep = torch.cat([reference_keep(g, cap) for g in experts.chunk(groups)])
            want = torch.zeros_like(x)
            for t, j in keep.nonzero().tolist():
                want[t] += top[t, j] * dense.experts[int(experts[t, j])](x[t])
            f = torch.bincount(experts.reshape(-1), minlength=E).double() / (n * top_k)
            aux = E * (f * probs.mean(0)).sum()
            z = (logits.logsumexp(-1) ** 2).mean()
        assert md(out.y, want) <= TOL
        assert abs(out.aux_loss - aux) <= TOL and abs(out.z_loss - z) <= TOL
        assert out.dropped == int((~keep).sum())
        assert out.tokens_per_expert.sum() == keep.sum()
        if capacity_factor is None:
            assert out.dropped == 0
        else:
            assert out.dropped > 0, "the capacity is small enough to drop"


def error(make):
    with pytest.raises(ValueError) as e:
        make()
    message = str(e.value)
    assert "\n" not in message
    return message


def test_bad_moe_settings_are_clear_errors():
    assert error(lambda: DenseMoE(H, F, E, top_k=3)) == (
        "top_k = 3 is not supported; choose top_k = 1 (Switch) or 2 (GShard, Mixtral)"
    )
    assert error(lambda: DenseMoE(H, F, 1, top_k=2)) == (
        "top_k = 2 is more than experts = 1; choose top_k <= experts"
    )
    for bad in (0, -1.0, float("inf"), float("nan"), "1.25", True):
        assert error(lambda bad=bad: DenseMoE(H, F, E, capacity_factor=bad)) == (
            f"capacity_factor = {bad!r} is not a positive number; use e.g. 1.25, or None for "
            "no dropping (dropless)"
        )
    assert error(lambda: DenseMoE(H, F, E, activation="tanh")).startswith(
        "unknown activation 'tanh'; choose one of"
    )
    assert error(lambda: DenseMoE(H, F, E, groups=5, dtype=torch.float64)(randn(5, (T, H)))) == (
        f"{T} tokens do not split into groups = 5 equal groups; use a token count divisible by "
        "groups"
    )
