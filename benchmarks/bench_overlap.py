"""Gain of overlapping the column-parallel backward all-reduce with the weight gradient.

    .venv/bin/python benchmarks/bench_overlap.py [--tp 2] [--reps 9]

A stack of Megatron MLPs (column fc1 -> GELU -> row fc2), forward + backward, with fc1 either
tpedu.layers.column_parallel_linear (f, then F.linear: nothing overlaps) or
tpedu.overlap.linear_with_async_grad_allreduce (all-reduce of dL/dx issued before dL/dW).
Alternating runs, medians of the slowest rank.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import interleaved, load

import tpedu
from tpedu.layers import column_parallel_linear, row_parallel_linear
from tpedu.overlap import linear_with_async_grad_allreduce
from tpedu.sharding import shard


def worker(reps: int, tokens: int, hidden: int, layers: int) -> dict:
    torch.manual_seed(0)
    ws = [(shard(torch.randn(4 * hidden, hidden) * 0.02, 0), shard(torch.randn(4 * hidden) * 0, 0),
           shard(torch.randn(hidden, 4 * hidden) * 0.02, 1)) for _ in range(layers)]  # fmt: skip
    for w in ws:
        for p in w:
            p.requires_grad_()
    x0 = torch.randn(tokens, hidden)

    def run(col) -> None:  # noqa: ANN001
        x = x0.clone().requires_grad_()
        h = x
        for w1, b1, w2 in ws:
            h = h + row_parallel_linear(F.gelu(col(h, w1, b1, None)), w2, None)
        h.sum().backward()

    t = interleaved({"plain": lambda: run(column_parallel_linear),
                     "async": lambda: run(linear_with_async_grad_allreduce)}, reps)  # fmt: skip
    return {"tp": dist.get_world_size(), **t}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[2])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    a = ap.parse_args()
    print(f"{a.layers} MLP blocks, {a.tokens} tokens, hidden {a.hidden}, ffn {4 * a.hidden}, fp32")
    print(load())
    print(f"{'tp':>3} {'plain ms':>9} {'async ms':>9} {'saved':>7}")
    for tp in a.tp:
        r = tpedu.launch(worker, tp, a.reps, a.tokens, a.hidden, a.layers, timeout=1800)[0]
        print(f"{tp:>3} {1e3 * r['plain']:>9.1f} {1e3 * r['async']:>9.1f} "
              f"{100 * (1 - r['async'] / r['plain']):>6.1f}%")  # fmt: skip
    print(load())


if __name__ == "__main__":
    main()
