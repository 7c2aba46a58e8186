"""Shared helpers of the benchmark scripts: the benchmark model, interleaved timing, comm timers.

Timings on a shared machine are noisy: compare variants within one run, alternating them
(A B A B ...) so slow periods hit both, and report medians plus the machine's load.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import statistics
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from tpedu.model.config import GPTConfig

# The benchmark model: 4 layers, d 256, 8 heads, vocab 8192, seq 256 (batch 8, fp32).
# Untied embeddings: DTensor's plan shards the embedding and the head differently.
CONFIG = GPTConfig(8192, seq_len=256, n_layers=4, hidden=256, n_heads=8, tie_embeddings=False)
BATCH = 8
# The benchmarks time CPU ranks, one thread each (the setting): their meshes, timers and
# batches live on the CPU, so they ask for gloo even on a machine with GPUs.
BACKEND = "gloo"


def load() -> str:
    """The 1/5/15-minute load average, to print next to every table."""
    a, b, c = os.getloadavg()
    return f"load average {a:.2f} {b:.2f} {c:.2f} on {os.cpu_count()} CPUs"


def batch(
    config: GPTConfig = CONFIG, b: int = BATCH, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (b, config.seq_len)
    return (
        torch.randint(0, config.vocab_size, shape, generator=g),
        torch.randint(0, config.vocab_size, shape, generator=g),
    )


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


# A model small enough to check a benchmark's code path in seconds (figures mean nothing).
TINY = GPTConfig(512, seq_len=64, n_layers=2, hidden=64, n_heads=4, tie_embeddings=False)


class _TimedWork:
    """A work handle (async collective, isend, irecv) whose wait() adds its wall time to acc."""

    def __init__(self, work: dist.Work, acc: dict[str, float], kind: str) -> None:
        self._work, self._acc, self._kind = work, acc, kind

    def wait(self, *a: object, **k: object) -> object:
        t = time.perf_counter()
        try:
            return self._work.wait(*a, **k)
        finally:
            self._acc[self._kind] += time.perf_counter() - t

    def __getattr__(self, name: str) -> object:
        return getattr(self._work, name)


@contextlib.contextmanager
def patched_communication(
    buckets: dict[str, str], on_call: Callable[[str, inspect.BoundArguments], None] | None = None
) -> Iterator[dict[str, float]]:
    """While active, the torch.distributed functions named in `buckets` (name -> bucket) are
    wrapped: the wall time of each call, and of the wait() of the work handle it returns, is
    summed per bucket into the yielded dict; `on_call(name, its bound arguments)` runs first
    (outside the timing), if given."""
    originals = {n: getattr(dist, n) for n in buckets}
    acc = dict.fromkeys(buckets.values(), 0.0)

    def wrap(name: str, fn: Callable, bucket: str) -> Callable:
        signature = inspect.signature(fn) if on_call is not None else None

        def timed(*a: object, **k: object) -> object:
            if on_call is not None:
                on_call(name, signature.bind(*a, **k))
            t = time.perf_counter()
            out = fn(*a, **k)
            acc[bucket] += time.perf_counter() - t
            return _TimedWork(out, acc, bucket) if isinstance(out, dist.Work) else out

        return timed

    for n, bucket in buckets.items():
        setattr(dist, n, wrap(n, originals[n], bucket))
    try:
        yield acc
    finally:
        for n, fn in originals.items():
            setattr(dist, n, fn)


@contextlib.contextmanager
def timed_communication() -> Iterator[dict[str, float]]:
    """Accumulate wall time spent in torch.distributed communication (what tpedu calls).

    Includes waiting for the other ranks to arrive (skew): that is what a rank loses.
    Yields {"collective": s, "p2p": s}: wall time inside collectives and inside send/recv,
    isend/irecv and the `wait()` of any work handle they return (an async all-reduce that
    finished behind compute costs only its launch and a short wait: the exposed part). A
    pipeline stage's wait for its neighbour's activation (the bubble included) counts as p2p.
    """
    kinds = {
        "all_reduce": "collective",
        "all_gather_single": "collective",
        "reduce_scatter_single": "collective",
        "broadcast": "collective",
        "all_to_all_single": "collective",
        "send": "p2p",
        "recv": "p2p",
        "isend": "p2p",
        "irecv": "p2p",
    }
    with patched_communication(kinds) as acc:
        yield acc
