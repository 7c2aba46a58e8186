"""ParallelMLP against DenseMLP (single process), forward and backward, dropout ON (hidden and
output, two steps with different masks) and in eval mode (dropout off), GeLU / ReLU / SwiGLU, at
tp 1-4; its communication contract; construction errors.

Tolerance: 1e-12 absolute in float64. fc2's partial sums are added across ranks in another order
(the all-reduce), and CPU GEMM kernels differ by a few ulps between shard and dense widths
(see test_layers.py): both are ~1e-15 relative at these sizes; a wrong mask, shard or bias is
O(1). The dropout masks themselves are compared exactly (0 differing elements).
"""

import pytest
import torch

import tpedu
from tests.helpers import randn
from tpedu import launch
from tpedu.comm.tracer import CommTracer
from tpedu.tp.dense import DenseMLP
from tpedu.tp.mlp import ParallelMLP

H, F, B, S = 10, 24, 2, 5  # 24 divides by 1, 2, 3, 4
TOL = 1e-12
ACTS = ("gelu", "relu", "swiglu")


def md(a, b):
    return (a - b).abs().max().item()


def mlp_worker():
    results = {}
    for act in ACTS:
        torch.manual_seed(0)
        dense = DenseMLP(
            H, F, act, hidden_dropout=0.3, output_dropout=0.1, seed=1234, dtype=torch.float64
        ).to(tpedu.device())
        par = ParallelMLP.from_dense(dense)
        diffs, calls = [], []
        for step in range(2):
            x = randn(10 + step, (B, S, H))
            g = randn(20 + step, (B, S, H))
            xd, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
            yd = dense(xd, step=step)
            (yd * g).sum().backward()
            with CommTracer() as tr:
                yp = par(xp, step=step)
                (yp * g).sum().backward()
            calls.append([(c.op, c.phase, c.numel) for c in tr.records])
            diffs.append(
                {
                    "y": md(yp, yd),
                    "dx": md(xp.grad, xd.grad),
                    "zeros": [int((yp == 0).sum()), int((yd == 0).sum())],
                }
            )
        # Gradients accumulated over both steps, gathered from the shards.
        pairs = [(par.fc1, dense.fc1), (par.fc2, dense.fc2)]
        if act == "swiglu":
            pairs.append((par.up, dense.up))
        grads = max(
            max(
                md(p.dense_weight(grad=True), d.weight.grad),
                md(p.dense_bias(grad=True), d.bias.grad),
            )
            for p, d in pairs
        )
        shapes = [tuple(p.weight.shape) for p, _ in pairs]
        # Step masks differ, and dropout changes the output (so the test is not vacuous).
        x = randn(10, (B, S, H))
        with torch.no_grad():
            a, b = dense(x, step=0), dense(x, step=1)
            c = dense.eval()(x)
            evaluated = md(par.eval()(x), c)  # eval mode: both dropouts off in both MLPs
        changed = md(a, b) > 0 and md(a, c) > 0
        results[act] = dict(
            diffs=diffs,
            grads=grads,
            calls=calls,
            shapes=shapes,
            changed=changed,
            evaluated=evaluated,
        )
    return results


@pytest.mark.parametrize("t", [1, 2, 3, 4])
def test_parallel_mlp_matches_dense_with_dropout(t):
    n = B * S * H
    for o in launch(mlp_worker, t):
        for act, res in o.items():
            for step, d in enumerate(res["diffs"]):
                where = f"{act}, tp={t}, step {step}"
                assert d["y"] <= TOL, f"{where}: output max |parallel - dense| = {d['y']:.3e}"
                assert d["dx"] <= TOL, f"{where}: input grad max |parallel - dense| = {d['dx']:.3e}"
                # Same dropout mask: identical zero patterns (output dropout zeroes elements).
                assert d["zeros"][0] == d["zeros"][1] > 0, f"{where}: zeros {d['zeros']}"
            assert res["grads"] <= TOL, (
                f"{act}, tp={t}: weight/bias grads max |diff| = {res['grads']:.3e}"
            )
            assert res["changed"], "dropout must change the output, and masks must vary by step"
            assert res["evaluated"] <= TOL, (
                f"{act}, tp={t}: eval-mode output max |parallel - dense| = {res['evaluated']:.3e}"
            )
            # Contract: exactly 1 all-reduce of b·s·h forward and 1 backward, nothing else.
            for calls in res["calls"]:
                assert calls == [("all_reduce", "forward", n), ("all_reduce", "backward", n)]
            want = [(F // t, H), (H, F // t)] + ([(F // t, H)] if act == "swiglu" else [])
            assert res["shapes"] == want


def bad_mlps():
    errors = []

    def edited(activation: str = "gelu", **layers: torch.nn.Module | None) -> DenseMLP:
        dense = DenseMLP(6, 8, activation)
        for name, layer in layers.items():  # a dense MLP whose layers no longer chain
            setattr(dense, name, layer)
        return dense

    for make in (
        lambda: ParallelMLP(DenseMLP(6, 10)),
        lambda: ParallelMLP(edited(fc2=torch.nn.Linear(12, 6))),
        lambda: ParallelMLP(DenseMLP(6, 8, "tanh")),
        lambda: ParallelMLP(edited("swiglu", up=None)),
    ):
        try:
            make()
            errors.append("no error")
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_bad_mlp_shapes_are_clear_errors():
    errors = launch(bad_mlps, 4)[0]
    assert errors[0] == (
        "ffn_hidden (fc1.out_features) = 10 is not divisible by tp=4; valid tp values: 1, 2, 5, 10"
    )
    assert errors[1] == "MLP shapes do not chain: fc1 6->8, fc2 12->6; expected fc2 8->6"
    assert errors[2].startswith("unknown activation 'tanh'; choose one of gelu, gelu_tanh, relu")
    assert errors[3].startswith("activation='swiglu' needs the `up` projection")
