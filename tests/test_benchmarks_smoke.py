"""The benchmarks' code paths on a tiny model: a well-formed row, the right loss, and
traced communication volumes equal to their formulas. No timing is asserted."""

import importlib
import math
import sys
from pathlib import Path

import pytest
import torch

import tpedu
from tpedu.model.dense import DenseGPT
from tpedu.parallel.mesh import Layout
from tpedu.train.step import default_micro_batches

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _bench(name: str):  # benchmarks/ is a folder of scripts, not a package
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)


def test_scaling_row_3d_tiny():
    harness, bench = _bench("harness"), _bench("bench_scaling")
    config, layout = harness.TINY, Layout(1, 2, 2)
    row = bench.run_layout(config, layout, reps=1, fit_sizes=(4096, 16384))

    b = harness.BATCH // layout.dp
    m = default_micro_batches(b, layout.pp)
    assert row["micro"] == m == 4
    for key in ("step", "comm", "p2p", "compute", "predicted", "mbytes", "bubble"):
        assert math.isfinite(row[key]), key
    assert row["step"] > 0 and 0 <= row["p2p"] <= row["comm"] and row["predicted"] > 0
    assert 0 < row["bubble"] < 1 and row["bubble_formula"] == 1 / 5  # (p-1)/(m+p-1)
    assert sorted(row["fits"]) == [2]  # pp and dp groups: 2 ranks each

    # The first step's loss is the dense model's on the whole global batch (same init seed).
    torch.manual_seed(0)
    ids, tgt = harness.batch(config)
    dense = DenseGPT(config)(ids, tgt).item()
    # fp32: micro-batches and replicas reorder the mean's sums (~1e-7 relative)
    assert abs(row["loss"] - dense) <= 1e-5 * abs(dense), (row["loss"], dense)

    act = (b // m) * config.seq_len * config.hidden * 4  # one micro-batch's [b/m, s, H] fp32
    for r in row["ranks_raw"]:
        t = r["traced"]  # {(group, op): [calls, bytes]}
        # each stage sends m tensors (activations forward or gradients backward), receives m
        assert t[("pp", "send")] == [m, m * act], r["coords"]
        assert t[("pp", "recv")] == [m, m * act], r["coords"]
        # DP: the buckets cover every parameter of the stage once, fp32
        assert t[("dp", "all_reduce")][1] == 4 * r["stage_params"], r["coords"]
    heavy = row["ranks_raw"][row["rank"]]
    assert row["mbytes"] == heavy["bytes"] / 1e6
    assert heavy["bytes"] == max(r["bytes"] for r in row["ranks_raw"])


def test_dtensor_worker_tiny():
    """bench_dtensor's worker at tp 2 on a tiny model: both models start from the same loss, and
    every figure it reports is a real measurement (positive times, non-negative kernel time)."""
    harness, bench = _bench("harness"), _bench("bench_dtensor")
    r = tpedu.launch(bench.worker, 2, 1, False, harness.TINY, timeout=300)[0]
    # fp32, the same vocab-parallel sums in a different order: ~1e-7 relative
    assert r["first_loss"]["tpedu"] == pytest.approx(r["first_loss"]["dtensor"], rel=1e-6)
    assert all(t > 0 for t in r["times"].values()) and set(r["times"]) == {
        "tpedu",
        "dtensor",
        "floor",
    }
    assert r["comm"] > 0  # tpedu's collectives were timed
    for sys_s, faults in r["kernel"].values():
        assert sys_s >= 0 and faults >= 0


def test_precision_benchmark_times_every_dtype_tiny():
    harness, bench = _bench("harness"), _bench("bench_precision")
    times = tpedu.launch(bench.worker, 2, 1, harness.TINY, backend=harness.BACKEND)[0]
    assert sorted(times) == ["bf16", "fp16", "fp32"] and all(t > 0 for t in times.values())


def test_zero_benchmark_tiny():
    """bench_zero at dp 2 on a tiny model: every variant trained the same numbers, the traced
    traffic equals the printed formula, and ZeRO-3 holds no whole parameter after the step."""
    harness, bench = _bench("harness"), _bench("bench_zero")
    res = tpedu.launch(bench.run, 2, 2, 1, harness.TINY, backend=harness.BACKEND)[0]
    assert list(res) == list(bench.VARIANTS)
    for r in res.values():
        assert r["sent"] / r["params"] == pytest.approx(r["formula"])
        assert r["loss"] == pytest.approx(res["dp"]["loss"], rel=1e-6) and r["time"] > 0
    assert res["zero3"]["weights"] < res["zero2"]["weights"]


def test_decode_benchmark_tiny():
    """bench_decode at tp 2 on a tiny model: cache and recompute give the same tokens, every
    time is positive, and the GPU prediction reads weights/tp bytes per token at batch 1."""
    import dataclasses

    harness, bench = _bench("harness"), _bench("bench_decode")
    config = dataclasses.replace(harness.TINY, seq_len=64)
    r = tpedu.launch(bench.worker, 2, config, 8, 1, 32, backend=harness.BACKEND)[0]
    assert r["same"] and all(r[k] > 0 for k in ("cache", "recompute", "prefill", "step"))
    from tpedu.analysis.shape import ModelShape
    from tpedu.analysis.whatif import HARDWARE

    shape = ModelShape()
    p1, p4 = (
        bench.decode_prediction(shape, HARDWARE["H100 SXM"], 3.35e12, tp, 1, 2048, 0.8)
        for tp in (1, 4)
    )
    assert p1["bytes_per_token"] == 2 * shape.n_params == 4 * p4["bytes_per_token"]
    assert p1["comm"] == 0 < p4["comm"] and p4["weights"] == pytest.approx(p1["weights"] / 4)


def test_fsdp_worker_tiny():
    """bench_fsdp's worker at dp 2 on a tiny model: tpedu's ZeRO-3 and FSDP2 train alike, both
    are timed, and each moves what ZeRO-3's formula says: all-gathers of Ψ + Ψ_blocks (the root
    stays whole from forward to backward, the blocks are gathered twice) and a reduce-scatter of
    Ψ per step. Every dimension of the tiny model is even: no padding at dp 2 on either side."""
    harness, bench = _bench("harness"), _bench("bench_fsdp")
    r = tpedu.launch(bench.worker, 2, harness.TINY, 2, 1, torch.float32, timeout=300)[0]
    # fp32, a few sums in another order (the loss, the norm, gloo's buffers): ~1e-7 relative
    assert r["tpedu"]["losses"] == pytest.approx(r["fsdp2"]["losses"], rel=1e-5)
    assert r["tpedu"]["norms"] == pytest.approx(r["fsdp2"]["norms"], rel=1e-4)
    assert set(r["times"]) == {"tpedu", "fsdp2"} and all(t > 0 for t in r["times"].values())
    model = DenseGPT(harness.TINY)
    psi = sum(p.numel() for p in model.parameters())
    psi_blocks = sum(p.numel() for p in model.blocks.parameters())
    for name in ("tpedu", "fsdp2"):
        assert r["comm"][name] > 0, name
        assert r["elements"][name]["all_gather"] == psi + psi_blocks, name
        assert r["elements"][name]["reduce_scatter"] == psi, name


def test_context_benchmark_tiny(capsys):
    """bench_context's worker on 2 ranks: every variant (TP, explicit attention, SP, ring CP in
    both layouts) computes the dense loss, and the saved activations order as the formulas
    say: SP and CP (s/2 positions) below TP, explicit attention (the [s, s] scores) above."""
    bench = _bench("bench_context")
    (row,) = tpedu.launch(bench.worker, 2, [32], 1, bench.TINY, timeout=300)[0]
    assert set(row["loss"]) == set(bench.VARIANTS)
    bench.check_losses(2, row)  # raises unless every variant's loss is TP's (1e-5)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (1, 32), generator=g)
    tgt = torch.randint(0, 128, (1, 32), generator=g)
    torch.manual_seed(0)
    want = DenseGPT(bench.TINY)(ids, tgt).item()
    assert row["loss"]["CP zigzag"] == pytest.approx(want, rel=1e-5)
    act = row["act"]
    assert act["CP zigzag"] == act["CP contig"] < act["TP"] < act["TP expl"]
    assert act["TP+SP"] < act["TP"] and all(t > 0 for t in row["ms"].values())
    bench.what_if()
    out = capsys.readouterr().out
    assert "TP 2 x CP 4" in out and "TP 8 + SP" in out


def test_clock_row_tiny():
    """bench_clock's code path at pp 2: a replayed step beside the measured one, the replay's
    bubble, the per-call recording cost and the H100 pricing (no figure is asserted)."""
    bench = _bench("bench_clock")
    row = bench.run_layout(_bench("harness").TINY, Layout(1, 2, 1), reps=1, micro=2)
    assert row["micro"] == 2 and row["calls"] >= 2 * 2  # a send and a receive per micro-batch
    for key in ("plain", "measured", "replayed", "ratio", "per_call"):
        assert math.isfinite(row[key]) and row[key] > 0, key
    assert 0 < row["here"].bubble < 1 and 0 < row["priced"].step < row["here"].step
    assert "1x2x1" in bench.table([row])


def test_tp_overlap_ways_tiny():
    """bench_tp_overlap's code path: every way of running TP gives the plain TP loss."""
    harness, bench = _bench("harness"), _bench("bench_tp_overlap")
    rows = tpedu.launch(bench.run, 2, harness.TINY, 1)[0]
    assert set(rows) == set(bench.WAYS)
    base = rows["tp"][1]
    for seconds, loss in rows.values():
        assert seconds > 0 and abs(loss - base) <= 1e-5 * abs(base)
