"""The async-all-reduce column-parallel linear: exact, and the all-reduce is issued before dL/dW."""

import torch
import torch.distributed as dist

from tests.helpers import overlap_order
from tpedu import launch
from tpedu.comm import recorder
from tpedu.comm.tracer import CommTracer
from tpedu.model.options import RunOptions
from tpedu.tp.layers import column_parallel_linear
from tpedu.tp.overlap import linear_with_async_grad_all_reduce
from tpedu.tp.sharding import shard


def _worker():
    world, rank = dist.get_world_size(), dist.get_rank()
    singles = [dist.new_group([r]) for r in range(world)]  # tp = 1 inside the same launch
    out = {}
    for tp, group in ((1, singles[rank]), (world, None)):
        g = torch.Generator().manual_seed(7)
        x0 = torch.randn(3, 5, 6, generator=g, dtype=torch.float64)  # uneven b, s, in
        w0 = torch.randn(4 * tp, 6, generator=g, dtype=torch.float64)  # out = 4·tp
        b0 = torch.randn(4 * tp, generator=g, dtype=torch.float64)
        dy = torch.randn(3, 5, 4 * tp, generator=g, dtype=torch.float64)
        res = {}
        for name, fn in (
            ("async", linear_with_async_grad_all_reduce),
            ("plain", column_parallel_linear),
        ):
            x = x0.clone().requires_grad_()
            w = shard(w0, 0, group).requires_grad_()
            b = shard(b0, 0, group).requires_grad_()
            with CommTracer() as t, recorder.Recorder() as rec:
                y = fn(x, w, b, group)
                y.backward(shard(dy, -1, group))
            res[name] = (
                y.detach(),
                x.grad,
                w.grad,
                b.grad,
                overlap_order(rec.log),
                t.count("all_reduce", "forward"),
                t.numel("all_reduce", "backward"),
                t.count("all_reduce", "backward"),
            )
        # dense reference: the full layer on one process
        x = x0.clone().requires_grad_()
        w, b = w0.clone().requires_grad_(), b0.clone().requires_grad_()
        torch.nn.functional.linear(x, w, b).backward(dy)
        res["dense"] = (x.grad, shard(w.grad, 0, group), shard(b.grad, 0, group))
        # an input that needs no gradient: nothing to all-reduce
        with recorder.Recorder() as rec:
            y = linear_with_async_grad_all_reduce(
                x0, shard(w0, 0, group).requires_grad_(), None, group
            )
            y.sum().backward()
        res["no_input_grad"] = overlap_order(rec.log)
        out[tp] = res
    return out


def test_async_linear_is_bitwise_the_plain_layer_and_overlaps():
    for world in (2, 4):
        for rank, out in enumerate(launch(_worker, world)):
            for tp, res in out.items():
                a, p = res["async"], res["plain"]
                for i, what in enumerate(("y", "dL/dx", "dL/dW", "dL/db")):
                    # the same matmuls in the same order: bitwise equal, not just close
                    diff = (a[i] - p[i]).abs().max().item()
                    assert diff == 0.0, f"tp={tp} rank {rank}: {what} max |diff| = {diff:.1e}"
                dx, dw, db = res["dense"]
                for got, ref, what in (
                    (a[1], dx, "dL/dx"),
                    (a[2], dw, "dL/dW"),
                    (a[3], db, "dL/db"),
                ):
                    diff = (got - ref).abs().max().item()
                    # the all-reduce adds t partial sums: reordered fp64 sums, ~1e-16 relative
                    assert diff <= 1e-13, f"tp={tp}: {what} vs dense, max |diff| = {diff:.1e}"
                # on the rank clock: issued asynchronously before the weight gradient's
                # compute span, waited for after it
                assert a[4] == ["issue all_reduce", "weight grad", "wait all_reduce"], a[4]
                assert p[4] == []  # the plain layer's all-reduce blocks: nothing overlaps
                # communication contract: nothing forward, 1 all-reduce of x's size backward
                assert a[5] == 0 and a[7] == 1 and a[6] == 3 * 5 * 6
                assert (p[5], p[6], p[7]) == (a[5], a[6], a[7])
                assert res["no_input_grad"] == ["weight grad"]


def _model_worker(activation):
    from tpedu.model.config import GPTConfig
    from tpedu.model.dense import DenseGPT
    from tpedu.model.gpt import TPGPT

    config = GPTConfig(
        37,
        seq_len=6,
        n_layers=2,
        hidden=16,
        n_heads=4,
        activation=activation,
        dropout=0.1,
        tie_embeddings=False,
    )
    torch.manual_seed(0)
    dense = DenseGPT(config)
    ids = torch.randint(0, 37, (3, 6), generator=torch.Generator().manual_seed(1))
    out = {}
    for overlap in (False, True):
        model = TPGPT(dense, None, options=RunOptions(overlap_comm=overlap))
        with recorder.Recorder() as rec:
            loss = model(ids, ids)
            loss.backward()
        grads = [p.grad for p in model.parameters()]
        out[overlap] = (loss.detach(), grads, overlap_order(rec.log))
    return out


def test_overlap_comm_in_the_model_is_bitwise_identical():
    """RunOptions(overlap_comm=True): every f in front of a column-parallel matmul (QKV, fc1, the
    head) issues its backward all-reduce asynchronously; losses and gradients are bitwise equal."""
    for activation, asyncs in (("gelu", 2 * 2 + 1), ("swiglu", 2 + 1)):  # SwiGLU keeps its f
        for r, out in enumerate(launch(_model_worker, 2, activation)):
            (l0, g0, o0), (l1, g1, o1) = out[False], out[True]
            # each async all-reduce issued, its weight gradient computed, then waited for
            each = ["issue all_reduce", "weight grad", "wait all_reduce"]
            assert o0 == [] and o1 == each * asyncs, f"rank {r} {activation}: {o0}, {o1}"
            assert torch.equal(l0, l1), f"rank {r}: loss {l0.item()} vs {l1.item()}"
            diff = max((a - b).abs().max().item() for a, b in zip(g0, g1, strict=True))
            assert diff == 0.0, f"rank {r} {activation}: max |grad difference| = {diff:.3e}"
