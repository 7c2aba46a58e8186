"""Lesson 09: what context parallelism sends, as formulas the tracer checks, and their α-β time.

Ring attention, per layer, on every rank (read off RingAttention: each K/V message is one
[b, n_kv, s/cp, d] tensor, KV heads, not the query heads GQA expands them to):

    forward    2(cp − 1) sends: k and v, at steps 0 .. cp − 2 (the last block is not passed on)
    backward   2(cp − 1) sends of k and v again (the blocks travel the ring a second time)
               + 2cp sends of dk and dv (each block's gradient travels with it and needs one
               more hop, cp in all, to arrive back at its owner)

so backward sends 4cp − 2 messages, forward 2cp − 2; full recomputation adds a forward's worth
to backward. Ulysses, per layer: 4 all-to-alls forward (q, k, v: sequence shards -> head shards;
out: back) and their 4 transposes backward, each of the tensor's [b, h, s/cp, d] elements, of
which a rank sends (cp − 1)/cp.

α-β time (tpedu.comm.cost_model): a ring step sends k and v, two messages of B bytes, so the
forward's exchange costs 2(cp − 1)·(α + B·β) if nothing overlaps it; Ulysses' forward costs
4 all-to-alls, each (cp − 1)·α + (cp − 1)/cp · bytes · β.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from tpedu.comm import collectives
from tpedu.comm.cost_model import AlphaBeta
from tpedu.comm.device import device
from tpedu.cp.ring import Ring


def ring_messages(
    batch: int,
    n_kv_heads: int,
    s: int,
    cp: int,
    head_dim: int,
    itemsize: int,
    n_layers: int = 1,
    full_recompute: bool = False,
) -> dict[str, tuple[int, int]]:
    """{"forward" | "backward": (sends, bytes)} that one rank's ring attention issues per step.

    n_kv_heads: the KV heads on this rank (after tensor parallelism)."""
    if cp == 1:
        return {"forward": (0, 0), "backward": (0, 0)}
    nbytes = batch * n_kv_heads * (s // cp) * head_dim * itemsize
    fwd = 2 * (cp - 1)
    bwd = 2 * (cp - 1) + 2 * cp + (fwd if full_recompute else 0)
    return {
        "forward": (n_layers * fwd, n_layers * fwd * nbytes),
        "backward": (n_layers * bwd, n_layers * bwd * nbytes),
    }


def ulysses_messages(
    batch: int,
    n_heads: int,
    n_kv_heads: int,
    s: int,
    cp: int,
    head_dim: int,
    itemsize: int,
    n_layers: int = 1,
) -> dict[str, tuple[int, int]]:
    """{"forward" | "backward": (all-to-alls, logical bytes)} of one rank's Ulysses attention.

    The logical bytes are the tensors' (what the tracer's `bytes` sums); a rank sends
    (cp − 1)/cp of them (the tracer's `wire_bytes`)."""
    if cp == 1:
        return {"forward": (0, 0), "backward": (0, 0)}
    per = batch * (s // cp) * head_dim * itemsize
    nbytes = n_layers * per * (2 * n_heads + 2 * n_kv_heads)  # q, out; k, v
    return {"forward": (4 * n_layers, nbytes), "backward": (4 * n_layers, nbytes)}


def predict_ring_seconds(ab: AlphaBeta, kv_bytes: int, cp: int) -> float:
    """α-β time of one layer's forward K/V exchange: 2(cp − 1) messages of kv_bytes each."""
    return 2 * (cp - 1) * ab.predict("send", kv_bytes, cp)


def predict_ulysses_seconds(ab: AlphaBeta, q_bytes: int, kv_bytes: int, cp: int) -> float:
    """α-β time of one layer's forward all-to-alls (q and out of q_bytes, k and v of kv_bytes;
    the bytes of one rank's [b, h, s/cp, d] tensors)."""
    return sum(ab.predict("all_to_all", n, cp) for n in (q_bytes, kv_bytes, kv_bytes, q_bytes))


def time_ring_exchange(
    k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup | None = None, repeats: int = 5
) -> float:
    """Seconds of one layer's forward K/V exchange alone (cp − 1 ring steps of k and v, as
    RingAttention runs them, no attention). Collective; the slowest rank's median, on all."""
    ring = Ring(group)

    def once() -> None:
        kv = [k, v]
        for _ in range(ring.cp - 1):
            works, kv = ring.start(kv)
            for w in works:
                w.wait()

    return _time(once, group, repeats)


def time_ulysses_exchange(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    repeats: int = 5,
) -> float:
    """Seconds of one layer's 4 forward all-to-alls alone (q, k, v and an output shaped like
    q). Collective; the slowest rank's median, on all."""
    t = dist.get_world_size(group)

    def once() -> None:
        for x in (q, k, v, q):
            collectives.all_to_all(x.reshape(t, -1), group)

    return _time(once, group, repeats)


def _time(fn, group: dist.ProcessGroup | None, repeats: int) -> float:
    dev, times = device(), []
    for i in range(repeats + 1):
        dist.barrier(group=group)
        start = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if i:  # the first call warms the connections
            times.append(time.perf_counter() - start)
    slowest = torch.tensor([statistics.median(times)], dtype=torch.float64, device=dev)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return float(slowest.item())
