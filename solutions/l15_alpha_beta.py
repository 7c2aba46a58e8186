"""Reference for exercises/l15_alpha_beta.py: the α-β price of a step, and fitting α and β."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tpedu.comm.tracer import CommRecord

# (steps, fraction of n each rank sends) of each op on N > 1 ranks, under the ring algorithms.
_RING = {
    "all_reduce": lambda n: (2 * (n - 1), 2 * (n - 1) / n),
    "all_gather": lambda n: (n - 1, (n - 1) / n),
    "reduce_scatter": lambda n: (n - 1, (n - 1) / n),
    "send": lambda n: (1, 1.0),
    "recv": lambda n: (1, 0.0),  # the sender pays for the bytes; the receiver waits one latency
}


def ring_all_reduce_seconds(nbytes: float, ranks: int, alpha: float, beta: float) -> float:
    if ranks < 1:
        raise ValueError(f"ranks must be at least 1, got {ranks}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be ≥ 0, got {nbytes}")
    if ranks == 1:
        return 0.0
    steps = 2 * (ranks - 1)  # N - 1 to reduce-scatter, N - 1 to all-gather
    return steps * (alpha + nbytes / ranks * beta)  # each step moves one chunk of n/N bytes


def step_comm_seconds(records: Sequence[CommRecord], alpha: float, beta: float) -> float:
    total = 0.0
    for r in records:
        if r.op not in _RING:
            raise ValueError(
                f"step_comm_seconds does not price {r.op!r}; it prices {', '.join(_RING)}"
            )
        if r.group_size == 1:  # a one-rank group moves nothing
            continue
        steps, share = _RING[r.op](r.group_size)
        total += steps * alpha + share * r.bytes * beta
    return total


def fit_alpha_beta(sizes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    if len(sizes) != len(seconds):
        raise ValueError(f"got {len(sizes)} sizes but {len(seconds)} times: give one per size")
    if len(set(sizes)) < 2:
        raise ValueError("fitting α and β needs two or more distinct message sizes")
    n = np.asarray(sizes, dtype=np.float64)
    y = np.asarray(seconds, dtype=np.float64)
    if (y <= 0).any():
        raise ValueError("every measured time must be > 0 seconds")
    # Dividing each row by its time turns absolute errors into relative ones.
    w = 1.0 / y
    a = np.stack([w, n * w], axis=1)  # columns: the weights of α and of β
    (alpha, beta), *_ = np.linalg.lstsq(a, np.ones_like(y), rcond=None)
    if alpha < 0:  # no latency: fit the bandwidth alone, time = β·bytes
        return 0.0, float(np.sum(a[:, 1]) / np.sum(a[:, 1] ** 2))
    if beta < 0:  # no bandwidth term: time = α
        return float(np.sum(a[:, 0]) / np.sum(a[:, 0] ** 2)), 0.0
    return float(alpha), float(beta)
