"""Lesson 02: how much each rank sends, and in how many steps, for each collective on t ranks.

`ring_bytes(op, n, t)` is the bytes one rank sends for a tensor of n bytes under the ring
algorithms NCCL and gloo use (all-reduce 2(t-1)/t·n, all-gather and reduce-scatter (t-1)/t·n);
`ring_steps(op, t)` is the number of sequential messages, each paying the latency α. The tracer
(tpedu.comm.tracer) and the α-β model (tpedu.comm.cost_model) both count with them.
"""

from __future__ import annotations

_VOLUME = {  # fraction of n that each rank sends, as a function of t
    "all_reduce": lambda t: 2 * (t - 1) / t,
    "all_gather": lambda t: (t - 1) / t,
    "reduce_scatter": lambda t: (t - 1) / t,
    "all_to_all": lambda t: (t - 1) / t,
    "broadcast": lambda t: 1.0 if t > 1 else 0.0,
    "send": lambda t: 1.0,
    "recv": lambda t: 0.0,
}


_STEPS = {
    "all_reduce": lambda t: 2 * (t - 1),
    "all_gather": lambda t: t - 1,
    "reduce_scatter": lambda t: t - 1,
    "all_to_all": lambda t: t - 1,
    "broadcast": lambda t: t - 1,
    "send": lambda t: 1,
    "recv": lambda t: 1,
}


OPS = tuple(_VOLUME)


def _check(op: str) -> None:
    if op not in _VOLUME:
        raise ValueError(f"unknown collective {op!r}; expected one of {', '.join(OPS)}")


def ring_bytes(op: str, nbytes: float, world_size: int) -> float:
    """Bytes one rank sends for `op` on a tensor of `nbytes` bytes over `world_size` ranks."""
    _check(op)
    return _VOLUME[op](world_size) * nbytes


def ring_steps(op: str, world_size: int) -> int:
    """Sequential message steps (each paying latency α) of the ring algorithm for `op`."""
    _check(op)
    return int(_STEPS[op](world_size))
