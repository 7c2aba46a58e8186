"""Reference for exercises/l05_qkv_split.py: the fused QKV weight, split by heads."""

from __future__ import annotations

import torch


def local_heads(n_heads: int, n_kv_heads: int, tp: int, rank: int) -> tuple[list[int], list[int]]:
    if tp < 1 or n_heads % tp:
        raise ValueError(f"{n_heads} heads are not divisible by tp={tp}")
    if n_kv_heads % tp and tp % n_kv_heads:
        raise ValueError(
            f"{n_kv_heads} KV heads can be neither split over nor replicated across tp={tp}: "
            f"tp must divide {n_kv_heads} or be a multiple of it"
        )
    nq = n_heads // tp
    q = list(range(rank * nq, (rank + 1) * nq))
    if tp <= n_kv_heads:
        nkv = n_kv_heads // tp
        kv = list(range(rank * nkv, (rank + 1) * nkv))
    else:  # tp / nkv consecutive ranks share one KV head: the one their query heads use
        kv = [rank // (tp // n_kv_heads)]
    return q, kv


def split_qkv(
    weight: torch.Tensor, n_heads: int, n_kv_heads: int, tp: int, rank: int
) -> torch.Tensor:
    q, kv = local_heads(n_heads, n_kv_heads, tp, rank)
    d = weight.shape[0] // (n_heads + 2 * n_kv_heads)
    k_start, v_start = n_heads * d, (n_heads + n_kv_heads) * d  # where the k and v blocks begin
    rows: list[int] = []
    for start in [h * d for h in q] + [k_start + h * d for h in kv] + [v_start + h * d for h in kv]:
        rows += range(start, start + d)  # one head: d consecutive rows
    index = torch.tensor(rows, dtype=torch.int64, device=weight.device)
    return weight.detach().index_select(0, index)  # a new tensor, [q | k | v] of this rank
