"""Collective matmul (tpedu/tp/collective_matmul.py) against the sequence-parallel layers and the
dense matmul, forward and backward, at tp 1, 2, 4, on uneven shapes (3 rows per rank, odd widths).

Tolerances, float64 (eps = 2.2e-16), elementwise:
- a product the ring computes on s/t rows instead of s: the kernel may round another way
  (MKL picks kernels by shape); two dot products of K terms differ by ≤ K·eps·(|x|·|w|ᵀ).
- a sum over t ranks in the ring's order instead of the library's: ≤ (t-1)·eps·Σ_r|term_r|.
Where the same arithmetic runs on the same tensors (dL/dW from the gathered shards or dL/dy,
dL/db) the results must be bitwise equal.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tpedu import launch
from tpedu.comm import collectives
from tpedu.comm.tracer import CommTracer
from tpedu.model.config import GPTConfig
from tpedu.model.dense import DenseGPT
from tpedu.model.gpt import TPGPT
from tpedu.model.options import RunOptions
from tpedu.tp.collective_matmul import ring_all_gather_linear, ring_linear_reduce_scatter
from tpedu.tp.sequence_parallel import (
    all_gather_linear,
    reduce_scatter_to_sp_region,
    sequence_chunk,
)
from tpedu.tp.sharding import shard

EPS = torch.finfo(torch.float64).eps
B, ROWS, H, OUT = 3, 3, 5, 7  # per rank: 3 positions, odd widths


def _randn(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _leaf(t):
    return t.detach().clone().requires_grad_()


def _run(fn, inputs, grads):
    """fn(*leaves) -> outputs; backward with `grads`; (outputs, input grads, traced wire bytes
    and sends per phase)."""
    leaves = [_leaf(t) if t is not None else None for t in inputs]
    with CommTracer() as trace:
        outs = fn(*leaves)
        torch.autograd.backward(outs, grads)
    traffic = {
        ph: (trace.wire_bytes(phase=ph), trace.count("send", phase=ph))
        for ph in ("forward", "backward")
    }
    return [o.detach() for o in outs], [t.grad if t is not None else None for t in leaves], traffic


def _column(group):
    t, r = dist.get_world_size(group), dist.get_rank(group)
    s = ROWS * t
    x = _randn(1, B, s, H)
    w1, w2, b1 = _randn(2, OUT * t, H), _randn(3, 2 * t, H), _randn(4, OUT * t)
    g1, g2 = _randn(5, B, s, OUT * t), _randn(6, B, s, 2 * t)
    inputs = [sequence_chunk(x, group), shard(w1, 0, group), shard(w2, 0, group)]
    inputs.append(shard(b1, 0, group))
    grads = [shard(g1, -1, group), shard(g2, -1, group)]
    res = {}
    for name, fn in (("ring", ring_all_gather_linear), ("sp", all_gather_linear)):
        res[name] = _run(
            lambda x, w1, w2, b1, fn=fn: fn(x, [w1, w2], [b1, None], group), inputs, grads
        )
    # bounds: |x|·|w|ᵀ for the products, Σ_r |partial dL/dx_r| for the ring's sum
    xa = x.abs()
    prod = [F.linear(xa, inputs[1].abs()), F.linear(xa, inputs[2].abs())]
    part = grads[0].abs() @ inputs[1].abs() + grads[1].abs() @ inputs[2].abs()
    part_sum = sequence_chunk(collectives.all_reduce(part.clone(), group), group)
    # the dense layer on one process
    leaves = [_leaf(v) for v in (x, w1, w2, b1)]
    dense = [F.linear(leaves[0], leaves[1], leaves[3]), F.linear(leaves[0], leaves[2])]
    torch.autograd.backward(dense, [g1, g2])
    ref = [
        sequence_chunk(leaves[0].grad, group),
        shard(leaves[1].grad, 0, group),
        shard(leaves[2].grad, 0, group),
        shard(leaves[3].grad, 0, group),
    ]
    return t, r, res, prod, part_sum, [shard(d.detach(), -1, group) for d in dense], ref


def _row(group):
    t = dist.get_world_size(group)
    s = ROWS * t
    x, w, b = _randn(11, B, s, H * t), _randn(12, OUT, H * t), _randn(13, OUT)
    g = _randn(14, B, s, OUT)
    inputs = [shard(x, -1, group), shard(w, 1, group), b]
    grads = [sequence_chunk(g, group)]

    def sp(x, w, b):
        return [reduce_scatter_to_sp_region(F.linear(x, w), group) + b]

    res = {
        "ring": _run(lambda x, w, b: [ring_linear_reduce_scatter(x, w, b, group)], inputs, grads),
        "sp": _run(sp, inputs, grads),
    }
    for _, g_in, _ in res.values():  # the bias saw this rank's positions: sum over TP (SP's fix-up)
        g_in[2] = collectives.all_reduce(g_in[2].clone(), group)
    terms = F.linear(inputs[0].abs(), inputs[1].abs())  # ≥ |this rank's partial sum|
    term_sum = sequence_chunk(collectives.all_reduce(terms.clone(), group), group)
    prod = g.abs() @ inputs[1].abs()  # for dL/dx: K = OUT
    leaves = [_leaf(v) for v in (x, w, b)]
    dense = F.linear(leaves[0], leaves[1], leaves[2])
    dense.backward(g)
    ref = [shard(leaves[0].grad, -1, group), shard(leaves[1].grad, 1, group), leaves[2].grad]
    return t, res, term_sum, prod, sequence_chunk(dense.detach(), group), ref


def _worker():
    world, rank = dist.get_world_size(), dist.get_rank()
    single = [dist.new_group([r]) for r in range(world)][rank]
    return {tp: (_column(g), _row(g)) for tp, g in ((1, single), (world, None))}


def _within(got, want, bound, what):
    excess = ((got - want).abs() - bound).max().item()
    assert excess <= 0, f"{what}: exceeds its bound by {excess:.2e}"


def test_ring_layers_equal_the_sequence_parallel_layers_and_dense():
    bitwise_products = []
    for world in (2, 4):
        for out in launch(_worker, world):
            for tp, (column, row) in out.items():
                t, r, res, prod, part_sum, dense_y, ref = column
                (ry, rg, rtraffic), (sy, sg, straffic) = res["ring"], res["sp"]
                for i in range(2):  # forward: the same products, rows placed by the ring
                    _within(ry[i], sy[i], H * EPS * prod[i], f"tp {tp} column y{i}")
                    _within(ry[i], dense_y[i], H * EPS * prod[i], f"tp {tp} column y{i} vs dense")
                    bitwise_products.append(torch.equal(ry[i], sy[i]))
                # dL/dx: the ring's sum of t partial sums, each of 2 products over 7·t+2·t terms
                bound = ((t - 1) + (OUT + 2) * t) * EPS * part_sum
                _within(rg[0], sg[0], bound, f"tp {tp} column dL/dx")
                _within(rg[0], ref[0], bound, f"tp {tp} column dL/dx vs dense")
                for i, what in ((1, "dL/dW1"), (2, "dL/dW2"), (3, "dL/db")):
                    # dL/dW from the gathered shards in one matmul, as the SP layer: bitwise
                    assert torch.equal(rg[i], sg[i]), f"tp {tp} rank {r} column {what}"
                    assert (rg[i] - ref[i]).abs().max().item() <= 1e-13, f"tp {tp} {what} vs dense"
                # traffic: the ring sends what the all-gather (and reduce-scatter) would
                assert rtraffic == {
                    "forward": (straffic["forward"][0], t - 1),
                    "backward": (straffic["backward"][0], 2 * (t - 1)),
                }, (tp, rtraffic, straffic)

                t, res, term_sum, prod, dense_y, ref = row
                (ry, rg, rtraffic), (sy, sg, straffic) = res["ring"], res["sp"]
                # forward: per-chunk products (K = H) then the ring's sum over t ranks
                bound = ((t - 1) + H * t) * EPS * term_sum
                _within(ry[0], sy[0], bound, f"tp {tp} row y")
                _within(ry[0], dense_y, bound, f"tp {tp} row y vs dense")
                _within(rg[0], sg[0], OUT * EPS * prod, f"tp {tp} row dL/dx")
                _within(rg[0], ref[0], OUT * EPS * prod, f"tp {tp} row dL/dx vs dense")
                bitwise_products.append(torch.equal(rg[0], sg[0]))
                for i, what in ((1, "dL/dW"), (2, "dL/db")):
                    assert torch.equal(rg[i], sg[i]), f"tp {tp} row {what}"
                    assert (rg[i] - ref[i]).abs().max().item() <= 1e-13, f"tp {tp} {what} vs dense"
                assert rtraffic == {
                    "forward": (straffic["forward"][0], t - 1),
                    "backward": (straffic["backward"][0], t - 1),
                }, (tp, rtraffic, straffic)
    print(f"bitwise products: {sum(bitwise_products)} of {len(bitwise_products)}")


BASE = {"seq_len": 12, "n_layers": 2, "n_heads": 4, "dropout": 0.1}
GPT2 = GPTConfig.gpt2_like(37, hidden=24, **BASE)
LLAMA = GPTConfig.llama_like(37, hidden=32, **BASE)  # GQA 2 KV heads: replicated at tp 4
MODELS = {"gpt2": (GPT2, "none"), "llama-selective": (LLAMA, "selective")}


def _model_worker():
    world, rank = dist.get_world_size(), dist.get_rank()
    single = [dist.new_group([r]) for r in range(world)][rank]
    layouts = ((1, single), (world, None)) if world == 2 else ((world, None),)
    out = {}
    for tp, group in layouts:
        for name, (config, recompute) in MODELS.items():
            torch.manual_seed(0)
            dense = DenseGPT(config).double()
            g = torch.Generator().manual_seed(1)
            ids, targets = (torch.randint(0, 37, (3, 8), generator=g) for _ in range(2))
            dense_loss = dense(ids, targets, step=3)
            dense_loss.backward()
            ref = {n: p.grad for n, p in dense.named_parameters()}
            res = {}
            for overlap in ("none", "ring"):
                options = RunOptions(
                    sequence_parallel=True, recompute=recompute, tp_overlap=overlap
                )
                model = TPGPT(dense, group, options=options).double()
                with CommTracer() as trace:
                    loss = model(ids, targets, step=3)
                    loss.backward()
                model.sync_grads()
                wire = {ph: trace.wire_bytes(phase=ph) for ph in ("forward", "backward")}
                res[overlap] = (loss.detach(), model.gather_state_dict(grads=True), wire)
            (l0, g0, w0), (l1, g1, w1) = res["none"], res["ring"]
            out[(tp, name)] = {
                "loss vs sp": (l1 - l0).abs().item(),
                "loss vs dense": (l1 - dense_loss).abs().item(),
                "grads vs sp": max((g1[k] - g0[k]).abs().max().item() for k in g0),
                "grads vs dense": max((g1[k] - ref[k]).abs().max().item() for k in ref),
                "bitwise": (bool(torch.equal(l0, l1)), sum(torch.equal(g1[k], g0[k]) for k in g0)),
                "wire": (w0, w1),
            }
    return out


def test_ring_model_equals_the_sequence_parallel_model_and_dense():
    """RunOptions(sequence_parallel=True, tp_overlap="ring"): every QKV, fc1 (and up), out, fc2
    and the vocab-parallel head by the ring. float64, dropout on: within 1e-12 of the SP model
    and of dense (the ring's reordered sums and shape-dependent kernels, ≈1e-16 each; measured
    worst 1e-16); the same bytes on the wire, forward and backward."""
    seen = []
    for world in (2, 4):
        for out in launch(_model_worker, world):
            for (tp, name), r in out.items():
                for what in ("loss vs sp", "loss vs dense", "grads vs sp", "grads vs dense"):
                    assert r[what] <= 1e-12, f"tp {tp} {name}: {what} {r[what]:.2e}"
                w0, w1 = r["wire"]
                assert w1 == w0, f"tp {tp} {name}: ring sends {w1}, SP {w0}"
                seen.append((tp, name, *r["bitwise"]))
    print("bitwise (tp, model, loss, gradient tensors):", seen)
