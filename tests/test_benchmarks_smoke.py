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
from tpedu.train.loop import default_micro_batches

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _bench(name: str):  # noqa: ANN202 - benchmarks/ is a folder of scripts, not a package
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
