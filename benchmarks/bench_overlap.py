"""Gain of overlapping communication with backward: TP (default) or DP (--dp).

    .venv/bin/python benchmarks/bench_overlap.py [--tp 2] [--reps 9]
    .venv/bin/python benchmarks/bench_overlap.py --dp 2 [--buckets 16384 65536 262144] [--reps 9]

TP: a stack of Megatron MLPs (column fc1 -> GELU -> row fc2), forward + backward, with fc1
either tpedu.tp.layers.column_parallel_linear (f, then F.linear: nothing overlaps) or
tpedu.tp.overlap.linear_with_async_grad_all_reduce (all-reduce of dL/dx issued before dL/dW).

DP: the benchmark model (harness.CONFIG, dense) on dp ranks, the global batch harness.BATCH
split over them; forward + backward + gradient averaging, three ways on identical weights:
"after" = backward, then tpedu.parallel.data_parallel.all_reduce_grads (one blocking all-reduce per
parameter: no overlap, no buckets); "bucketed" = backward, then DataParallel's buckets
all-reduced (the same messages as overlapped, launched only after backward); "overlap" =
DataParallel: each bucket's async all-reduce launched from the backward hooks as soon as its
gradients are complete. The averaged gradients must be identical (max |difference| printed).

Alternating runs (A B A B ...), medians of the slowest rank.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import BACKEND, BATCH, CONFIG, TINY, batch, interleaved, load, timed_communication

import tpedu
from tpedu.comm.tracer import CommTracer
from tpedu.model.config import GPTConfig
from tpedu.model.dense import DenseGPT
from tpedu.parallel.data_parallel import DataParallel, all_reduce_grads
from tpedu.tp.layers import column_parallel_linear, row_parallel_linear
from tpedu.tp.overlap import linear_with_async_grad_all_reduce
from tpedu.tp.sharding import shard


def worker(reps: int, tokens: int, hidden: int, layers: int) -> dict:
    torch.manual_seed(0)
    ws = [
        (
            shard(torch.randn(4 * hidden, hidden) * 0.02, 0),
            shard(torch.randn(4 * hidden) * 0, 0),
            shard(torch.randn(hidden, 4 * hidden) * 0.02, 1),
        )
        for _ in range(layers)
    ]
    for w in ws:
        for p in w:
            p.requires_grad_()
    x0 = torch.randn(tokens, hidden)

    def run(col) -> None:
        x = x0.clone().requires_grad_()
        h = x
        for w1, b1, w2 in ws:
            h = h + row_parallel_linear(F.gelu(col(h, w1, b1, None)), w2, None)
        h.sum().backward()

    t = interleaved(
        {
            "plain": lambda: run(column_parallel_linear),
            "async": lambda: run(linear_with_async_grad_all_reduce),
        },
        reps,
    )
    return {"tp": dist.get_world_size(), **t}


def dp_worker(reps: int, config: GPTConfig, buckets: list[int]) -> dict:
    """One DP rank: time after / bucketed / overlap (one model copy per bucket size: a
    DataParallel's hooks stay on its parameters), then compare their gradients."""
    dp, rank, dev = dist.get_world_size(), dist.get_rank(), tpedu.device()
    b = BATCH // dp
    ids, tgt = batch(config)
    x, y = ids[rank * b : (rank + 1) * b].to(dev), tgt[rank * b : (rank + 1) * b].to(dev)
    models, dps = [], []
    for n in buckets:
        torch.manual_seed(0)  # the same weights in every copy
        models.append(DenseGPT(config).to(dev))
        dps.append(DataParallel(models[-1], None, bucket_numel=n))

    def run(how: str, i: int = 0) -> None:
        model, dpar = models[i], dps[i]
        model.zero_grad(set_to_none=True)
        if how == "overlap":
            model(x, y).backward()  # hooks launch the buckets' all-reduces during backward
            dpar.finish()
            return
        with dpar.no_sync():
            model(x, y).backward()
        if how == "bucketed":
            dpar.finish()  # every bucket launched now, after backward
        else:
            all_reduce_grads(model.parameters())

    variants = {"after": ("after", 0)}
    for i, n in enumerate(buckets):
        variants |= {f"bucketed {n}": ("bucketed", i), f"overlap {n}": ("overlap", i)}
    comm: dict[str, list[float]] = {k: [] for k in variants}

    def timed(name: str) -> None:
        with timed_communication() as acc:
            run(*variants[name])
        comm[name].append(acc["collective"])

    t = interleaved({k: (lambda k=k: timed(k)) for k in variants}, reps)
    rows = {}
    for name, (how, i) in variants.items():
        with CommTracer() as trace:
            run(how, i)
        grads = [p.grad.clone() for p in models[i].parameters()]
        ref = rows["after"]["grads"] if rows else grads
        diff = max((g - r).abs().max().item() for g, r in zip(grads, ref, strict=True))
        rows[name] = {
            "ms": 1e3 * t[name],
            "comm": 1e3 * statistics.median(comm[name][-reps:]),
            "calls": trace.count("all_reduce"),
            "mb": trace.bytes() / 1e6,
            "diff": diff,
            "grads": grads,
        }
    for r in rows.values():
        del r["grads"]
    return rows


def dp_main(a: argparse.Namespace) -> None:
    c = TINY if a.tiny else CONFIG
    if any(BATCH % dp for dp in a.dp):
        raise SystemExit(f"--dp must divide the global batch {BATCH} (strong scaling)")
    print(
        f"DenseGPT {c.n_layers} layers, d {c.hidden}, vocab {c.vocab_size}, seq {c.seq_len}, "
        f"global batch {BATCH} split over dp; fp32; forward + backward + gradient average"
    )
    print(load())
    print(
        f"{'dp':>3} {'variant':<16} {'ms':>8} {'comm ms':>8} {'calls':>5} {'MB':>6} "
        f"{'saved':>7} {'overlap':>7} {'max |Δgrad|':>11}"
    )
    for dp in a.dp:
        ranks = tpedu.launch(dp_worker, dp, a.reps, c, a.buckets, timeout=1800, backend=BACKEND)
        rows = ranks[0]
        base = rows["after"]["ms"]
        for name, r in rows.items():
            comm = max(rk[name]["comm"] for rk in ranks)  # slowest rank
            diff = max(rk[name]["diff"] for rk in ranks)
            pair = rows.get(name.replace("overlap", "bucketed"), r)  # the same buckets, after
            gain = f"{100 * (1 - r['ms'] / pair['ms']):>6.1f}%" if pair is not r else f"{'':>7}"
            print(
                f"{dp:>3} {name:<16} {r['ms']:>8.1f} {comm:>8.1f} {r['calls']:>5} "
                f"{r['mb']:>6.1f} {100 * (1 - r['ms'] / base):>6.1f}% {gain} "
                f"{diff:>11.1e}"
            )
    print(
        "ms: median of forward + backward + gradient average (slowest rank); comm ms: time "
        "inside all-reduce calls and waits (the exposed part; slowest rank); saved: vs after; "
        "overlap: overlap N vs bucketed N (N = bucket_numel: the same messages, launched "
        "during vs after backward); max |Δgrad|: vs after, worst rank"
    )
    print(load())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[2])
    ap.add_argument("--dp", type=int, nargs="+", help="DP mode at these dp (instead of TP)")
    ap.add_argument(
        "--buckets",
        type=int,
        nargs="+",
        default=[2**16],
        help="DP mode: bucket_numel values to sweep",
    )
    ap.add_argument("--tiny", action="store_true", help="a tiny model: checks the code path")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    a = ap.parse_args()
    if a.dp:
        return dp_main(a)
    if a.tiny:
        a.tokens, a.hidden, a.layers = 128, 64, 2
    print(f"{a.layers} MLP blocks, {a.tokens} tokens, hidden {a.hidden}, ffn {4 * a.hidden}, fp32")
    print(load())
    print(f"{'tp':>3} {'plain ms':>9} {'async ms':>9} {'saved':>7}")
    for tp in a.tp:
        r = tpedu.launch(
            worker, tp, a.reps, a.tokens, a.hidden, a.layers, timeout=1800, backend=BACKEND
        )[0]
        print(
            f"{tp:>3} {1e3 * r['plain']:>9.1f} {1e3 * r['async']:>9.1f} "
            f"{100 * (1 - r['async'] / r['plain']):>6.1f}%"
        )
    print(load())


if __name__ == "__main__":
    main()
