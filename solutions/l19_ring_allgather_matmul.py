"""Reference for exercises/l19_ring_allgather_matmul.py: all-gather ─► matmul as a ring."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tpedu.comm import collectives as C


def ring_all_gather_matmul(
    x: torch.Tensor, weight: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    r, t = dist.get_rank(group), dist.get_world_size(group)
    glob = (lambda q: q) if group is None else (lambda q: dist.get_global_rank(group, q))
    right, left = glob((r + 1) % t), glob((r - 1) % t)
    out: list[torch.Tensor | None] = [None] * t
    cur = x.contiguous()
    for k in range(t):
        works = []
        if k < t - 1:  # the next shard travels while this one is multiplied
            nxt = torch.empty_like(cur)
            works = [C.isend(cur, right, group), C.irecv(nxt, left, group)]
        out[(r - k) % t] = cur @ weight.T  # shard of rank (r-k) mod t: its rows, in place
        for w in works:
            w.wait()
        if works:
            cur = nxt
    return torch.cat(out, dim=1)
