"""ZeRO stages on CPU ranks: step time, traffic and memory per rank, and what prefetching hides.

    .venv/bin/python benchmarks/bench_zero.py [--dp 2] [--reps 5]

dp ranks (1 thread each) train the benchmark model (harness.CONFIG) with plain DP (bucketed
all-reduce), ZeRO-1, ZeRO-2 and ZeRO-3 (with and without prefetching the next block's all-gather),
alternating the variants step by step so machine noise hits all; medians of the slowest rank.
Per variant, measured on rank 0: elements sent per step by the collectives (tracer), bytes of
whole parameters, of gradients after finish() and of AdamW state, ZeRO-3's peak of gathered
parameters, and the seconds compute waited for all-gathers (exposed communication).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from harness import BACKEND, BATCH, CONFIG, batch, load, slowest

import tpedu
from tpedu.comm.tracer import CommTracer
from tpedu.model.config import GPTConfig
from tpedu.model.sharded_init import build_sharded
from tpedu.parallel.data_parallel import DataParallel
from tpedu.parallel.mesh import Layout, Mesh
from tpedu.train.config import TrainConfig
from tpedu.train.optim import make_optimizer, make_sharded

VARIANTS = ("dp", "zero1", "zero2", "zero3", "zero3, no prefetch")
MB = 2**20


def build(variant: str, mesh: Mesh, config: GPTConfig) -> tuple[torch.nn.Module, object, object]:
    """(model, gradient reducer, optimizer) for a variant, from the same seed."""
    model = build_sharded(config, mesh.tp_group, seed=0)[0]
    cfg = TrainConfig()
    if variant == "dp":
        return model, DataParallel(model, mesh.dp_group), make_optimizer(model, cfg)
    sdp = make_sharded([model], cfg, int(variant[4]), mesh)
    sdp.prefetch = variant != "zero3, no prefetch"
    return model, sdp, sdp


def step(model: torch.nn.Module, reducer: object, opt: object, x: torch.Tensor, y: torch.Tensor):
    opt.zero_grad(set_to_none=True)
    loss = model(x, y)
    loss.backward()
    reducer.finish()
    opt.step()
    return loss.item()


def formula(variant: str, reducer: object, params: int, n: int) -> float:
    """Elements sent per rank per step / Ψ, predicted: the ring's (N-1)/N per element of an
    all-gather or reduce-scatter, twice that of an all-reduce (ZeRO: of the padded buffers)."""
    if variant == "dp":
        return 2 * (n - 1) / n
    padded = sum(b.n * b.size for b in reducer.buffers)
    blocks = sum(b.n * b.size for u in reducer.blocks for b in u.buffers)
    again = blocks if variant.startswith("zero3") else 0  # the blocks' all-gather in backward
    return (n - 1) / n * (2 * padded + again) / params


def run(dp: int, reps: int, config: GPTConfig = CONFIG) -> dict:
    """On each rank: per variant, the median step time (slowest rank) and rank 0's figures."""
    torch.set_num_threads(1)
    mesh = Mesh(Layout(1, 1, dp))
    x, y = (t.chunk(dp)[mesh.dp_rank] for t in batch(config, BATCH))
    runs = {v: build(v, mesh, config) for v in VARIANTS}
    out = {}
    for v, (model, reducer, opt) in runs.items():
        params = sum(p.numel() for p in model.parameters())
        step(model, reducer, opt, x, y)  # warm-up: AdamW allocates its states
        with CommTracer() as t:
            loss = step(model, reducer, opt, x, y)
        sharded = v != "dp"
        out[v] = {
            "loss": loss,
            "sent": t.wire_bytes() / 4,  # fp32 elements this rank sent
            "params": params,
            # the storages held after the step, each once (ZeRO-1/2's shards are views of the
            # whole parameters, ZeRO-1's shard means views of its whole gradient buffer)
            "weights": reducer.weight_bytes() if sharded else 4 * params,
            "grads": reducer.grad_bytes() if sharded else 4 * params,
            "state": 4 * (reducer.state_numel() if sharded else 2 * params),
            "peak": max(reducer.peak_gathered, reducer.gathered_bytes()) if sharded else 4 * params,
            "formula": formula(v, reducer, params, dp),
            "times": [],
            "waited": [],
        }
    for _ in range(reps):
        for v, (model, reducer, opt) in runs.items():
            before = reducer.gather_wait_seconds() if v != "dp" else 0.0
            start = time.perf_counter()
            step(model, reducer, opt, x, y)
            out[v]["times"].append(slowest(time.perf_counter() - start))
            if v != "dp":
                out[v]["waited"].append(reducer.gather_wait_seconds() - before)
    for v in out:
        out[v]["time"] = statistics.median(out[v].pop("times"))
        waited = out[v].pop("waited")
        out[v]["waited"] = statistics.median(waited) if waited else 0.0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    res = tpedu.launch(run, a.dp, a.dp, a.reps, backend=BACKEND)[0]
    psi = res["dp"]["params"]
    print(f"{psi / 1e6:.1f} M parameters, dp {a.dp}, batch {BATCH}, fp32; {load()}")
    head = (
        f"{'variant':<20}{'step ms':>9}{'exposed AG ms':>14}{'sent / Ψ':>9}{'formula':>8}"
        f"{'weights MB':>11}{'grads MB':>9}{'AdamW MB':>9}{'peak MB':>8}"
    )
    print(head)
    for v, r in res.items():
        print(
            f"{v:<20}{r['time'] * 1e3:>9.1f}{r['waited'] * 1e3:>14.1f}{r['sent'] / psi:>9.3f}"
            f"{r['formula']:>8.3f}"
            f"{r['weights'] / MB:>11.1f}{r['grads'] / MB:>9.1f}{r['state'] / MB:>9.1f}"
            f"{r['peak'] / MB:>8.1f}"
        )
    print(
        "formula, sent / Ψ: DP 2·(N-1)/N; ZeRO-1/2 the same over the padded buffers; ZeRO-3 "
        "(N-1)/N·(2 + Ψ_blocks/Ψ): the root's all-gather is not repeated in backward"
    )
    print(
        "weights, grads: the storages held after the step, each once (ZeRO-1/2 step their "
        "shards in place in the whole parameters; ZeRO-1's shard means lie in its whole gradient "
        "buffer); peak: whole parameters at once in the step"
    )


if __name__ == "__main__":
    main()
