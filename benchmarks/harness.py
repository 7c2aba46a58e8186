"""Shared helpers of the benchmark scripts: the benchmark model, interleaved timing, comm timers.

Timings on a shared machine are noisy: compare variants within one run, alternating them
(A B A B ...) so slow periods hit both, and report medians plus the machine's load.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from tpedu.model import GPTConfig

# The benchmark model: 4 layers, d 256, 8 heads, vocab 8192, seq 256 (batch 8, fp32).
# Untied embeddings: DTensor's plan shards the embedding and the head differently.
CONFIG = GPTConfig(8192, seq_len=256, n_layers=4, hidden=256, n_heads=8, tie_embeddings=False)
BATCH = 8


def load() -> str:
    """The 1/5/15-minute load average, to print next to every table."""
    a, b, c = os.getloadavg()
    return f"load average {a:.2f} {b:.2f} {c:.2f} on {os.cpu_count()} CPUs"


def batch(config: GPTConfig = CONFIG, b: int = BATCH, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape = (b, config.seq_len)
    return (torch.randint(0, config.vocab_size, shape, generator=g),
            torch.randint(0, config.vocab_size, shape, generator=g))  # fmt: skip


def slowest(seconds: float, group: dist.ProcessGroup | None = None) -> float:
    """The slowest rank's time (a step is as slow as its slowest rank)."""
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def interleaved(
    fns: dict[str, Callable[[], object]], reps: int, warmup: int = 2
) -> dict[str, float]:
    """Median seconds of each fn (slowest rank), running them alternately. Collective."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(warmup + reps):
        for name, fn in fns.items():
            dist.barrier()
            t = time.perf_counter()
            fn()
            dt = slowest(time.perf_counter() - t)
            if i >= warmup:
                times[name].append(dt)
    return {k: statistics.median(v) for k, v in times.items()}


@contextlib.contextmanager
def timed_collectives() -> Iterator[list[float]]:
    """Accumulate wall time spent inside torch.distributed collectives (what tpedu calls).

    Includes waiting for the other ranks to arrive (skew): that is what a rank loses.
    """
    names = ["all_reduce", "all_gather_single", "reduce_scatter_single", "broadcast",
             "all_to_all_single", "send", "recv"]  # fmt: skip
    originals = {n: getattr(dist, n) for n in names}
    acc = [0.0]

    def wrap(fn: Callable) -> Callable:
        def timed(*a: object, **k: object) -> object:
            t = time.perf_counter()
            out = fn(*a, **k)
            acc[0] += time.perf_counter() - t
            return out

        return timed

    for n in names:
        setattr(dist, n, wrap(originals[n]))
    try:
        yield acc
    finally:
        for n, fn in originals.items():
            setattr(dist, n, fn)
