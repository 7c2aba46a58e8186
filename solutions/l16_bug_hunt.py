"""Reference for exercises/l16_bug_hunt.py: each bug-zoo function, fixed."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tpedu.comm import collectives


class _CopyToTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        collectives.all_reduce(grad, ctx.group)  # the fix: sum every rank's share of dL/dx
        return grad, None


def copy_to_tp_region(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    return _CopyToTPRegion.apply(x, group)


def mask_padding(logits_shard: torch.Tensor, start: int, vocab_size: int) -> torch.Tensor:
    n = logits_shard.shape[-1]
    cols = torch.arange(start, start + n, device=logits_shard.device)  # global ids
    return logits_shard.masked_fill(cols >= vocab_size, float("-inf"))


def vocab_parallel_argmax(
    logits_shard: torch.Tensor, vocab_size: int, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    start = dist.get_rank(group) * logits_shard.shape[-1]
    z = mask_padding(logits_shard.detach(), start, vocab_size)
    best, idx = z.max(dim=-1, keepdim=True)  # this shard's candidate, first on ties
    values = collectives.all_gather(best.contiguous(), group, dim=-1)  # [..., t], rank order
    ids = collectives.all_gather((idx + start).contiguous(), group, dim=-1)
    winner = values.argmax(dim=-1, keepdim=True)  # first maximum: the lowest rank, lowest id
    return ids.gather(-1, winner).squeeze(-1)


def kv_heads_of_rank(n_heads: int, n_kv_heads: int, tp: int, rank: int) -> list[int]:
    if tp > n_kv_heads:
        return [rank // (tp // n_kv_heads)]  # the head this rank's query heads use
    n = n_kv_heads // tp
    return list(range(rank * n, (rank + 1) * n))


def tp_groups(world: int, tp: int, pp: int = 1) -> list[list[int]]:
    # TP varies fastest, so every TP group is a block of tp consecutive ranks (pp plays no part).
    return [list(range(k * tp, (k + 1) * tp)) for k in range(world // tp)]


def one_f_one_b(n_micro: int, n_stages: int, stage: int) -> list[tuple[str, int]]:
    warm = min(n_stages - 1 - stage, n_micro)  # the fix: as many as stages come after this one
    order = [("F", i) for i in range(warm)]
    for i in range(n_micro - warm):
        order += [("F", warm + i), ("B", i)]
    return order + [("B", i) for i in range(n_micro - warm, n_micro)]
