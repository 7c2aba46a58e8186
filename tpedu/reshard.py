"""Merge a tensor-parallel weight's shards into the dense weight, and cut it again for another
tp size (lesson 13). One process, no communication: this is what a checkpoint converter does.

    column-parallel  W [out, in]: rank r holds rows    [r·out/t, (r+1)·out/t)   merge: cat dim 0
    row-parallel     W [out, in]: rank r holds columns [r·in/t, (r+1)·in/t)     merge: cat dim 1
    fused QKV        W [(nq + 2·nkv)·d, H] laid out | q heads | k heads | v heads |;
                     rank r holds [its q | its k | its v] rows (attention.split_qkv).

The classic converter bug is to treat fused QKV as column-parallel: concatenating the shards
gives | q0 q1 k0 v0 | q2 q3 k1 v1 |, not | q0 q1 q2 q3 | k0 k1 | v0 v1 |. Merging must put each
head's rows back where they came from; with GQA at tp > n_kv_heads several ranks hold a copy of
the same KV head (replicas, equal), and any one of them will do.

Always go through the dense tensor: dense -> new shards uses the *same* split the model uses, so
the resharded model is exactly the model built at the new tp.
"""

from __future__ import annotations

import torch

from tpedu.attention import local_heads, qkv_rows, split_qkv
from tpedu.sharding import check_divisible


def merge_column(shards: list[torch.Tensor]) -> torch.Tensor:
    """Column-parallel shards [out/t, in] (or biases [out/t]), in rank order -> [out, in]."""
    return torch.cat(list(shards), dim=0)


def merge_row(shards: list[torch.Tensor]) -> torch.Tensor:
    """Row-parallel weight shards [out, in/t], in rank order -> [out, in]."""
    return torch.cat(list(shards), dim=1)


def merge_qkv(shards: list[torch.Tensor], n_heads: int, n_kv_heads: int) -> torch.Tensor:
    """Fused-QKV shards (rank r: [(nq/t + 2·nkv_r)·d, ...] = [its q | its k | its v]) -> the dense
    [(nq + 2·nkv)·d, ...] in | q heads | k heads | v heads | order. nkv_r = nkv/t, or 1 (a
    replica) when t > nkv; replicas are equal, each write puts the same rows in place."""
    tp = len(shards)
    q, kv = local_heads(n_heads, n_kv_heads, tp, 0)
    head_dim = shards[0].shape[0] // (len(q) + 2 * len(kv))
    dense = shards[0].new_empty((n_heads + 2 * n_kv_heads) * head_dim, *shards[0].shape[1:])
    for rank, shard in enumerate(shards):
        dense[qkv_rows(n_heads, n_kv_heads, head_dim, tp, rank).to(shard.device)] = shard
    return dense


def split(dense: torch.Tensor, kind: str, tp: int, n_heads: int | None = None,
          n_kv_heads: int | None = None) -> list[torch.Tensor]:  # fmt: skip
    """Every rank's shard of `dense` at `tp` ("column", "row" or "qkv"), the model's own rules."""
    if kind == "qkv":
        return [split_qkv(dense, n_heads, n_kv_heads, tp, r) for r in range(tp)]
    dim = {"column": 0, "row": 1}[kind]
    check_divisible(dense.shape[dim], tp, f"dim {dim} of a {kind}-parallel weight")
    return [c.clone() for c in dense.chunk(tp, dim=dim)]


def reshard(shards: list[torch.Tensor], kind: str, new_tp: int, n_heads: int | None = None,
            n_kv_heads: int | None = None) -> list[torch.Tensor]:  # fmt: skip
    """Shards at tp = len(shards) -> shards at `new_tp`: merge to dense, then split again."""
    if kind == "column":
        dense = merge_column(shards)
    elif kind == "row":
        dense = merge_row(shards)
    elif kind == "qkv":
        dense = merge_qkv(shards, n_heads, n_kv_heads)
    else:
        raise ValueError(f"kind must be 'column', 'row' or 'qkv', got {kind!r}")
    return split(dense, kind, new_tp, n_heads, n_kv_heads)
