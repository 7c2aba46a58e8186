"""Reference for exercises/l06_vocab_parallel_ce.py: cross-entropy over vocab-sharded logits."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tpedu.comm import collectives


def vocab_range(vocab_size: int, tp: int, rank: int) -> tuple[int, int]:
    n = -(-vocab_size // tp)  # ceil: the padded vocabulary is n·tp
    return rank * n, (rank + 1) * n


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor,
    target: torch.Tensor,
    vocab_size: int,
    group: dist.ProcessGroup | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    n = logits_shard.shape[-1]
    start = dist.get_rank(group) * n
    cols = torch.arange(start, start + n, device=logits_shard.device)
    z = logits_shard.detach().masked_fill(cols >= vocab_size, float("-inf"))

    m = z.max(dim=-1).values  # [...], then the max over all ranks
    collectives.all_reduce(m, group, op=dist.ReduceOp.MAX)
    z = z - m[..., None]

    mine = (target >= start) & (target < start + n)  # does this rank hold the target's column?
    local = torch.where(mine, target - start, 0)
    z_y = torch.where(mine, z.gather(-1, local[..., None]).squeeze(-1), 0.0)  # 0 elsewhere
    collectives.all_reduce(z_y, group)

    s = z.exp().sum(dim=-1)
    collectives.all_reduce(s, group)

    loss = s.log() - z_y  # log Σ e^(z - m) - (z_y - m)
    return torch.where(target == ignore_index, 0.0, loss)
