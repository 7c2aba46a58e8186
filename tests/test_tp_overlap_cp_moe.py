"""Micro-batch-split TP blocks (RunOptions(tp_overlap="chunks"), tpedu/tp/chunked.py) with context
parallelism and with a mixture of experts, against the unsplit model (and the dense one), forward
and every gradient (cp 2 × tp 1, 2; experts at tp 1, 2, 4 and ep 2; cp 2 × ep 2); `train
--tp-overlap chunks` at (tp 2, cp 2) and (tp 2, ep 2) against the run without; tp_overlap "ring"
with CP or experts is a one-line error before any rank starts.

CP: each chunk's attention core is ring or Ulysses attention over the CP group on b/n sequences.
Experts: the attention half is chunked, the MoE half runs on the whole batch, so routing, capacity
(which tokens are dropped) and the auxiliary losses are the unsplit block's.

Tolerance 1e-12 absolute, float64, as tests/test_tp_overlap_chunks.py argues: the chunks reorder
sums of O(1) terms (a weight gradient as n chunk products, matmuls over b/n rows), ≈1e-14 at
worst. Measured worst (printed with -s): losses 1.3e-15 from dense and bitwise equal to the
unsplit model's, gradients 8.3e-17, the aux and z losses bitwise. Measured breakages: chunks
1 .. n-1 attending locally instead of over CP moves the loss by 5.6e-5; the MoE routed per chunk
a gradient by 1.0e-2; the chunks joined in reverse before the MoE the loss by 4.6e-4.
"""

import dataclasses
import json
import re

import pytest
import torch
import torch.distributed as dist

from tests.helpers import cli, one_line_error
from tpedu import launch
from tpedu.comm.tracer import CommTracer
from tpedu.cp.context import ContextParallel
from tpedu.cp.gradients import sum_over_cp
from tpedu.cp.ring import split_sequence
from tpedu.model.config import GPTConfig
from tpedu.model.dense import DenseGPT
from tpedu.model.gpt import TPGPT
from tpedu.model.options import RunOptions
from tpedu.parallel.config import ParallelConfig

V, B, TOL = 37, 6, 1e-12

# CP: odd head size 5 (GPT-2), RoPE with GQA (Llama); seq 16 splits zig-zag over cp 2
CP_CONFIGS = {
    "gpt2": GPTConfig.gpt2_like(V, seq_len=16, n_layers=2, hidden=20, n_heads=4),
    "llama": GPTConfig.llama_like(V, seq_len=16, n_layers=2, hidden=24, n_heads=4, n_kv_heads=2),
}
CP_CASES = {  # name: (config, strategy, layout, recompute, chunks)
    "gpt2-ring-3": ("gpt2", "ring", "zigzag", "none", 3),
    "llama-ring-2-full": ("llama", "ring", "contiguous", "full", 2),
    "gpt2-ulysses-3": ("gpt2", "ulysses", "contiguous", "selective", 3),
    "llama-ulysses-6": ("llama", "ulysses", "zigzag", "none", 6),  # kv 2/tp: tp 1 only
}

MOE_SHAPE = {"seq_len": 8, "n_layers": 2, "hidden": 20, "n_heads": 4, "dropout": 0.1}
MOE = GPTConfig.gpt2_like(V, **MOE_SHAPE, experts=4, top_k=2, z_loss_coef=1e-3)
MOE_CONFIGS = {
    "gpt2": MOE,
    "llama-shared": GPTConfig.llama_like(
        V,
        **{**MOE_SHAPE, "hidden": 24},
        n_kv_heads=2,
        experts=4,
        top_k=1,
        moe_every=2,
        shared_expert=True,
        router_renormalize=False,
        z_loss_coef=1e-3,
    ),
    "dropping": dataclasses.replace(MOE, capacity_factor=0.5),
}


def _groups(tp):
    """(TP group, the other axis' group) with ranks = tp_rank + tp · other_rank, as the mesh."""
    world, rank = dist.get_world_size(), dist.get_rank()
    n = world // tp
    tps = [dist.new_group(list(range(c * tp, (c + 1) * tp))) for c in range(n)]
    others = [dist.new_group(list(range(t, world, tp))) for t in range(tp)]
    return tps[rank // tp], others[rank % tp]


def _sums(trace, recompute="none"):
    """Elements moved per (op, group, phase): the chunks must move the same. Under full
    recomputation backward's all-reduces are left out: the recomputation stops after the last
    tensor backward needs, which skips the block's last all-reduce unsplit but only the last
    chunk's when chunked (without dropout nothing is saved after it)."""
    out = {}
    for r in trace.records:
        if recompute == "full" and r.op == "all_reduce" and r.phase == "backward":
            continue
        out[r.op, r.group, r.phase] = out.get((r.op, r.group, r.phase), 0) + r.numel
    return out


def _worst(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in b)


def _cp_worker(tp):
    torch.set_default_dtype(torch.float64)
    tp_group, cp_group = _groups(tp)
    cp, cp_rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    out = {}
    for name, (cfg, strategy, layout, recompute, chunks) in CP_CASES.items():
        config = CP_CONFIGS[cfg]
        if strategy == "ulysses" and (config.kv_heads // tp) % cp:
            continue  # Ulysses needs cp to divide the KV heads per TP rank
        torch.manual_seed(0)
        dense = DenseGPT(config)
        g = torch.Generator().manual_seed(1)
        ids, tgt = (torch.randint(0, V, (B, config.seq_len), generator=g) for _ in range(2))
        tgt[0, 3] = -100
        want = dense(ids, tgt)
        want.backward()
        ref = {k: p.grad for k, p in dense.named_parameters()}
        mine = [split_sequence(t, cp, cp_rank, layout, dim=1) for t in (ids, tgt)]
        res = {}
        for overlap in ("none", "chunks"):
            options = RunOptions(
                context=ContextParallel(cp_group, strategy, layout),
                recompute=recompute,
                tp_overlap=overlap,
                tp_chunks=chunks,
            )
            model = TPGPT(dense, tp_group, options=options)
            with CommTracer() as trace:
                loss = model(*mine, step=2)
                loss.backward()
            model.sync_grads()
            sum_over_cp(model.parameters(), cp_group)
            grads = model.gather_state_dict(grads=True)
            res[overlap] = (loss.detach(), grads, _sums(trace, recompute))
        (l0, g0, s0), (l1, g1, s1) = res["none"], res["chunks"]
        out[name] = {
            "loss vs unsplit": (l1 - l0).abs().item(),
            "loss vs dense": (l1 - want).abs().item(),
            "grads vs unsplit": _worst(g1, g0),
            "grads vs dense": _worst(g1, ref),
            "same traffic": s0 == s1,
            "keys": sorted(g1) == sorted(ref),
        }
    return out


@pytest.mark.parametrize(("tp", "world"), [(1, 2), (2, 4)])
def test_chunks_with_context_parallelism_equal_the_unsplit_model_and_dense(tp, world):
    """cp 2, tp 1 and 2: ring and Ulysses, zig-zag and contiguous, recompute none, selective,
    full; 6 sequences in 2, 3 or 6 chunks. The chunks move the same elements per collective and
    group (CP's sends and all-to-alls included), cut n ways."""
    worst = {}
    for rank, out in enumerate(launch(_cp_worker, world, tp)):
        assert len(out) == (4 if tp == 1 else 3), out.keys()
        for name, r in out.items():
            for what in ("loss vs unsplit", "loss vs dense", "grads vs unsplit", "grads vs dense"):
                assert r[what] <= TOL, f"tp {tp} cp 2 {name} rank {rank}: {what} {r[what]:.2e}"
                worst[what] = max(worst.get(what, 0.0), r[what])
            assert r["keys"] and r["same traffic"], (tp, name, rank)
    print(f"tp {tp} cp 2, worst:", {k: f"{v:.1e}" for k, v in worst.items()})


def _moe_worker(tp, ep):
    torch.set_default_dtype(torch.float64)
    tp_group, ep_group = _groups(tp)
    ep_rank = dist.get_rank(ep_group)
    out = {}
    for name, config in MOE_CONFIGS.items():
        torch.manual_seed(0)
        dense = DenseGPT(config)
        g = torch.Generator().manual_seed(1)
        # each EP rank its own 6 sequences (EP is carved from DP); ep 1: the dense batch
        ids, tgt = (torch.randint(0, V, (ep, B, config.seq_len), generator=g) for _ in range(2))
        ids, tgt = ids[ep_rank], tgt[ep_rank]
        tgt[0, :2] = -100
        res = {}
        for overlap in ("none", "chunks"):
            options = RunOptions(
                ep_group=ep_group if ep > 1 else None, tp_overlap=overlap, tp_chunks=3
            )
            model = TPGPT(dense, tp_group, options=options)
            with CommTracer() as trace:
                loss = model(ids, tgt, step=2)
                loss.backward()
            model.sync_grads()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            moe = [b.moe_stats for b in model.blocks if b.moe_stats is not None]
            res[overlap] = (loss.detach(), grads, moe, _sums(trace))
        (l0, g0, m0, s0), (l1, g1, m1, s1) = res["none"], res["chunks"]
        r = {
            "loss vs unsplit": (l1 - l0).abs().item(),
            "grads vs unsplit": _worst(g1, g0),
            "aux vs unsplit": max(
                abs(a.aux_loss - b.aux_loss).item() for a, b in zip(m0, m1, strict=True)
            ),
            "z vs unsplit": max(
                abs(a.z_loss - b.z_loss).item() for a, b in zip(m0, m1, strict=True)
            ),
            "same routing": all(
                torch.equal(a.tokens_per_expert, b.tokens_per_expert) and a.dropped == b.dropped
                for a, b in zip(m0, m1, strict=True)
            ),
            "dropped": sum(m.dropped for m in m1),
            "same traffic": s0 == s1,
        }
        if ep == 1:  # TPGPT at ep 1 is the dense model, dropout and dropping included
            want = dense(ids, tgt, step=2)
            want.backward()
            ref = {k: p.grad for k, p in dense.named_parameters()}
            r["loss vs dense"] = (l1 - want).abs().item()
            r["grads vs dense"] = _worst(model.gather_state_dict(grads=True), ref)
        out[name] = r
    return out


@pytest.mark.parametrize(
    ("tp", "ep", "world"), [(1, 1, 1), (2, 1, 2), (4, 1, 4), (1, 2, 2), (2, 2, 4)]
)
def test_chunks_with_experts_equal_the_unsplit_model(tp, ep, world):
    """Experts at tp 1, 2, 4 (ep 1: and the dense model) and ep 2 (tp 1, 2): dropout 0.1, the
    auxiliary and z losses in the loss, dropless and dropping (capacity 0.5): loss, every
    gradient, the aux and z losses, the tokens per expert and the dropped count. The TP
    all-reduces of the attention half are cut in chunks; the MoE's collectives unchanged."""
    worst = {}
    for rank, out in enumerate(launch(_moe_worker, world, tp, ep)):
        for name, r in out.items():
            for what, v in r.items():
                if "vs" in what:
                    assert v <= TOL, f"tp {tp} ep {ep} {name} rank {rank}: {what} {v:.2e}"
                    worst[what] = max(worst.get(what, 0.0), v)
            assert r["same routing"] and r["same traffic"], (tp, ep, name, rank)
            assert (r["dropped"] > 0) == (name == "dropping"), (tp, ep, name, r["dropped"])
    print(f"tp {tp} ep {ep}, worst:", {k: f"{v:.1e}" for k, v in worst.items()})


def _cp_moe_worker(strategy):
    torch.set_default_dtype(torch.float64)
    cp_group, ep_group = _groups(2)  # cp: consecutive ranks, ep: strided (carved from DP)
    tp_group = [dist.new_group([r]) for r in range(4)][dist.get_rank()]  # tp 1
    cp_rank, ep_rank = dist.get_rank(cp_group), dist.get_rank(ep_group)
    out = {}
    for name in ("gpt2", "dropping"):
        config = dataclasses.replace(MOE_CONFIGS[name], dropout=0.0, seq_len=16)
        torch.manual_seed(0)
        dense = DenseGPT(config)
        g = torch.Generator().manual_seed(1)
        ids, tgt = (torch.randint(0, V, (2, B, 16), generator=g)[ep_rank] for _ in range(2))
        mine = [split_sequence(t, 2, cp_rank, "zigzag", dim=1) for t in (ids, tgt)]
        res = {}
        for overlap in ("none", "chunks"):
            options = RunOptions(
                context=ContextParallel(cp_group, strategy),
                ep_group=ep_group,
                tp_overlap=overlap,
                tp_chunks=3,
            )
            model = TPGPT(dense, tp_group, options=options)
            with CommTracer() as trace:
                loss = model(*mine, step=2)
                loss.backward()
            model.sync_grads()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            res[overlap] = (loss.detach(), grads, _sums(trace))
        (l0, g0, s0), (l1, g1, s1) = res["none"], res["chunks"]
        out[name] = ((l1 - l0).abs().item(), _worst(g1, g0), s0 == s1)
    return out


@pytest.mark.parametrize("strategy", ["ring", "ulysses"])
def test_chunks_with_context_parallelism_and_experts_equal_the_unsplit_model(strategy):
    """cp 2 × ep 2 (4 ranks, tp 1), dropless and dropping: each chunk's attention over CP, the
    MoE on the whole micro-batch of this rank's positions: loss and every local gradient."""
    for rank, out in enumerate(launch(_cp_moe_worker, 4, strategy)):
        for name, (loss, grads, same) in out.items():
            assert loss <= TOL and grads <= TOL, f"{strategy} {name} rank {rank}: {loss} {grads}"
            assert same, (strategy, name, rank)


# --- the CLI --------------------------------------------------------------------------------

TINY = "--layers 2 --hidden 32 --heads 4 --seq 16 --steps 3 --eval-every 1".split()
LAYOUTS = {
    "tp2-cp2": "--tp 2 --cp 2 --batch 4 --dropout 0".split(),
    "tp2-ep2": "--tp 2 --dp 2 --ep 2 --experts 4 --batch 8 --dropout 0.1".split(),
}


def _train(capfd, path, *args):
    code, _, err = cli(capfd, "train", *args, *TINY, "--json", str(path))
    assert code == 0, err
    return json.loads(path.read_text())


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cli_chunks_match_the_run_without(layout, tmp_path, capfd):
    """3 float32 steps: losses, gradient norms and validation losses within 1e-6 relative, as
    tests/test_cli_tp_overlap.py argues."""
    ref = _train(capfd, tmp_path / "none.json", *LAYOUTS[layout])
    got = _train(capfd, tmp_path / "chunks.json", *LAYOUTS[layout], "--tp-overlap", "chunks")
    assert got["settings"]["parallel"]["tp_overlap"] == "chunks"
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"], strict=True)):
        assert a == pytest.approx(b, rel=1e-6), f"{layout} step {step}: {a} vs {b}"
    for h, hr in zip(got["history"], ref["history"], strict=True):
        assert h["grad_norm"] == pytest.approx(hr["grad_norm"], rel=1e-6), layout
        assert h["val_loss"] == pytest.approx(hr["val_loss"], rel=1e-6), layout


RING = "tp_overlap 'ring' needs sequence parallelism, which {} does not support; use --tp-overlap "
CP_RING = RING.format("context parallelism") + "chunks (or none) with --cp"
MOE_RING = RING.format("a mixture of experts") + "chunks (or none) with --experts"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--cp", "2", "--dropout", "0"], CP_RING),
        (["--cp", "2", "--dropout", "0", "--sequence-parallel"], CP_RING),
        (["--experts", "4"], MOE_RING),
        (["--experts", "4", "--sequence-parallel"], MOE_RING),
        (["--experts", "4", "--dp", "2", "--ep", "2"], MOE_RING),
    ],
)
def test_ring_with_cp_or_experts_is_a_one_line_error(flags, message, capfd):
    """Refused before any rank starts (exit code 2), naming the fix."""
    args = ["train", "--tp", "2", "--batch", "4", *TINY, "--tp-overlap", "ring", *flags]
    one_line_error(capfd, args, message)


def _ring_model(what):
    g = dist.new_group([0, 1])
    if what == "cp":
        config, options = CP_CONFIGS["gpt2"], RunOptions(context=ContextParallel(g))
    else:
        config, options = MOE, RunOptions()
    options = dataclasses.replace(options, sequence_parallel=True, tp_overlap="ring")
    try:
        TPGPT(DenseGPT(config), None if what == "cp" else g, options=options)
    except ValueError as e:
        return str(e)
    return None


def test_ring_with_cp_or_experts_is_refused_by_the_model_and_the_config():
    assert launch(_ring_model, 2, "cp")[0] == CP_RING
    assert launch(_ring_model, 2, "experts")[0] == MOE_RING
    for kw in ({"cp": 2}, {"ep": 2, "dp": 2}):
        with pytest.raises(ValueError, match="needs sequence parallelism, which"):
            ParallelConfig(tp=2, tp_overlap="ring", sequence_parallel=True, **kw)
    with pytest.raises(ValueError, match=re.escape(MOE_RING)):
        ParallelConfig(tp=2, tp_overlap="ring", sequence_parallel=True).check(MOE)
    # chunks: accepted with CP and with experts
    ParallelConfig(tp=2, cp=2, tp_overlap="chunks").check(CP_CONFIGS["gpt2"])
    ParallelConfig(tp=2, dp=2, ep=2, tp_overlap="chunks").check(MOE)
