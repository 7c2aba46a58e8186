"""Scaling on this machine (TP, PP, DP, 3D): step time split into compute and communication,
the α-β model's predicted communication time next to the measured one, and the pipeline bubble.

    .venv/bin/python benchmarks/bench_scaling.py [--layouts 1x1x1 2x1x1 1x2x1 ...] [--reps 5]
    .venv/bin/python benchmarks/bench_scaling.py --tp 1 2 4      # pure TP: layouts tx1x1

A layout is tp x pp x dp. STRONG scaling: every layout trains on the same global batch
(harness.BATCH sequences): dp splits it, pp splits each replica's share into m micro-batches
(train.step.default_micro_batches: the largest m <= 2·pp dividing it). One step is train's step
(tpedu.train.step.TrainStep):
pipelined forward + backward (run_schedule, 1F1B), DP bucket all-reduces launched from backward
hooks, TP gradient fix-ups, gradient norm + clipping, AdamW; the first step's loss is printed
(the same at every layout, up to rounding).

Per layout: α and β fitted to all-reduces of 4 KB-4 MB on every group size the layout uses (all
groups of a kind measuring at once, as in a step); one traced step (CommTracer: every call's op,
bytes, group size); predicted comm = Σ α-β prediction of each traced call; measured comm = wall
time inside collectives, send/recv and waits on async work (harness.timed_communication),
slowest rank; compute = step - comm. For pp > 1 the comm column includes waiting for the
neighbour stage, so the bubble is in it; the bubble is also measured from run_schedule's
timeline on the rank clock (tpedu.comm.recorder: run_schedule names each forward and backward
F<micro-batch>, B<micro-batch>): 1 - (F+B wall time summed over stages) / (stages · span), next
to (p-1)/(m+p-1).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from harness import BACKEND, BATCH, CONFIG, TINY, batch, load, timed_communication

import tpedu
from tpedu.analysis.clock.events import recorded_events
from tpedu.comm import recorder
from tpedu.comm.cost_model import AlphaBeta, fit, measure
from tpedu.comm.tracer import CommTracer
from tpedu.model.config import GPTConfig
from tpedu.model.dense import DenseGPT
from tpedu.parallel.config import SCHEDULES, ParallelConfig
from tpedu.parallel.mesh import Layout, Mesh
from tpedu.parallel.pipeline.runtime import build_stage_chunks
from tpedu.parallel.pipeline.schedules import (
    Event,
    bubble_formula,
    bubble_fraction,
    stage_layers,
)
from tpedu.train.config import TrainConfig
from tpedu.train.step import build_step, check_setup

FIT_SIZES = (4096, 65536, 1 << 20, 4 << 20)
DEFAULT_LAYOUTS = ["1x1x1", "2x1x1", "1x2x1", "1x1x2", "2x2x1", "2x1x2", "1x2x2"]


def parse_layout(text: str) -> Layout:
    """'2x1x2' -> Layout(tp=2, pp=1, dp=2)."""
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"layout {text!r} is not tp x pp x dp, e.g. 2x1x2")
    return Layout(*(int(p) for p in parts))


def check_layout(
    config: GPTConfig, layout: Layout, micro: int | None, kind: str = "1f1b", n_chunks: int = 1
) -> None:
    """Raise a ValueError (before anything runs) if the benchmark cannot run at `layout`."""
    check_setup(config, layout_config(layout, micro, kind, n_chunks), BATCH)


def layout_config(
    layout: Layout, micro: int | None, kind: str = "1f1b", n_chunks: int = 1, split: str = "even"
) -> ParallelConfig:
    """The ParallelConfig train would run the layout with."""
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    return ParallelConfig(
        tp, pp, dp, micro_batches=micro, schedule=kind, chunks=n_chunks, stage_split=split
    )


def fit_group_sizes(mesh: Mesh, sizes: tuple[int, ...]) -> dict[int, AlphaBeta]:
    """{group size: α-β fitted to all-reduces on this rank's group of that size}. Collective.

    Every rank is in exactly one group of each kind, so all groups of a kind measure at once,
    competing for the cores as they do in a step."""
    lay = mesh.layout
    out = {}
    for g in sorted({lay.tp, lay.pp, lay.dp} - {1}):
        kind = next(k for k in ("tp", "pp", "dp") if getattr(lay, k) == g)
        out[g] = fit(measure("all_reduce", list(sizes), mesh.groups[kind]))
    return out


def predict(fits: dict[int, AlphaBeta], op: str, nbytes: int, size: int) -> float:
    """α-β seconds of one traced call; a group size not fitted uses the nearest fitted one."""
    if size == 1 or not fits:
        return 0.0
    ab = fits[min(fits, key=lambda g: (abs(g - size), g))]
    return ab.predict(op, nbytes, size)


def worker(
    config: GPTConfig,
    tp: int,
    pp: int,
    dp: int,
    reps: int,
    micro: int | None = None,
    kind: str = "1f1b",
    fit_sizes: tuple[int, ...] = FIT_SIZES,
    n_chunks: int = 1,
    split: str = "even",
) -> dict:
    """One rank of a tp·pp·dp layout: fits, first loss, a traced step, `reps` timed steps.
    `split`: blocks per pipeline stage, "even" or "flops" (ParallelConfig.stage_split)."""
    mesh = Mesh(Layout(tp, pp, dp))
    dev = tpedu.device()
    fits = fit_group_sizes(mesh, fit_sizes)
    torch.manual_seed(0)
    dense = DenseGPT(config)
    chunks = [
        c.to(dev)
        for c in build_stage_chunks(dense, mesh.tp_group, mesh.pp_rank, pp, n_chunks, split)
    ]
    stage = torch.nn.ModuleList(chunks)  # all of this rank's parameters
    parallel = layout_config(mesh.layout, micro, kind, n_chunks, split)
    train_step = build_step(chunks, mesh, parallel, TrainConfig(batch=BATCH, warmup=0))
    b, m = train_step.per_replica, train_step.micro_batches
    ids, tgt = batch(config)
    mine = slice(mesh.dp_rank * b, (mesh.dp_rank + 1) * b)  # this replica's share
    xs, ys = list(ids[mine].to(dev).chunk(m)), list(tgt[mine].to(dev).chunk(m))

    def step():  # train's step, at a fixed learning rate (step 0 without warm-up: cfg.lr)
        return train_step(xs, ys, 0)[0]

    first = step().loss
    with CommTracer() as trace:
        step()
    steps, comms, p2ps, events = [], [], [], []
    for _ in range(reps):
        dist.barrier()
        with timed_communication() as acc, recorder.Recorder() as rec:
            t = time.perf_counter()
            step()
            steps.append(time.perf_counter() - t)
        comms.append(acc["collective"] + acc["p2p"])
        p2ps.append(acc["p2p"])
        events.append([e for e in recorded_events(rec.log, mesh.pp_rank) if e.kind != "wait"])
    real = [r for r in trace.records if r.group_size > 1]  # a 1-rank group sends nothing
    summary: dict[tuple[str, str], list[int]] = {}
    for r in trace.records:
        calls_bytes = summary.setdefault((r.group, r.op), [0, 0])
        calls_bytes[0] += 1
        calls_bytes[1] += r.bytes
    return {
        "coords": (mesh.tp_rank, mesh.pp_rank, mesh.dp_rank),
        "micro": m,
        "loss": None if first is None else float(first),
        "steps": steps,
        "comms": comms,
        "p2ps": p2ps,
        "events": events,
        "fits": fits,
        "traced": summary,
        "calls": len(real),
        "bytes": sum(r.bytes for r in real),
        "predicted": sum(predict(fits, r.op, r.bytes, r.group_size) for r in trace.records),
        "stage_params": sum(p.numel() for p in stage.parameters()),
    }


def run_layout(
    config: GPTConfig,
    layout: Layout,
    reps: int,
    micro: int | None = None,
    kind: str = "1f1b",
    fit_sizes: tuple[int, ...] = FIT_SIZES,
    n_chunks: int = 1,
    split: str = "even",
) -> dict:
    """Launch the layout and reduce the ranks' results to one table row (plus the raw ranks)."""
    ranks = tpedu.launch(
        worker,
        layout.world,
        config,
        layout.tp,
        layout.pp,
        layout.dp,
        reps,
        micro,
        kind,
        fit_sizes,
        n_chunks,
        split,
        timeout=1800,
        backend=BACKEND,
    )
    per_rep = lambda key: [max(r[key][i] for r in ranks) for i in range(reps)]
    step, comm, p2p = (statistics.median(per_rep(k)) for k in ("steps", "comms", "p2ps"))
    heavy = max(range(layout.world), key=lambda i: (ranks[i]["bytes"], -i))
    losses = [r["loss"] for r in ranks if r["loss"] is not None and r["coords"][0] == 0]
    row = {
        "layout": layout,
        "ranks": layout.world,
        "micro": ranks[0]["micro"],
        "step": step,
        "comm": comm,
        "p2p": p2p,
        "compute": step - comm,
        "rank": heavy,
        "predicted": ranks[heavy]["predicted"],
        "calls": ranks[heavy]["calls"],
        "mbytes": ranks[heavy]["bytes"] / 1e6,
        "loss": sum(losses) / len(losses),
        "fits": ranks[0]["fits"],
        "ranks_raw": ranks,
    }
    if layout.pp > 1:
        m = row["micro"]
        row["bubble_formula"] = bubble_formula(m, layout.pp, n_chunks)
        pipes: dict[tuple[int, int], list[dict]] = {}
        for r in ranks:
            pipes.setdefault((r["coords"][0], r["coords"][2]), []).append(r)
        bubbles, busy = [], [[] for _ in range(layout.pp)]
        for i in range(reps):
            per_pipe = []
            for members in pipes.values():
                evs: list[Event] = [e for r in members for e in r["events"][i]]
                per_pipe.append(bubble_fraction(evs))
                for r in members:
                    busy[r["coords"][1]].append(sum(e.end - e.start for e in r["events"][i]))
            bubbles.append(statistics.mean(per_pipe))
        row["bubble"] = statistics.median(bubbles)
        row["stage_busy"] = [statistics.median(b) for b in busy]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    how = ap.add_mutually_exclusive_group()
    how.add_argument("--layouts", nargs="+", help=f"tp x pp x dp (default: {DEFAULT_LAYOUTS})")
    how.add_argument("--tp", type=int, nargs="+", help="shorthand for the layouts tp x 1 x 1")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--micro-batches", type=int, help="default: train.default_micro_batches")
    ap.add_argument("--schedule", default="1f1b", choices=SCHEDULES)
    ap.add_argument("--chunks", type=int, default=1, help="model chunks per rank (interleaved)")
    ap.add_argument(
        "--stage-split",
        nargs="+",
        default=["even"],
        choices=["even", "flops"],
        help="blocks per stage: even, and/or by FLOPs with the head counted (each "
        "pp > 1 layout runs once per split)",
    )
    ap.add_argument("--tiny", action="store_true", help="harness.TINY: checks the code path")
    a = ap.parse_args()
    layouts = (
        [Layout(t, 1, 1) for t in a.tp]
        if a.tp
        else [parse_layout(s) for s in (a.layouts or DEFAULT_LAYOUTS)]
    )
    c = TINY if a.tiny else CONFIG
    for lay in layouts:
        check_layout(c, lay, a.micro_batches, a.schedule, a.chunks)
    print(
        f"GPT {c.n_layers} layers, d {c.hidden}, vocab {c.vocab_size}, seq {c.seq_len}; "
        f"global batch {BATCH} at every layout (strong scaling), {a.schedule}"
        f"{f' ({a.chunks} chunks per rank)' if a.chunks > 1 else ''}, fp32, AdamW + "
        f"clipping; 1 thread per rank"
    )
    print(load())
    print(
        f"{'layout':>6} {'split':>5} {'ranks':>5} {'m':>2} {'step ms':>8} {'compute':>8} "
        f"{'comm ms':>8} {'p2p ms':>7} {'α-β ms':>7} {'rank':>4} {'calls':>5} {'MB':>6} "
        f"{'bubble':>6} {'meas.':>6} {'speed-up':>8} {'loss':>9}"
    )
    rows, base = [], None
    runs = [
        (lay, split) for lay in layouts for split in a.stage_split[: 1 if lay.pp == 1 else None]
    ]
    for lay, split in runs:
        r = run_layout(c, lay, a.reps, a.micro_batches, a.schedule, n_chunks=a.chunks, split=split)
        r["split"] = split
        rows.append(r)
        base = r["step"] if lay.world == 1 else base
        speed = f"{base / r['step']:>8.2f}" if base else f"{'-':>8}"
        bub = (
            f"{r['bubble_formula']:>6.2f} {r['bubble']:>6.2f}"
            if lay.pp > 1
            else f"{'-':>6} {'-':>6}"
        )
        print(
            f"{lay.tp}x{lay.pp}x{lay.dp:<2} {split if lay.pp > 1 else '-':>5} "
            f"{r['ranks']:>5} {r['micro']:>2} "
            f"{1e3 * r['step']:>8.1f} {1e3 * r['compute']:>8.1f} {1e3 * r['comm']:>8.1f} "
            f"{1e3 * r['p2p']:>7.1f} {1e3 * r['predicted']:>7.1f} {r['rank']:>4} "
            f"{r['calls']:>5} {r['mbytes']:>6.1f} {bub} {speed} {r['loss']:>9.6f}"
        )
    print(
        "step, compute, comm, p2p: medians of the slowest rank; compute = step - comm; p2p is "
        "part of comm. α-β ms, calls, MB: the traced step of `rank` (the rank with the most "
        "traced bytes; calls on groups of 2+ ranks). bubble: (p-1)/(v·m+p-1), v chunks per "
        "rank; meas.: from run_schedule's timeline; stage F+B ms: compute of each stage (TP "
        "comm inside included). split: blocks per pipeline stage, even or by FLOPs "
        "(ParallelConfig.stage_split)."
    )
    for r in rows:
        lay = r["layout"]
        fits = ", ".join(
            f"group of {g}: α {1e6 * ab.alpha:.0f} us, β⁻¹ {ab.bandwidth / 1e9:.2f} GB/s"
            for g, ab in r["fits"].items()
        )
        blocks = [len(b) for b in stage_layers(c, lay.pp * a.chunks, r["split"])]
        busy = (
            "; stage F+B ms: "
            + " ".join(f"{1e3 * s:.0f}" for s in r["stage_busy"])
            + f" (blocks per stage: {blocks})"
            if lay.pp > 1
            else ""
        )
        split = f" {r['split']}" if lay.pp > 1 else ""
        print(f"{lay.tp}x{lay.pp}x{lay.dp}{split}: {fits or 'no communication fit (1 rank)'}{busy}")
    print(load())


if __name__ == "__main__":
    main()
