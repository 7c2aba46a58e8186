"""Sequence parallelism (tpedu/tp/sequence_parallel.py and the model's switch) against the dense GPT.

Tolerances: float64; the only differences from the dense model are sums reordered by the
reduce-scatters, the LayerNorm-gradient all-reduce and the row-parallel partial sums (≈1e-16
relative each); 1e-10 leaves room for their accumulation over the layers and still catches any
real error (a missing all-reduce or a wrong shard shifts gradients by > 1e-3, asserted below).
"""

import dataclasses

import pytest
import torch
import torch._dynamo  # recompute's checkpoint imports it: once here, not per rank
import torch.distributed as dist

from tpedu import launch
from tpedu.comm.tracer import CommTracer
from tpedu.model.config import GPTConfig
from tpedu.model.dense import DenseGPT
from tpedu.model.gpt import TPGPT
from tpedu.model.options import RunOptions
from tpedu.parallel.config import ParallelConfig
from tpedu.tp.sequence_parallel import (
    all_gather_linear,
    all_reduce_sequence_parallel_grads,
    check_sequence_length,
    sequence_chunk,
    sequence_parallel_params,
)

BASE = {"seq_len": 12, "n_layers": 2, "n_heads": 4, "dropout": 0.1}
GPT2 = GPTConfig.gpt2_like(37, hidden=24, **BASE)
# GQA with 2 KV heads: split at tp 2, replicated at tp 4; RoPE, RMSNorm, SwiGLU, untied head.
LLAMA = GPTConfig.llama_like(37, hidden=32, **BASE)
CONFIGS = {  # name: (model config, recompute); every one sequence parallel
    "gpt2": (GPT2, "none"),
    "llama": (LLAMA, "none"),
    "replicated-embedding": (dataclasses.replace(GPT2, vocab_parallel=False), "none"),
    "gpt2-selective": (GPT2, "selective"),
    "llama-full": (LLAMA, "full"),
}
B, S = 3, 8  # S divides by 1, 2, 4


def _batch(config):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (B, S), generator=g)
    targets = torch.randint(0, config.vocab_size, (B, S), generator=g)
    targets[0, :3] = -100
    return ids, targets


def _max_diff(a, b):
    return (a - b).abs().max().item()


def compare_all(names):
    """Per config: loss/logit/grad/norm differences from dense, and the gradients without the
    sequence-parallel all-reduce (the bug)."""
    out = {}
    for name in names:
        config, recompute = CONFIGS[name]
        torch.manual_seed(0)
        dense = DenseGPT(config).double()
        model = TPGPT(
            dense, options=RunOptions(sequence_parallel=True, recompute=recompute)
        ).double()
        ids, targets = _batch(config)
        dense_loss = dense(ids, targets, step=3)
        dense_loss.backward()
        loss = model(ids, targets, step=3)
        loss.backward()
        model.sync_grads(sequence_parallel_grads=False)  # the bug: norms see 1/t of the sequence
        buggy = model.gather_state_dict(grads=True)
        all_reduce_sequence_parallel_grads(sequence_parallel_params(model), model.group)  # the fix
        fixed = model.gather_state_dict(grads=True)
        dense_grads = {n: p.grad for n, p in dense.named_parameters()}
        names = {id(p): n for n, p in model.named_parameters()}
        with torch.no_grad():
            logits = _max_diff(model.full_logits(ids), dense(ids))
        out[name] = {
            "loss": abs(loss.item() - dense_loss.item()),
            "logits": logits,
            "grads": {k: _max_diff(fixed[k], dense_grads[k]) for k in dense_grads},
            # relative to the gradient's size (block 0's norm gradients are tiny at init)
            "buggy": {
                k: _max_diff(buggy[k], g) / g.abs().max().clamp_min(1e-30).item()
                for k, g in dense_grads.items()
            },
            "sp_params": sorted(names[id(p)] for p in sequence_parallel_params(model)),
            "norm": (
                model.grad_norm().item(),
                torch.nn.utils.get_total_norm(dense_grads.values()).item(),
            ),
        }
    return out


@pytest.mark.parametrize(
    "tp, names",
    [(2, list(CONFIGS)), (4, ["gpt2", "llama"])],  # tp=4: the two required, for time
)
def test_sequence_parallel_gpt_equals_dense(tp, names):
    """Forward and backward, dropout on, gpt2- and llama-like, both recompute modes; and with the
    norm-gradient all-reduce removed, exactly the sequence-parallel parameters are wrong."""
    for rank, results in enumerate(launch(compare_all, tp, names)):
        for name, r in results.items():
            where = f"{name} tp={tp} rank {rank}"
            assert r["loss"] < 1e-12, f"{where}: loss differs by {r['loss']:.1e}"
            assert r["logits"] < 1e-10, f"{where}: logits differ by {r['logits']:.1e}"
            for key, diff in r["grads"].items():
                assert diff < 1e-10, f"{where}: grad of {key} differs by {diff:.1e}"
            assert r["norm"][0] == pytest.approx(r["norm"][1], rel=1e-12), where
            wrong = {k for k, d in r["buggy"].items() if d > 1e-2}  # relative
            # Each rank's norm/bias/position gradient covers only its s/t positions.
            expected = {
                k
                for k in r["grads"]
                if ("norm" in k or k.endswith(("out.bias", "fc2.bias")) or k == "pos_emb.weight")
            }
            assert wrong == expected, f"{where}: without the SP all-reduce, wrong grads {wrong}"
            assert {k for k, d in r["buggy"].items() if d > 1e-10} == expected  # nothing else
            marked = set(r["sp_params"])
            assert marked == expected, f"{where}: marked {marked}"


def trace_model(sp: bool, recompute: str = "none"):
    torch.manual_seed(0)
    model = TPGPT(
        DenseGPT(GPT2), options=RunOptions(sequence_parallel=sp, recompute=recompute)
    ).double()
    ids, targets = _batch(GPT2)
    with CommTracer() as trace:
        model(ids, targets).backward()
        model.sync_grads()
    return trace.summary(), trace.wire_bytes(phase="forward"), trace.wire_bytes(phase="backward")


def trace_all():
    return {key: trace_model(*key) for key in ((False, "none"), (True, "none"), (True, "full"))}


def test_sequence_parallel_communication_contract():
    """Per block: forward 2 all-gathers + 2 reduce-scatters of b·s·H instead of 2 all-reduces
    (the same wire bytes: a ring all-reduce is a reduce-scatter + an all-gather); backward the
    conjugates plus 1 all-gather per column-parallel input (only the shard was saved)."""
    t = 2
    traces = launch(trace_all, t)[0]
    (tp, tp_fwd, tp_bwd), (sp, sp_fwd, sp_bwd) = traces[(False, "none")], traces[(True, "none")]
    layers, h = GPT2.n_layers, GPT2.hidden
    bsh = B * S * h
    n = 2 * layers + 1  # 2 per block, + the embedding (forward) / the LM head (backward)
    assert sp[("world", "reduce_scatter", "forward")] == (n, n * bsh, 8 * n * bsh)
    assert sp[("world", "all_gather", "forward")] == (n, n * bsh, 8 * n * bsh)
    assert sp[("world", "reduce_scatter", "backward")] == (n, n * bsh, 8 * n * bsh)
    assert sp[("world", "all_gather", "backward")] == (2 * n, 2 * n * bsh, 16 * n * bsh)
    # Only the loss's 3 small all-reduces remain, and the one gradient all-reduce of the
    # sequence-parallel parameters (2 LayerNorms (2h) + 2 row biases (h) per block, norm_f,
    # positions).
    assert sp[("world", "all_reduce", "forward")][:2] == (3, 3 * B * S)
    sp_numel = layers * 6 * h + 2 * h + GPT2.seq_len * h
    assert sp[("world", "all_reduce", "grad_sync")][:2] == (1, sp_numel)
    assert ("world", "all_reduce", "backward") not in sp
    assert tp[("world", "all_reduce", "forward")][:2] == (n + 3, n * bsh + 3 * B * S)
    ring = (t - 1) / t * 8 * bsh  # one reduce-scatter or all-gather of b·s·H float64 on the wire
    assert sp_fwd == pytest.approx(tp_fwd)  # same bytes forward
    assert sp_bwd == pytest.approx(tp_bwd + n * ring)  # + the re-gathers
    # Full recomputation replays the forward's collectives inside the backward.
    full = traces[(True, "full")][0]
    assert full[("world", "all_gather", "backward")][0] == 2 * n + 2 * layers
    assert full[("world", "reduce_scatter", "backward")][0] == n + 2 * layers


def gather_linear_vs_dense():
    """all_gather_linear with two weights (SwiGLU's gate and up) against plain matmuls."""
    t, r = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3 * t, 5, dtype=torch.float64, generator=g)
    w1, w2 = (torch.randn(7 * t, 5, dtype=torch.float64, generator=g) for _ in range(2))
    b1 = torch.randn(7 * t, dtype=torch.float64, generator=g)
    grads = [torch.randn(2, 3 * t, 7 * t, dtype=torch.float64, generator=g) for _ in range(2)]
    dense = [p.clone().requires_grad_() for p in (x, w1, b1, w2)]
    y1, y2 = dense[0] @ dense[1].T + dense[2], dense[0] @ dense[3].T
    ((y1 * grads[0]).sum() + (y2 * grads[1]).sum()).backward()
    rows = slice(7 * r, 7 * (r + 1))
    shard = sequence_chunk(x, None).requires_grad_()
    local = [p[rows].clone().requires_grad_() for p in (w1, b1, w2)]
    with CommTracer() as trace:
        o1, o2 = all_gather_linear(shard, [local[0], local[2]], [local[1], None])
        ((o1 * grads[0][..., rows]).sum() + (o2 * grads[1][..., rows]).sum()).backward()
    diffs = [
        _max_diff(o1, y1[..., rows]),
        _max_diff(o2, y2[..., rows]),
        _max_diff(shard.grad, sequence_chunk(dense[0].grad, None)),
        _max_diff(local[0].grad, dense[1].grad[rows]),
        _max_diff(local[1].grad, dense[2].grad[rows]),
        _max_diff(local[2].grad, dense[3].grad[rows]),
    ]
    return diffs, trace.summary()


@pytest.mark.parametrize("t", [1, 3])
def test_all_gather_linear_equals_dense(t):
    for diffs, summary in launch(gather_linear_vs_dense, t):
        assert max(diffs) < 1e-12, f"max |difference| = {max(diffs):.1e} ({diffs})"
        numel = 2 * 3 * t * 5
        assert summary[("world", "all_gather", "forward")][:2] == (1, numel)
        # One backward for both outputs: 1 re-gather + 1 reduce-scatter (not one per weight).
        assert summary[("world", "all_gather", "backward")][:2] == (1, numel)
        assert summary[("world", "reduce_scatter", "backward")][:2] == (1, numel)


def wrong_length():
    model = TPGPT(DenseGPT(GPT2), options=RunOptions(sequence_parallel=True))
    ids = torch.zeros(1, 6, dtype=torch.long)
    with pytest.raises(ValueError, match=r"s = 6 is not divisible by tp=4.*1, 2, 3, 6"):
        model(ids)
    return True


def test_sequence_length_must_divide_tp():
    with pytest.raises(ValueError, match=r"s = 12 is not divisible by tp=5"):
        check_sequence_length(12, 5)
    ten = dataclasses.replace(GPT2, seq_len=10)
    with pytest.raises(ValueError, match=r"sequence length s = 10 is not divisible by tp=4"):
        ParallelConfig(tp=4, sequence_parallel=True).check(ten)
    ParallelConfig(tp=4).check(ten)  # fine without sequence parallelism
    with pytest.raises(ValueError, match="recompute must be one of"):
        ParallelConfig(recompute="some")
    assert launch(wrong_length, 4) == [True] * 4  # the batch's own s, at run time


def mlp_contract():
    """ParallelMLP with sequence parallelism (GELU and SwiGLU, dropout on) against DenseMLP."""
    from tpedu.tp.dense import DenseMLP
    from tpedu.tp.mlp import ParallelMLP

    t = dist.get_world_size()
    out = {}
    for act in ("gelu_tanh", "swiglu"):
        torch.manual_seed(0)
        dense = DenseMLP(10, 8 * t, act, output_dropout=0.2, seed=3).double()
        mlp = ParallelMLP.from_dense(dense, None, sequence_parallel=True)
        x = torch.randn(3, 2 * t, 10, dtype=torch.float64, requires_grad=True)
        g = torch.randn(3, 2 * t, 10, dtype=torch.float64)
        (dense(x, step=4) * g).sum().backward()
        shard = sequence_chunk(x.detach(), None).requires_grad_()
        with CommTracer() as trace:
            y = mlp(shard, step=4)
            (y * sequence_chunk(g, None)).sum().backward()
        with torch.no_grad():
            want = sequence_chunk(dense(x, step=4), None)
        out[act] = (
            _max_diff(y, want),
            _max_diff(shard.grad, sequence_chunk(x.grad, None)),
            [(r.op, r.phase, r.numel) for r in trace.records],
        )
    return out


@pytest.mark.parametrize("t", [2, 4])
def test_sequence_parallel_mlp_contract(t):
    for results in launch(mlp_contract, t):
        for act, (fwd, bwd, calls) in results.items():
            assert fwd < 1e-12 and bwd < 1e-12, (
                f"t={t} {act}: forward {fwd:.1e}, backward {bwd:.1e}"
            )
            n = 3 * 2 * t * 10  # b·s·H of the full sequence
            # forward: g (all-gather), ḡ (reduce-scatter); backward: ḡ's all-gather, then
            # all_gather_linear's re-gather and reduce-scatter (one for gate and up together)
            assert calls == [
                ("all_gather", "forward", n),
                ("reduce_scatter", "forward", n),
                ("all_gather", "backward", n),
                ("all_gather", "backward", n),
                ("reduce_scatter", "backward", n),
            ], f"t={t} {act}: {calls}"
