"""TP scaling on this machine: step time split into compute and communication, and the α-β
model's predicted communication time next to the measured one.

    .venv/bin/python benchmarks/bench_scaling.py [--tp 1 2 4] [--reps 5]

Per tp: α and β fitted to all-reduces of 4 KB-4 MB on this machine (tpedu.cost_model), one
traced training step (CommTracer: every collective's op, bytes, group), predicted comm time
= Σ α-β prediction of each traced collective; measured comm = wall time inside the collectives
(waiting for slower ranks included); compute = step - measured comm.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from harness import BATCH, CONFIG, batch, load, slowest, timed_collectives

import tpedu
from tpedu.cost_model import fit, measure
from tpedu.model import TPGPT, DenseGPT
from tpedu.tracer import CommTracer


def worker(reps: int) -> dict:
    tp = dist.get_world_size()
    ab = fit(measure("all_reduce", [4096, 65536, 1 << 20, 4 << 20])) if tp > 1 else None
    torch.manual_seed(0)
    model = TPGPT(DenseGPT(CONFIG), None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids, tgt = batch()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(ids, tgt).backward()
        model.sync_grads()
        opt.step()

    step()
    with CommTracer() as trace:
        step()
    steps, comms = [], []
    for _ in range(reps):
        dist.barrier()
        with timed_collectives() as acc:
            t = time.perf_counter()
            step()
            steps.append(slowest(time.perf_counter() - t))
        comms.append(slowest(acc[0]))
    predicted = sum(ab.predict(r.op, r.bytes, r.group_size) for r in trace.records) if ab else 0.0
    return {"step": statistics.median(steps), "comm": statistics.median(comms),
            "predicted": predicted, "calls": len(trace.records),
            "mbytes": trace.bytes() / 1e6, "ab": ab}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    c = CONFIG
    print(f"TPGPT {c.n_layers} layers, d {c.hidden}, vocab {c.vocab_size}, seq {c.seq_len}, "
          f"batch {BATCH}, fp32, AdamW; 1 thread per rank")  # fmt: skip
    print(load())
    print(f"{'tp':>3} {'step ms':>9} {'compute ms':>10} {'comm ms':>8} {'α-β ms':>7} "
          f"{'calls':>5} {'MB':>7} {'speed-up':>8} {'α us':>6} {'β GB/s':>7}")  # fmt: skip
    base = None
    for tp in a.tp:
        r = tpedu.launch(worker, tp, a.reps, timeout=1800)[0]
        base = base or r["step"] * tp if tp == 1 else base
        ab = r["ab"]
        speed = f"{base / r['step']:>8.2f}" if base else f"{'-':>8}"
        alpha = f"{1e6 * ab.alpha:>6.0f}" if ab else f"{'-':>6}"
        bw = f"{ab.bandwidth / 1e9:>7.2f}" if ab else f"{'-':>7}"
        print(f"{tp:>3} {1e3 * r['step']:>9.1f} {1e3 * (r['step'] - r['comm']):>10.1f} "
              f"{1e3 * r['comm']:>8.1f} {1e3 * r['predicted']:>7.1f} {r['calls']:>5} "
              f"{r['mbytes']:>7.1f} {speed} {alpha} {bw}")  # fmt: skip
    print(load())


if __name__ == "__main__":
    main()
