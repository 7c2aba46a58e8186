"""ColumnParallelLinear and RowParallelLinear against one dense nn.Linear (single process),
forward and backward (input, weight and bias gradients; weight-gradient shards gathered), at
tp 1-4 with uneven shapes; their communication contracts; sharding; construction errors.

Tolerances (float64, values O(1-10), eps = 2.2e-16):
- SAME_MATH = 1e-13 where the parallel code computes the same dot products as the dense code
  (column forward, weight/bias gradients, the row layer's input gradient). Bit-equality would be
  natural but is not what CPU BLAS gives: a GEMM with 6 output columns runs a different kernel
  (blocking, FMA, vector tails) than one with 12, so results differ by a few ulps (measured
  <= 2e-15 here). 1e-13 is ~100 ulps: any real mistake (wrong shard, bias twice) is O(1).
- REORDERED = 1e-12 where a sum is split across ranks and added in another order by the
  all-reduce (row forward, column input gradient): ~1e-14 expected, O(1) for a wrong result.
- exact (0.0) for pure data movement: shard/unshard round trips, dense_weight() giving back
  the weights.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tpedu
from tests.helpers import calls, randn
from tpedu import RankError, launch
from tpedu.comm.tracer import CommTracer
from tpedu.tp.layers import ColumnParallelLinear, RowParallelLinear
from tpedu.tp.sharding import check_divisible, divisors, shard, unshard

IN, OUT, BATCH = 7, 12, (3, 5)  # 12 divides by 1, 2, 3, 4; 7 is odd
SAME_MATH = 1e-13
REORDERED = 1e-12


def dense_layer(n_in, n_out, seed):
    torch.manual_seed(seed)
    return nn.Linear(n_in, n_out, dtype=torch.float64).to(tpedu.device())


def md(a, b):
    return (a - b).abs().max().item()


def column_worker():
    dense = dense_layer(IN, OUT, 0)
    x = randn(1, (*BATCH, IN))
    g = randn(2, (*BATCH, OUT))  # upstream gradient of the dense output
    xd = x.clone().requires_grad_()
    (dense(xd) * g).sum().backward()
    t, r = dist.get_world_size(), dist.get_rank()
    n = OUT // t
    out = {}

    layer = ColumnParallelLinear.from_dense(dense)
    xp = x.clone().requires_grad_()
    with CommTracer() as tr:
        y = layer(xp)
        (y * g[..., r * n : (r + 1) * n]).sum().backward()
    out["shapes"] = (tuple(layer.weight.shape), tuple(layer.bias.shape), tuple(y.shape))
    out["fwd"] = md(y, dense(x)[..., r * n : (r + 1) * n])
    out["dx"] = md(xp.grad, xd.grad)
    out["dw"] = md(layer.dense_weight(grad=True), dense.weight.grad)
    out["db"] = md(layer.dense_bias(grad=True), dense.bias.grad)
    out["w_back"] = md(layer.dense_weight(), dense.weight) + md(layer.dense_bias(), dense.bias)
    out["calls"] = calls(tr)

    gathered = ColumnParallelLinear(dense.weight, dense.bias, gather_output=True)
    xp = x.clone().requires_grad_()
    with CommTracer() as tr:
        y = gathered(xp)
        (y * g).sum().backward()
    out["gather_fwd"] = md(y, dense(x))
    out["gather_dx"] = md(xp.grad, xd.grad)
    out["gather_dw"] = md(gathered.dense_weight(grad=True), dense.weight.grad)
    out["gather_calls"] = calls(tr)

    # A custom row layout: rank r holds dense output features order[r·n : (r+1)·n].
    order = torch.randperm(OUT, generator=torch.Generator().manual_seed(7)).to(tpedu.device())
    permuted = ColumnParallelLinear(dense.weight, dense.bias, row_order=order)
    # the order moves with the module (a GPU rank builds on the CPU, then calls .to(device))
    moved = ColumnParallelLinear(dense.weight, dense.bias, row_order=order).to("meta")
    out["perm_moves"] = moved.inverse_order.device.type == "meta" and "row_order" not in (
        moved.state_dict()
    )
    y = permuted(x)
    out["perm_fwd"] = md(y, dense(x)[..., order[r * n : (r + 1) * n]])
    out["perm_back"] = md(permuted.dense_weight(), dense.weight) + md(
        permuted.dense_bias(), dense.bias
    )
    permuted.gather_output = True
    xp = x.clone().requires_grad_()
    y = permuted(xp)
    (y * g).sum().backward()
    out["perm_gather"] = md(y, dense(x))
    out["perm_grads"] = max(
        md(xp.grad, xd.grad),
        md(permuted.dense_weight(grad=True), dense.weight.grad),
        md(permuted.dense_bias(grad=True), dense.bias.grad),
    )
    return out


def row_worker():
    dense = dense_layer(OUT, IN, 3)  # in = 12 (sharded), out = 7
    x = randn(4, (*BATCH, OUT))
    g = randn(5, (*BATCH, IN))
    xd = x.clone().requires_grad_()
    (dense(xd) * g).sum().backward()
    t, r = dist.get_world_size(), dist.get_rank()
    n = OUT // t
    out = {}

    layer = RowParallelLinear.from_dense(dense)
    xp = x[..., r * n : (r + 1) * n].clone().requires_grad_()
    with CommTracer() as tr:
        y = layer(xp)
        (y * g).sum().backward()
    out["shapes"] = (tuple(layer.weight.shape), tuple(layer.bias.shape), tuple(y.shape))
    out["fwd"] = md(y, dense(x))
    out["dx"] = md(xp.grad, xd.grad[..., r * n : (r + 1) * n])
    out["dw"] = md(layer.dense_weight(grad=True), dense.weight.grad)
    out["db"] = md(layer.dense_bias(grad=True), dense.bias.grad)
    out["w_back"] = md(layer.dense_weight(), dense.weight) + md(layer.dense_bias(), dense.bias)
    out["calls"] = calls(tr)

    full_in = RowParallelLinear(dense.weight, dense.bias, input_is_parallel=False)
    xp = x.clone().requires_grad_()
    with CommTracer() as tr:
        y = full_in(xp)
        (y * g).sum().backward()
    out["full_fwd"] = md(y, dense(x))
    out["full_dx"] = md(xp.grad, xd.grad)
    out["full_calls"] = calls(tr)

    # Sharding round trip along every dim of an uneven 3-D tensor (sizes divisible by t).
    a = randn(6, (2 * t, 3, 12))
    out["roundtrip"] = [md(unshard(shard(a, d), d), a) for d in (0, 2, -1)]
    out["shard0"] = md(shard(a, 0), a[2 * r : 2 * r + 2])
    return out


@pytest.mark.parametrize("t", [1, 2, 3, 4])
def test_column_parallel_matches_dense(t):
    n, m = OUT // t, BATCH[0] * BATCH[1] * IN
    for o in launch(column_worker, t):
        assert o["shapes"] == ((n, IN), (n,), (*BATCH, n))
        # Same dot products as the dense layer (up to BLAS kernel choice).
        assert o["fwd"] <= SAME_MATH, f"forward: max |parallel - dense| = {o['fwd']:.3e}"
        assert o["dw"] <= SAME_MATH, f"weight grad: max |parallel - dense| = {o['dw']:.3e}"
        assert o["db"] <= SAME_MATH, f"bias grad: max |parallel - dense| = {o['db']:.3e}"
        assert o["w_back"] == 0.0, "dense_weight()/dense_bias() must give the dense tensors back"
        # dL/dx is summed over ranks by the all-reduce: reordered sum.
        assert o["dx"] <= REORDERED, f"input grad: max |parallel - dense| = {o['dx']:.3e}"
        # Contract: forward 0 collectives, backward 1 all-reduce of x's numel.
        assert o["calls"] == [("all_reduce", "backward", m)]
        assert o["gather_fwd"] <= SAME_MATH and o["gather_dw"] <= SAME_MATH
        assert o["gather_dx"] <= REORDERED
        assert o["perm_fwd"] <= SAME_MATH and o["perm_gather"] <= SAME_MATH
        assert o["perm_back"] == 0.0, "row_order: dense_weight() must undo the permutation"
        assert o["perm_moves"], "row_order must be a non-persistent buffer that .to() moves"
        assert o["perm_grads"] <= REORDERED, f"row_order grads: max |diff| = {o['perm_grads']:.3e}"
        assert o["gather_calls"] == [
            ("all_gather", "forward", BATCH[0] * BATCH[1] * OUT),
            ("all_reduce", "backward", m),
        ]


@pytest.mark.parametrize("t", [1, 2, 3, 4])
def test_row_parallel_matches_dense(t):
    n = OUT // t
    for o in launch(row_worker, t):
        assert o["shapes"] == ((IN, n), (IN,), (*BATCH, IN))
        # Partial sums over ranks, added by the all-reduce: reordered sum. A bias added before
        # the all-reduce would be counted t times: an O(1) error, caught here for t > 1.
        assert o["fwd"] <= REORDERED, f"forward: max |parallel - dense| = {o['fwd']:.3e}"
        assert o["dx"] <= SAME_MATH, f"input grad: max |parallel - dense| = {o['dx']:.3e}"
        assert o["dw"] <= SAME_MATH, f"weight grad: max |parallel - dense| = {o['dw']:.3e}"
        assert o["db"] <= SAME_MATH, f"bias grad: max |parallel - dense| = {o['db']:.3e}"
        assert o["w_back"] == 0.0
        # Contract: forward 1 all-reduce of the output's numel, backward none.
        assert o["calls"] == [("all_reduce", "forward", BATCH[0] * BATCH[1] * IN)]
        assert o["full_fwd"] <= REORDERED and o["full_dx"] <= SAME_MATH
        assert o["full_calls"] == [
            ("all_reduce", "forward", BATCH[0] * BATCH[1] * IN),
            ("all_gather", "backward", BATCH[0] * BATCH[1] * OUT),
        ]
        assert o["roundtrip"] == [0.0, 0.0, 0.0] and o["shard0"] == 0.0


def bad_inputs():
    errors = []
    for make in (
        lambda: ColumnParallelLinear(torch.zeros(10, 6), torch.zeros(10)),
        lambda: RowParallelLinear(torch.zeros(6, 9), None),
        lambda: ColumnParallelLinear(torch.zeros(8, 6), torch.zeros(6)),
        lambda: ColumnParallelLinear(torch.zeros(8, 6))(torch.zeros(2, 5)),
        lambda: RowParallelLinear(torch.zeros(6, 8))(torch.zeros(2, 8)),
        lambda: shard(torch.zeros(3, 10), 1),
        lambda: ColumnParallelLinear(torch.zeros(8, 6), row_order=[0, 1, 2, 3, 4, 5, 6, 6]),
    ):
        try:
            make()
            errors.append("no error")
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_bad_shapes_are_clear_errors():
    errors = launch(bad_inputs, 4)[0]
    assert errors == [
        "out_features of ColumnParallelLinear = 10 is not divisible by tp=4; "
        "valid tp values: 1, 2, 5, 10",
        "in_features of RowParallelLinear = 9 is not divisible by tp=4; valid tp values: 1, 3, 9",
        "bias must have shape [out] = (8,) for a weight of shape (8, 6), got (6,)",
        "ColumnParallelLinear expects the full input [..., 6], got (2, 5)",
        "RowParallelLinear (in=8, tp=4) expects this rank's input shard [..., 2], got (2, 8)",
        "size of dim 1 of a (3, 10) tensor = 10 is not divisible by tp=4; "
        "valid tp values: 1, 2, 5, 10",
        "row_order must be a permutation of range(8)",
    ]


def test_check_divisible():
    assert divisors(12) == [1, 2, 3, 4, 6, 12]
    check_divisible(12, 3, "x")  # no error
    with pytest.raises(
        ValueError, match=r"^8 heads = 8 is not divisible by tp=3; valid tp values: 1, 2, 4, 8$"
    ):
        check_divisible(8, 3, "8 heads")


def raises_in_rank():
    RowParallelLinear(torch.zeros(4, 6), None)


def test_errors_reach_the_launcher():
    with pytest.raises(RankError, match="in_features of RowParallelLinear = 6"):
        launch(raises_in_rank, 4)
