"""ZeRO-1, -2 and -3 (FSDP): training equals one process (and plain DP) step by step, with TP
and PP around it; the traffic and the memory per rank equal the formulas; checkpoints move
between ZeRO stages.

float64 runs (F64, as tests/test_train_3d.py): a reduce-scatter sums in another order than an
all-reduce (≈1e-16 relative per sum), so 1e-10 relative after 3 AdamW steps is sharp; a missing
1/N or a shard updated twice moves the gradient norm by a factor, far outside it.
"""

import contextlib
import dataclasses

import pytest
import torch

from tests.helpers import CFG, CONFIG, F64, V, check, data, f64
from tpedu import checkpoint, launch
from tpedu.comm import recorder
from tpedu.comm.recorder import Mark
from tpedu.comm.tracer import CommTracer
from tpedu.data.batches import packed_batch
from tpedu.model.config import GPTConfig
from tpedu.model.sharded_init import build_sharded
from tpedu.parallel.config import ParallelConfig
from tpedu.parallel.mesh import Layout, Mesh
from tpedu.train.config import TrainConfig
from tpedu.train.loop import train
from tpedu.train.optim import make_sharded

# Llama-style, one KV head over tp = 2 (replicated KV heads), sequence parallel: the gradient
# fix-ups ZeRO must run before it reduce-scatters (deferred buffers).
GQA = GPTConfig.llama_like(V, seq_len=8, n_layers=2, hidden=16, n_heads=2, n_kv_heads=1)
DEEP = dataclasses.replace(CONFIG, n_layers=4)  # a peak of 2 of 4 blocks shows the frees


@pytest.fixture(scope="module")
def one_process():
    tr, va = data()
    return {c.norm: launch(f64, 1, train, c, CFG, tr, va)[0] for c in (CONFIG, GQA)}


def run(layout, config=CONFIG, cfg=CFG, **kw):
    tr, va = data()
    parallel = ParallelConfig(*layout, **kw)
    return launch(f64, parallel.world, train, config, cfg, tr, va, parallel=parallel)


@pytest.mark.parametrize(
    "zero, layout",
    [(z, lay) for z in (2, 3) for lay in ((1, 1, 2), (1, 1, 4), (2, 1, 2), (1, 2, 2))]
    + [(1, (1, 1, 4)), (1, (2, 1, 2))],  # ZeRO-1 with a pipeline: tests/test_train_3d.py
)
def test_zero_trains_like_one_process(one_process, zero, layout):
    """dp 2 and 4; FSDP × TP (tp 2 × dp 2); with a pipeline (pp 2 × dp 2, tied embedding over
    the stages): losses, gradient norms and validation losses of every step (F64)."""
    results = run(layout, zero=zero)
    assert all(r["losses"] == results[0]["losses"] for r in results)
    check(results[0], one_process["layernorm"], f"zero={zero} {layout}", rel=F64)


def test_zero3_with_replicated_kv_heads_and_sequence_parallelism(one_process):
    results = run((2, 1, 2), GQA, zero=3, sequence_parallel=True)
    check(results[0], one_process["rmsnorm"], "zero=3 GQA + SP", rel=F64)


def test_zero_equals_plain_data_parallel_step_by_step():
    """The same run at ZeRO 0, 1, 2 and 3 (dp 2): the same numbers to rounding."""
    base = run((1, 1, 2))[0]
    for zero in (1, 2, 3):
        check(run((1, 1, 2), zero=zero)[0], base, f"zero={zero} vs DP", rel=F64)


def one_step(level: int, dp: int, prefetch: bool = True, cfg: TrainConfig | None = None) -> dict:
    """One step of a dp-rank ZeRO run, traced and measured (a launched rank's function)."""
    torch.set_default_dtype(torch.float64)
    mesh = Mesh(Layout(1, 1, dp))
    model = build_sharded(DEEP, mesh.tp_group, seed=0)[0]
    psi = sum(p.numel() for p in model.parameters())
    sdp = make_sharded([model], cfg or TrainConfig(), level, mesh)
    sdp.prefetch = prefetch
    at_rest = sdp.gathered_bytes()
    x, y = packed_batch(data()[0], 4 // dp, DEEP.seq_len, 0, 0, mesh.dp_rank, dp)
    with CommTracer() as t:
        model(x, y).backward()
        sdp.finish()
        full_grads = [p.grad is not None for p in model.parameters()]
        grad_bytes = sdp.grad_bytes()
        sdp.step()
    blocks = [b for u in sdp.blocks for b in u.buffers]
    roots = [b for u in sdp.roots for b in u.buffers]
    return {
        "psi": psi,
        "padded": sum(b.n * b.size for b in sdp.buffers),
        "padded_blocks": sum(b.n * b.size for b in blocks),
        "shard": sum(b.shard.numel() for b in sdp.buffers),
        "shard_grads": sum(b.shard.grad.numel() for b in sdp.buffers),
        "state": sdp.state_numel(),
        "full_grads": any(full_grads),
        "at_rest": at_rest,
        "weight_bytes": sdp.weight_bytes(),
        "grad_bytes": grad_bytes,
        "after_step": sdp.gathered_bytes(),
        "peak": sdp.peak_gathered,
        "block_bytes": sum(b.nbytes for b in sdp.blocks[0].buffers),
        "root_bytes": sum(b.nbytes for b in roots),
        "rs": t.numel("reduce_scatter"),
        "ag": t.numel("all_gather"),
        "ag_bytes": t.bytes("all_gather"),
        "ag_backward": t.numel("all_gather", phase="backward"),
        "ar": t.numel("all_reduce"),
        "wire": t.wire_bytes(op="reduce_scatter") + t.wire_bytes(op="all_gather"),
        "loss_after": model(x, y).item(),
    }


@pytest.mark.parametrize("dp", [2, 4])
def test_traffic_and_memory_per_rank_equal_the_formulas(dp):
    """Elements per step: ZeRO-1 and -2 reduce-scatter and all-gather Ψ (padded to N per
    buffer): DP's all-reduce of Ψ, in two halves, the same bytes on the wire; ZeRO-3
    all-gathers the blocks a second time in backward. Memory: AdamW states are 1/N on every
    rank, and the gradients' means (ZeRO-1 keeps the whole local gradients too, the means in
    place among them; with ZeRO-2/3 none survives finish()); no byte is held twice; ZeRO-3
    holds no whole parameter at rest, and at most the root (embeddings, head) and two blocks
    (the current and the prefetched one) during the step."""
    z1, z2, z3 = (launch(one_step, dp, level, dp)[0] for level in (1, 2, 3))
    for z in (z1, z2, z3):
        assert z["psi"] <= z["padded"] < z["psi"] + 8 * dp  # ≤ N-1 pad elements per buffer
        assert z["shard"] == z["shard_grads"] == z["padded"] // dp
        assert z["state"] == 2 * z["padded"] // dp  # AdamW: exp_avg, exp_avg_sq
        assert z["full_grads"] == (z is z1)
        assert z["rs"] == z["padded"]
    for z in (z1, z2):
        assert z["ag"] == z["padded"] and z["ag_backward"] == 0
        # DP's ring all-reduce of the same padded buffers: 2·(N-1)/N of their bytes
        assert z["wire"] == pytest.approx(2 * (dp - 1) / dp * 8 * z["padded"])
        assert z["loss_after"] == z2["loss_after"]
    assert z3["ag"] == z3["padded"] + z3["padded_blocks"]
    assert z3["ag_backward"] == z3["padded_blocks"]
    ratio = (z3["rs"] + z3["ag"]) / (z2["rs"] + z2["ag"])
    assert ratio == pytest.approx(1 + z3["padded_blocks"] / (2 * z3["padded"]))
    assert z1["at_rest"] == z2["at_rest"] == 8 * z2["padded"]  # float64: whole parameters
    # No second copy: ZeRO-1/2's shards are slices of the whole parameters, ZeRO-1's shard
    # means slices of its one whole gradient buffer; ZeRO-3 holds its shards alone at rest
    assert z1["weight_bytes"] == z2["weight_bytes"] == 8 * z2["padded"]
    assert z1["grad_bytes"] == 8 * z1["padded"]
    assert z2["grad_bytes"] == z3["grad_bytes"] == z3["weight_bytes"] == 8 * z3["shard"]
    assert z3["at_rest"] == z3["after_step"] == 0
    assert z3["peak"] == z3["root_bytes"] + 2 * z3["block_bytes"]


def test_checkpoints_move_between_zero_stages(tmp_path):
    """Saved at step 3 of 5 under ZeRO-3 (dp 2), resumed by one process and by ZeRO-2 (dp 2);
    under ZeRO-1, resumed by ZeRO-3; under ZeRO-3 with a pipeline (pp 2 × dp 2, the tied
    embedding on both stages), resumed by one process: each continues like the straight run.
    The dp ranks share the writing: each of them writes about half the bytes."""
    five = dataclasses.replace(CFG, steps=5, eval_every=5)
    straight = run((1, 1, 1), cfg=five)[0]["losses"]
    cases = [
        ((1, 1, 2), 3, [(1, 1, 1, 0), (1, 1, 2, 2)]),
        ((1, 1, 2), 1, [(1, 1, 2, 3)]),
        ((1, 2, 2), 3, [(1, 1, 1, 0)]),
    ]
    for source, zero, resumes in cases:
        root = tmp_path / f"{source}zero{zero}"
        cfg = dataclasses.replace(five, ckpt_dir=str(root), save_every=3)
        run(source, cfg=cfg, zero=zero)
        _, index = checkpoint.read_index(root / "step_00000003")
        for stage in range(source[1]):
            files = {f"tp0-pp{stage}-dp{d}.safetensors" for d in (0, 1)}
            sizes = [index["files"][f]["bytes"] for f in sorted(files)]
            assert max(sizes) < 0.6 * sum(sizes), (source, stage, sizes)  # about half each
        for *layout, z in resumes:
            cfg = dataclasses.replace(five, resume=str(root / "step_00000003"))
            losses = run(tuple(layout), cfg=cfg, zero=z)[0]["losses"]
            assert losses == pytest.approx(straight[3:], rel=F64), (source, zero, layout, z)


def test_zero_stage_errors_are_clear():
    with pytest.raises(ValueError, match=r"zero must be one of \(0, 1, 2, 3\), got 4"):
        ParallelConfig(dp=2, zero=4)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_mixed_precision_under_zero_matches_plain_dp(dtype):
    """bf16 / fp16 autocast with fp32 master shards (fp16: the loss scaler sees the shards'
    gradients; an overflow on any rank's shard skips the step everywhere). Against plain DP at
    the same dtype the compute is identical and only the sum of 2 replicas' gradients is done by
    another collective (exact for 2 terms), so float32 agreement to 1e-6 is a loose bound."""
    tr, va = data()
    cfg = dataclasses.replace(CFG, dtype=dtype, loss_scale=2.0**4)
    runs = {
        zero: launch(train, 2, CONFIG, cfg, tr, va, parallel=ParallelConfig(dp=2, zero=zero))[0]
        for zero in (0, 1, 2, 3)
    }
    for zero in (1, 2, 3):
        check(runs[zero], runs[0], f"{dtype} zero={zero}", rel=1e-6)
        if dtype == "fp16":
            assert runs[zero]["loss_scale"] == runs[0]["loss_scale"]


def test_dry_run_accepts_zero_2_and_3():
    """(Its measurements are tests/test_dryrun.py's: dry run == real ranks under ZeRO-2/3.)"""
    from tpedu.analysis.dryrun import check_setup

    for zero in (2, 3):
        assert check_setup(CONFIG, ParallelConfig(dp=2, zero=zero), 4) == 1


def test_without_prefetch_zero3_holds_one_block_and_computes_the_same():
    """prefetch=False gathers a block only when it runs: the peak drops to the root and one
    block, the traffic and the numbers stay (prefetching changes when, not what)."""
    on, off = (launch(one_step, 2, 3, 2, prefetch)[0] for prefetch in (True, False))
    assert off["peak"] == off["root_bytes"] + off["block_bytes"] < on["peak"]
    assert (off["ag"], off["rs"]) == (on["ag"], on["rs"])
    assert off["loss_after"] == on["loss_after"]


def test_zero3_under_the_interleaved_schedule_trains_like_one_process():
    """2 chunks per pipeline rank (4 blocks over 2 stages) × dp 2: each chunk's blocks are
    gathered, freed and prefetched within the chunk, micro-batch by micro-batch."""
    tr, va = data()
    ref = launch(f64, 1, train, DEEP, CFG, tr, va)[0]
    results = run((1, 2, 2), DEEP, zero=3, schedule="interleaved", chunks=2)
    check(results[0], ref, "zero=3 interleaved", rel=F64)


def test_low_precision_parameter_gathers(one_process):
    """`param_gather="low"` all-gathers bf16 copies of the fp32 shards: half the bytes, the
    same elements; AdamW's shards stay fp32. The replicas' parameters are then rounded to bf16,
    which autocast does to every matmul weight anyway, so only norms, biases and embeddings see
    a new rounding (relative ≤ u = 2^-8 each). Over 5 steps the losses stay within u of the
    fp32-gathered run and the gradient norms within 2u (measured: 1.5e-4 and 3.3e-3)."""
    low = TrainConfig(dtype="bf16", param_gather="low")
    wide, narrow = (launch(one_step, 2, 3, 2, True, cfg)[0] for cfg in (TrainConfig(), low))
    assert narrow["ag"] == wide["ag"]  # the same elements, in 2 bytes (one_step's model: 8)
    assert (narrow["ag_bytes"], wide["ag_bytes"]) == (2 * wide["ag"], 8 * wide["ag"])
    tr, va = data()
    runs = {}
    for gather in ("fp32", "low"):
        cfg = dataclasses.replace(CFG, dtype="bf16", param_gather=gather, steps=5)
        par = ParallelConfig(dp=2, zero=3)
        runs[gather] = launch(train, 2, CONFIG, cfg, tr, va, parallel=par)[0]
    u = 2.0**-8
    for a, b in zip(runs["low"]["losses"], runs["fp32"]["losses"], strict=True):
        assert a == pytest.approx(b, rel=u)
    for a, b in zip(runs["low"]["history"], runs["fp32"]["history"], strict=True):
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=2 * u)
    assert runs["low"]["losses"] != runs["fp32"]["losses"]  # the gathers did round


@pytest.mark.parametrize("zero", [2, 3])
def test_low_precision_gathers_save_the_fp32_masters(tmp_path, zero):
    """bf16 with `param_gather="low"` (dp 2): a checkpoint and the trained model directory hold
    the fp32 shards AdamW steps, not the replicas' bf16-rounded parameters. So a run resumed at
    step 3 goes on exactly as the one that never stopped, and the model written at the end is
    the last checkpoint's, bit for bit (fp32 runs: bf16 autocast and gathers)."""
    from safetensors.torch import load_file

    tr, va = data()
    five = dataclasses.replace(CFG, steps=5, eval_every=5, dtype="bf16", param_gather="low")
    par = ParallelConfig(dp=2, zero=zero)

    def go(cfg, out=None):
        return launch(train, 2, CONFIG, cfg, tr, va, out, parallel=par)[0]["losses"]

    straight = go(five)
    root = tmp_path / "ckpt"
    assert (
        go(dataclasses.replace(five, ckpt_dir=str(root), save_every=3), tmp_path / "out")
        == straight
    )
    assert go(dataclasses.replace(five, resume=str(root / "step_00000003"))) == straight[3:]
    _, saved, _ = checkpoint.read_dense(root / "step_00000005")
    model = load_file(tmp_path / "out" / "model.safetensors")
    assert model.keys() <= saved.keys()
    for k, v in model.items():
        assert torch.equal(v, saved[k].to(v.dtype)), k


def _recorded_zero3(record: bool) -> dict:
    """One ZeRO-3 step at dp 2, recorded or not, its buffers named by unit."""
    torch.set_default_dtype(torch.float64)
    mesh = Mesh(Layout(1, 1, 2))
    model = build_sharded(DEEP, mesh.tp_group, seed=0)[0]
    sdp = make_sharded([model], TrainConfig(), 3, mesh)
    for i, u in enumerate(sdp.blocks):
        for b in u.buffers:
            b.name = f"block {i}"
    x, y = packed_batch(data()[0], 2, DEEP.seq_len, 0, 0, mesh.dp_rank, 2)
    with recorder.Recorder() if record else contextlib.nullcontext() as rec:
        model(x, y).backward()
        sdp.finish()
        sdp.step()
    spans = rec.log.spans if record else []
    marks = [(s.name, s.what, s.nbytes) for s in spans if isinstance(s, Mark)]
    return {
        "marks": marks,
        "peak": sdp.peak_gathered,
        "shards": [b.shard.detach().clone() for b in sdp.buffers],
        "loss_after": model(x, y).detach(),
    }


def test_zero3_marks_each_buffer_coming_and_going_on_the_rank_clock():
    """Recording changes nothing, bit for bit; every gather is freed later, and the bytes the
    marks hold add up to the step's peak."""
    plain = launch(_recorded_zero3, 2, False)
    for r, out in enumerate(launch(_recorded_zero3, 2, True)):
        assert all(
            torch.equal(a, b) for a, b in zip(out["shards"], plain[r]["shards"], strict=True)
        )
        assert torch.equal(out["loss_after"], plain[r]["loss_after"])
        assert out["peak"] == plain[r]["peak"] and plain[r]["marks"] == []
        held, top = 0, 0
        for kind, what, nbytes in out["marks"]:
            assert kind in ("gather", "free") and nbytes > 0, (kind, what)
            held += nbytes if kind == "gather" else -nbytes
            top = max(top, held)
        assert held == 0 and top == out["peak"], (held, top, out["peak"])
        blocks = {w for k, w, _ in out["marks"] if k == "gather"} - {""}
        assert blocks == {f"block {i}" for i in range(DEEP.n_layers)}
