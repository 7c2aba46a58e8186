"""Lesson 02: the α-β model of collective cost: time = (steps)·α + (bytes each rank sends)·β.

α is the fixed latency of one message, β the seconds per byte (1/bandwidth). For the ring
algorithms NCCL and gloo use on t ranks and a tensor of n bytes, each rank sends:

    all-reduce      2(t-1)/t · n   in 2(t-1) steps   (reduce-scatter, then all-gather)
    all-gather       (t-1)/t · n   in  (t-1) steps   (n = bytes of the gathered output)
    reduce-scatter   (t-1)/t · n   in  (t-1) steps   (n = bytes of the full input)
    all-to-all       (t-1)/t · n   in  (t-1) steps
    broadcast              n       in  (t-1) steps   (pipelined ring: latency grows with t)
    send / recv            n       in      1 step

So an all-reduce costs exactly a reduce-scatter plus an all-gather, which is why sequence
parallelism (lesson 08) moves the same bytes as plain tensor parallelism.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from tpedu.comm import collectives as C
from tpedu.comm.device import device
from tpedu.comm.volumes import ring_bytes, ring_steps


@dataclass(frozen=True)
class AlphaBeta:
    """Latency α (seconds per step) and inverse bandwidth β (seconds per byte)."""

    alpha: float
    beta: float

    @property
    def bandwidth(self) -> float:
        """Bytes per second, 1/β."""
        return 1.0 / self.beta if self.beta > 0 else float("inf")

    def predict(self, op: str, nbytes: float, world_size: int) -> float:
        """Predicted seconds for one `op` of `nbytes` bytes over `world_size` ranks."""
        if world_size == 1:
            return 0.0
        steps = ring_steps(op, world_size)
        return steps * self.alpha + ring_bytes(op, nbytes, world_size) * self.beta


@dataclass(frozen=True)
class Sample:
    """One measured collective: op, message size, ranks, median seconds."""

    op: str
    nbytes: int
    world_size: int
    seconds: float


def fit(samples: list[Sample]) -> AlphaBeta:
    """Least-squares fit of α and β (both kept non-negative) to measured samples."""
    rows = [s for s in samples if s.world_size > 1]
    if len(rows) < 2:
        raise ValueError("fitting α and β needs at least two samples with world_size > 1")
    a = np.array(
        [[ring_steps(s.op, s.world_size), ring_bytes(s.op, s.nbytes, s.world_size)] for s in rows]
    )
    if np.linalg.matrix_rank(a) < 2:  # e.g. one message size: bytes ∝ steps in every row
        raise ValueError(
            "fitting α and β needs samples at two or more message sizes "
            "(one size cannot tell latency from bandwidth)"
        )
    y = np.array([s.seconds for s in rows])
    # Relative error matters for sizes spanning decades: weight each row by 1/seconds.
    w = 1.0 / np.maximum(y, 1e-9)
    (alpha, beta), *_ = np.linalg.lstsq(a * w[:, None], y * w, rcond=None)
    if alpha < 0 or beta < 0:  # refit the other parameter alone
        if alpha < 0:
            beta = float(np.sum(a[:, 1] * y * w * w) / np.sum((a[:, 1] * w) ** 2))
            alpha = 0.0
        else:
            alpha = float(np.sum(a[:, 0] * y * w * w) / np.sum((a[:, 0] * w) ** 2))
            beta = 0.0
    return AlphaBeta(float(alpha), float(beta))


def measure(
    op: str,
    sizes: list[int],
    group: dist.ProcessGroup | None = None,
    repeats: int = 5,
    warmup: int = 2,
    dtype: torch.dtype = torch.float32,
) -> list[Sample]:
    """Time `op` for each message size (in bytes) on every rank of `group`; collective call.

    Returns the median over `repeats` of the slowest rank's time, the same on every rank.
    """
    t = dist.get_world_size(group)
    itemsize = torch.empty((), dtype=dtype).element_size()
    dev = device()
    samples = []
    for nbytes in sizes:
        numel = max(t, nbytes // itemsize // t * t)
        x = torch.ones(numel, dtype=dtype, device=dev)
        times = []
        for i in range(warmup + repeats):
            _sync(dev)
            dist.barrier(group=group)
            start = time.perf_counter()
            if op == "all_reduce":
                C.all_reduce(x, group=group)
            elif op == "all_gather":
                C.all_gather(x[: numel // t], group=group)
            elif op == "reduce_scatter":
                C.reduce_scatter(x, group=group)
            elif op == "broadcast":
                C.broadcast(x, src=dist.get_global_rank(group, 0) if group else 0, group=group)
            elif op == "all_to_all":
                C.all_to_all(x, group=group)
            else:
                raise ValueError(f"measure() does not time {op!r}")
            _sync(dev)
            if i >= warmup:
                times.append(time.perf_counter() - start)
        slowest = torch.tensor([statistics.median(times)], dtype=torch.float64, device=dev)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        samples.append(Sample(op, numel * itemsize, t, float(slowest.item())))
    return samples


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
