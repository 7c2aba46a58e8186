"""Rank clocks: how close the replay (a core per rank, this machine's loopback link) comes to
the wall clock where the laptop gives each rank its own core, and what recording costs.

    .venv/bin/python benchmarks/bench_clock.py [--layouts 2x1x1 1x2x1 1x1x2] [--reps 5]
    .venv/bin/python benchmarks/bench_clock.py --layouts 2x2x1 1x2x2      # 4 ranks, 2 cores

A layout is tp x pp x dp (pp: 1F1B with 4 micro-batches; dp: bucket all-reduces issued from
backward hooks, overlapped with the rest of backward). Per layout, on every rank: α and β of the
loopback fitted (tpedu.analysis.clock.links.measure_loopback), 2 warm-up steps, then `reps` pairs of
train steps, one plain and one recorded (tpedu.comm.recorder), alternating. Per pair: the
measured step (wall clock, slowest rank, after a barrier) and the replayed step of the recorded
one (tpedu.analysis.clock.replay on the fitted link). Printed: medians; ratio = replayed / measured;
overhead = recorded / plain - 1; and the same recorded steps priced on an H100 SXM node (NVLink
links, compute from the step's FLOPs at 70 % of peak: `links.device_factor`).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torch.distributed as dist
from bench_scaling import layout_config, parse_layout
from harness import BACKEND, BATCH, CONFIG, TINY, batch, load, slowest

import tpedu
from tpedu.analysis.clock import links, replay
from tpedu.analysis.shape import ModelShape
from tpedu.comm import collectives as C
from tpedu.comm import recorder
from tpedu.model.config import GPTConfig
from tpedu.model.dense import DenseGPT
from tpedu.parallel.mesh import Layout, Mesh
from tpedu.parallel.pipeline.runtime import build_stage_chunks
from tpedu.train.config import TrainConfig
from tpedu.train.step import build_step

DEFAULT_LAYOUTS = ["2x1x1", "1x2x1", "1x1x2"]


def worker(config: GPTConfig, layout: Layout, reps: int, micro: int | None) -> dict:
    """One rank: fit the link, then `reps` (plain, recorded) step pairs; rank 0 replays."""
    mesh = Mesh(layout)
    net = links.measure_loopback()
    torch.manual_seed(0)
    dense = DenseGPT(config)
    chunks = build_stage_chunks(dense, mesh.tp_group, mesh.pp_rank, layout.pp)
    parallel = layout_config(layout, micro)
    train_step = build_step(chunks, mesh, parallel, TrainConfig(batch=BATCH, warmup=0))
    b, m = train_step.per_replica, train_step.micro_batches
    ids, tgt = batch(config)
    mine = slice(mesh.dp_rank * b, (mesh.dp_rank + 1) * b)
    xs, ys = list(ids[mine].chunk(m)), list(tgt[mine].chunk(m))
    for _ in range(2):
        train_step(xs, ys, 0)
    run = recorder.run_id()
    plain, measured, replayed, logs_kept, cpu = [], [], [], [], {"plain": [], "recorded": []}
    for _ in range(reps):
        dist.barrier()
        t, c = time.perf_counter(), time.thread_time()
        train_step(xs, ys, 0)
        cpu["plain"].append(slowest(time.thread_time() - c))
        plain.append(slowest(time.perf_counter() - t))
        rec = recorder.Recorder(run)
        dist.barrier()
        t, c = time.perf_counter(), time.thread_time()
        with rec:
            train_step(xs, ys, 0)
        cpu["recorded"].append(slowest(time.thread_time() - c))
        measured.append(slowest(time.perf_counter() - t))
        rec.log.run = f"{run}-{len(measured)}"  # each recorded step is its own run
        logs = recorder.gather(rec.log)
        replayed.append(replay.replay(logs, net).step)
        logs_kept.append(logs)
    return {
        "per_call": per_call_cost(),
        "micro": m,
        "net": net,
        "plain": plain,
        "cpu": cpu,
        "measured": measured,
        "replayed": replayed,
        "logs": logs_kept if dist.get_rank() == 0 else None,
    }


def per_call_cost(n: int = 5000) -> float:
    """CPU seconds the recorder adds to one communication call: n all-reduces on a group of
    this rank alone (tpedu's wrapper returns at once), recorded and not, in thread CPU time."""
    alone, x = dist.new_group([dist.get_rank()], use_local_synchronization=True), torch.ones(4)
    times = {}
    for on in (False, True, False, True):
        rec = recorder.Recorder("cost") if on else None
        c = time.thread_time()
        with rec or contextlib.nullcontext():
            for _ in range(n):
                C.all_reduce(x, alone)
        times.setdefault(on, []).append((time.thread_time() - c) / n)
    return min(times[True]) - min(times[False])


def run_layout(config: GPTConfig, layout: Layout, reps: int, micro: int | None = None) -> dict:
    """Launch one layout; its row: medians, ratio, overhead, and the median step's replays."""
    r = tpedu.launch(
        worker, layout.world, config, layout, reps, micro, timeout=1800, backend=BACKEND
    )[0]
    mid = sorted(range(reps), key=lambda i: r["replayed"][i])[reps // 2]
    logs = r["logs"][mid]
    here = replay.replay(logs, r["net"])
    cpu = sum(log.compute_seconds() for log in logs)
    flops = ModelShape.from_config(config).flops_per_token() * BATCH * config.seq_len
    priced = replay.replay(logs, "nvlink", links.device_factor(flops, cpu, "H100 SXM", 0.7))
    measured, replayed = statistics.median(r["measured"]), statistics.median(r["replayed"])
    return {
        "layout": layout,
        "micro": r["micro"],
        "net": r["net"],
        "plain": statistics.median(r["plain"]),
        "measured": measured,
        "replayed": replayed,
        "ratio": replayed / measured,
        "overhead": measured / statistics.median(r["plain"]) - 1,
        "cpu_overhead": statistics.median(r["cpu"]["recorded"])
        / statistics.median(r["cpu"]["plain"])
        - 1,
        "calls": max(len(log.comms()) for log in logs),
        "per_call": r["per_call"],
        "here": here,
        "priced": priced,
    }


def table(rows: list[dict]) -> str:
    head = (
        f"{'layout':<7} {'ranks':>5} {'m':>2} {'plain ms':>9} {'measured':>9} {'replayed':>9} "
        f"{'ratio':>6} {'overhead':>8} {'cpu ovh':>7} {'calls':>5} {'bubble':>7} {'exposed':>8} {'hidden':>7} {'H100 ms':>8}"
    )
    lines = [head, "-" * len(head)]
    for w in rows:
        lay, here = w["layout"], w["here"]
        lines.append(
            f"{lay.tp}x{lay.pp}x{lay.dp:<3} {lay.world:>5} {w['micro']:>2} {w['plain'] * 1e3:>9.1f} "
            f"{w['measured'] * 1e3:>9.1f} {w['replayed'] * 1e3:>9.1f} {w['ratio']:>6.2f} "
            f"{w['overhead']:>8.1%} {w['cpu_overhead']:>7.1%} {w['calls']:>5} {here.bubble:>7.1%} {here.exposed * 1e3:>8.1f} "
            f"{here.hidden * 1e3:>7.1f} {w['priced'].step * 1e3:>8.3f}"
        )
    lines.append(
        "plain, measured: wall clock here, median of the slowest rank (measured: the recorded "
        "steps); replayed: a core per rank, the fitted loopback link; ratio = replayed / "
        "measured; overhead = measured / plain - 1, cpu ovh the same in CPU time (the slowest "
        "rank's thread); calls: communication calls recorded per rank per step; bubble, exposed, hidden (ms): the median "
        "step's replay; H100 ms: priced, that step on an H100 SXM node (NVLink, 70 % of peak)."
    )
    for w in rows:
        lay, net = w["layout"], w["net"]
        share = w["calls"] * w["per_call"] / w["plain"]
        lines.append(
            f"{lay.tp}x{lay.pp}x{lay.dp}: loopback α {net.alpha * 1e6:.0f} us, "
            f"β⁻¹ {net.bandwidth / 1e9:.2f} GB/s; recording {w['per_call'] * 1e6:.1f} us CPU "
            f"per call x {w['calls']} calls = {share:.2%} of the plain step"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", nargs="+", default=DEFAULT_LAYOUTS)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--micro", type=int, default=4, help="micro-batches when pp > 1")
    ap.add_argument("--tiny", action="store_true", help="the tiny model (a smoke run)")
    args = ap.parse_args()
    config = TINY if args.tiny else CONFIG
    torch.set_num_threads(1)
    rows = []
    for text in args.layouts:
        layout = parse_layout(text)
        rows.append(run_layout(config, layout, args.reps, args.micro if layout.pp > 1 else None))
    print(f"{load()}, torch {torch.__version__}, gloo")
    print(table(rows))


if __name__ == "__main__":
    main()
