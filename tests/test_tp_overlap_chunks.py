"""Micro-batch-split TP blocks (tpedu/tp/chunked.py, RunOptions(tp_overlap="chunks")) against the
unsplit TP model and the dense one, forward and every gradient, at tp 1, 2, 4, with dropout on.

Tolerance 1e-12 absolute, float64, on losses and gradients of size ≤ ~1 (eps = 2.2e-16): the
chunked block adds each weight's gradient as n chunk products (a sum of b·s row terms in
another order, ≤ b·s·eps·Σ|terms| ≈ 48·2.2e-16·O(1) = 1e-14), its matmuls over b/n rows may round
differently from b rows (≤ K·eps·Σ|terms|, K ≤ 128), and at tp 4 the all-reduces add their 4
terms in a size-dependent order. Measured worst: 1.4e-16. A wrong dropout mask, a chunk in the
wrong place or a missing all-reduce moves them by > 1e-3.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from tests.helpers import overlap_order
from tpedu import launch
from tpedu.comm import recorder
from tpedu.comm.tracer import CommTracer
from tpedu.model.config import GPTConfig
from tpedu.model.dense import DenseGPT
from tpedu.model.gpt import TPGPT
from tpedu.model.options import RunOptions

BASE = {"seq_len": 8, "n_layers": 2, "n_heads": 4, "dropout": 0.1}
GPT2 = GPTConfig.gpt2_like(37, hidden=24, **BASE)
LLAMA = GPTConfig.llama_like(37, hidden=32, **BASE)  # GQA 2 KV heads: replicated at tp 4
CASES = {  # name: (config, recompute, chunks); 6 sequences of 7 positions
    "gpt2-2": (GPT2, "none", 2),
    "gpt2-3-selective": (GPT2, "selective", 3),
    "llama-2": (LLAMA, "none", 2),
    "llama-6-full": (LLAMA, "full", 6),
}
B, S, TOL = 6, 7, 1e-12


def _grads(model):
    model.sync_grads()
    return model.gather_state_dict(grads=True)


def _compare(group):
    out = {}
    for name, (config, recompute, chunks) in CASES.items():
        torch.manual_seed(0)
        dense = DenseGPT(config).double()
        g = torch.Generator().manual_seed(1)
        ids, targets = (torch.randint(0, 37, (B, S), generator=g) for _ in range(2))
        targets[0, :2] = -100
        dense_loss = dense(ids, targets, step=3)
        dense_loss.backward()
        ref = {n: p.grad for n, p in dense.named_parameters()}
        res = {}
        for overlap in ("none", "chunks"):
            options = RunOptions(recompute=recompute, tp_overlap=overlap, tp_chunks=chunks)
            model = TPGPT(dense, group, options=options).double()
            with CommTracer() as trace:
                loss = model(ids, targets, step=3)
                loss.backward()
            calls = [(r.op, r.phase, r.numel) for r in trace.records]
            res[overlap] = (loss.detach(), _grads(model), calls)
        (l0, g0, c0), (l1, g1, c1) = res["none"], res["chunks"]
        out[name] = {
            "loss vs unsplit": (l1 - l0).abs().item(),
            "loss vs dense": (l1 - dense_loss).abs().item(),
            "grads vs unsplit": max((g1[k] - g0[k]).abs().max().item() for k in g0),
            "grads vs dense": max((g1[k] - ref[k]).abs().max().item() for k in ref),
            "bitwise grads": sum(torch.equal(g1[k], g0[k]) for k in g0),
            "grads": len(g0),
            "calls": (c0, c1),
            "chunks": chunks,
        }
    return out


def _worker():
    world, rank = dist.get_world_size(), dist.get_rank()
    single = [dist.new_group([r]) for r in range(world)][rank]
    layouts = ((1, single), (world, None)) if world == 2 else ((world, None),)
    return {tp: _compare(group) for tp, group in layouts}


def _all_reduces(calls, phase):
    return [n for op, ph, n in calls if op == "all_reduce" and ph == phase]


def test_chunked_blocks_equal_the_unsplit_model_and_dense():
    seen = []
    for world in (2, 4):
        for out in launch(_worker, world):
            for tp, cases in out.items():
                for name, r in cases.items():
                    for what in ("loss vs unsplit", "loss vs dense", "grads vs unsplit"):
                        assert r[what] <= TOL, f"tp {tp} {name}: {what} {r[what]:.2e}"
                    assert r["grads vs dense"] <= TOL, f"tp {tp} {name}: {r['grads vs dense']:.2e}"
                    seen.append((tp, name, r["bitwise grads"], r["grads"]))
                    # the same all-reduces, each block's cut into n of 1/n the size
                    n, (c0, c1) = r["chunks"], r["calls"]
                    for phase in ("forward", "backward"):
                        a0, a1 = _all_reduces(c0, phase), _all_reduces(c1, phase)
                        assert sum(a1) == sum(a0), (tp, name, phase)
                        # 2 per block (the embedding's and the head's stay whole); full
                        # recomputation reruns the forward's in backward
                        size = B * S * (24 if "gpt2" in name else 32)
                        split = a0.count(size) - a1.count(size)
                        rerun = 2 if phase == "backward" and "full" in name else 1
                        assert split == 2 * BASE["n_layers"] * rerun, (tp, name, phase, split)
                        assert a1.count(size // n) == n * split, (tp, name, phase)
    print("bitwise gradient tensors (tp, case, equal, of):", seen)


def _order_worker(chunks):
    config = dataclasses.replace(GPT2, n_layers=1)
    torch.manual_seed(0)
    model = TPGPT(DenseGPT(config), options=RunOptions(tp_overlap="chunks", tp_chunks=chunks))
    ids = torch.randint(0, 37, (B, S), generator=torch.Generator().manual_seed(2))
    with recorder.Recorder() as rec:
        model(ids, ids).backward()
    return overlap_order(rec.log)


@pytest.mark.parametrize("chunks", [2, 3])
def test_each_all_reduce_is_waited_for_after_the_next_chunk_computed(chunks):
    """Forward, per half-block: every chunk's all-reduce issued before the first wait (chunk i's
    on the wire while i+1 .. n-1 compute). Backward (autograd: last chunk first): every chunk's
    f issues before any wait, so the last chunk's gradient all-reduce runs under the others'.
    Read from the rank clock: every asynchronous call, named by its chunk, and every wait."""
    issue = [f"issue {i}" for i in range(chunks)]
    wait = [f"wait {i}" for i in range(chunks)]
    back = [f"issue grad {i}" for i in reversed(range(chunks))]
    back += [f"wait grad {i}" for i in reversed(range(chunks))]
    for events in launch(_order_worker, 2, chunks):
        assert events == 2 * (issue + wait) + 2 * back, events


def _bad_worker():
    model = TPGPT(DenseGPT(GPT2), options=RunOptions(tp_overlap="chunks", tp_chunks=4))
    try:
        model(torch.zeros(B, S, dtype=torch.long))
    except ValueError as e:
        return str(e)
    return None


def test_chunk_count_not_dividing_the_batch_and_bad_combinations_are_refused():
    assert launch(_bad_worker, 1)[0] == (
        "tp_chunks = 4 does not divide the micro-batch of 6 sequences; choose a divisor of 6"
    )
    with pytest.raises(ValueError, match="turn sequence parallelism on"):
        RunOptions(tp_overlap="ring")
    with pytest.raises(ValueError, match="with sequence parallelism use tp_overlap 'ring'"):
        RunOptions(tp_overlap="chunks", sequence_parallel=True)
    with pytest.raises(ValueError, match="tp_chunks must be at least 1"):
        RunOptions(tp_overlap="chunks", tp_chunks=0)
