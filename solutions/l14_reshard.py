"""Reference for exercises/l14_reshard.py: merge TP shards to dense, and split them again."""

from __future__ import annotations

import torch

from tpedu.tp.attention import local_heads, qkv_rows, split_qkv


def merge_column(shards: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(list(shards), dim=0)  # each rank holds a block of output rows


def merge_row(shards: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(list(shards), dim=1)  # each rank holds a block of input columns


def merge_qkv(shards: list[torch.Tensor], n_heads: int, n_kv_heads: int) -> torch.Tensor:
    tp = len(shards)
    q, kv = local_heads(n_heads, n_kv_heads, tp, 0)
    d = shards[0].shape[0] // (len(q) + 2 * len(kv))
    dense = shards[0].new_empty((n_heads + 2 * n_kv_heads) * d, *shards[0].shape[1:])
    for rank, shard in enumerate(shards):
        # The dense rows this shard holds, in its order [q | k | v]; replicas write equal rows.
        dense[qkv_rows(n_heads, n_kv_heads, d, tp, rank).to(shard.device)] = shard
    return dense


def reshard(
    shards: list[torch.Tensor],
    kind: str,
    new_tp: int,
    n_heads: int | None = None,
    n_kv_heads: int | None = None,
) -> list[torch.Tensor]:
    if kind == "qkv":
        dense = merge_qkv(shards, n_heads, n_kv_heads)
        return [split_qkv(dense, n_heads, n_kv_heads, new_tp, r) for r in range(new_tp)]
    if kind not in ("column", "row"):
        raise ValueError(f"kind must be 'column', 'row' or 'qkv', got {kind!r}")
    dim = 0 if kind == "column" else 1
    dense = merge_column(shards) if kind == "column" else merge_row(shards)
    if dense.shape[dim] % new_tp:
        raise ValueError(f"dim {dim} of size {dense.shape[dim]} does not divide by tp={new_tp}")
    return [c.clone() for c in dense.chunk(new_tp, dim=dim)]
