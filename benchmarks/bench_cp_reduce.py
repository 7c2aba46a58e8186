"""Context parallelism's gradient sum, folded into data parallelism's reduction or run apart,
at cp 2 × dp 2 (4 CPU ranks), full training steps alternating, in one run.

    .venv/bin/python benchmarks/bench_cp_reduce.py [--reps 10] [--tiny] [--zero]

    folded     what train runs: DataParallel's buckets all-reduce over the dp·cp group during
               backward, divided by dp (tpedu.train.optim.make_data_parallel)
    apart      the two reductions it replaces: DataParallel's buckets over dp during backward,
               then one blocking all-reduce per parameter over cp after it
               (tpedu.cp.gradients.sum_over_cp)

--zero: ZeRO-2 for both (folded: sharded over dp·cp, every reduce-scatter issued from backward;
apart: sharded over dp, every parameter deferred until after the sum over cp). Both variants
start from the same weights and give the same gradients, summed in another order (checked
first, to float32 rounding). Printed: the step's median (slowest rank, wall clock here: four
ranks share this machine's cores), the reduction's calls per step, and apart / folded.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

import torch
from harness import BACKEND, BATCH, CONFIG, TINY, batch, interleaved, load

import tpedu
from tpedu.comm.tracer import CommTracer
from tpedu.cp.gradients import sum_over_cp
from tpedu.model.config import GPTConfig
from tpedu.parallel.config import ParallelConfig
from tpedu.parallel.data_parallel import DataParallel
from tpedu.parallel.mesh import Mesh
from tpedu.parallel.zero import ShardedDataParallel
from tpedu.train.config import TrainConfig
from tpedu.train.optim import decayed, make_data_parallel, make_optimizer
from tpedu.train.step import stage_chunks

PARALLEL = ParallelConfig(cp=2, dp=2)


def variant(
    config: GPTConfig, mesh: Mesh, folded: bool, zero: int
) -> tuple[torch.nn.Module, object, Callable[[], None]]:
    """(model, optimizer, the reduction after backward) of one variant, from seed 0."""
    cfg = TrainConfig(batch=BATCH)
    (model,) = stage_chunks(config, PARALLEL, mesh, seed=0)
    if folded:
        dpar, opt = make_data_parallel([model], cfg, zero, mesh)
        return model, opt, dpar.finish
    if zero:
        opt = ShardedDataParallel(
            [model],
            mesh.dp_group,
            zero,
            decay=decayed,
            weight_of=lambda chunk, name: 1.0,  # the norm is not timed here
            defer=list(model.parameters()),  # summed over cp first: after backward
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
        )

        def sharded() -> None:
            sum_over_cp(model.parameters(), mesh.cp_group)
            opt.finish()

        return model, opt, sharded
    dpar, opt = DataParallel(model, mesh.dp_group), make_optimizer(model, cfg)

    def apart() -> None:
        dpar.finish()
        sum_over_cp(model.parameters(), mesh.cp_group)

    return model, opt, apart


def run(config: GPTConfig, reps: int, zero: int) -> dict:
    mesh = Mesh(PARALLEL.layout)
    ids, tgt = batch(config)
    b = BATCH // 2
    mine = slice(mesh.dp_rank * b, (mesh.dp_rank + 1) * b)
    variants = {name: variant(config, mesh, name == "folded", zero) for name in ("folded", "apart")}
    x, y = (variants["folded"][0].local_sequence(t[mine]) for t in (ids, tgt))

    def step(name: str, update: bool = True) -> Callable[[], None]:
        model, opt, reduce = variants[name]

        def once() -> None:
            opt.zero_grad(set_to_none=True)
            model(x, y).backward()
            reduce()
            if update:
                opt.step()

        return once

    grads = {}
    for name in variants:  # same weights, same batch: the same gradients
        step(name, update=False)()
        opt = variants[name][1]
        shards = opt.shards() if isinstance(opt, ShardedDataParallel) else None
        grads[name] = torch.cat(
            [s.grad.reshape(-1) for s in shards]
            if shards is not None
            else [p.grad.reshape(-1) for p in variants[name][0].parameters()]
        )
    calls = {}
    for name in variants:
        with CommTracer() as trace:
            step(name)()
        calls[name] = {
            (g, op): n
            for (g, op, _), (n, _, _) in trace.summary().items()
            if op in ("all_reduce", "reduce_scatter") and g in ("dp", "cp")
        }
    times = interleaved({name: step(name) for name in variants}, reps)
    same = None
    if not zero:  # ZeRO's shards cut the flat buffers over other groups: compare whole grads
        diff = (grads["folded"] - grads["apart"]).abs().max()
        same = float(diff / grads["apart"].abs().max())
    return {"times": times, "calls": calls, "same": same}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--tiny", action="store_true", help="the tiny model (a smoke run)")
    ap.add_argument("--zero", action="store_true", help="ZeRO-2 in both variants")
    a = ap.parse_args()
    config = dataclasses.replace(TINY if a.tiny else CONFIG, dropout=0.0)
    zero = 2 if a.zero else 0
    res = tpedu.launch(run, 4, config, a.reps, zero, backend=BACKEND)[0]
    print(f"cp 2 × dp 2, batch {BATCH}, s {config.seq_len}, ZeRO-{zero}, fp32; {load()}")
    if res["same"] is not None:
        print(f"gradients: folded vs apart, max |diff| / max |g| = {res['same']:.1e}")
    for name, t in res["times"].items():
        calls = ", ".join(f"{n} {op} on {g}" for (g, op), n in sorted(res["calls"][name].items()))
        print(f"{name:<8}{t * 1e3:>9.1f} ms  {calls}")
    ratio = res["times"]["apart"] / res["times"]["folded"]
    print(f"apart / folded: {ratio:.2f}")


if __name__ == "__main__":
    main()
