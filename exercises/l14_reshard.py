"""Exercise l14: merge tensor-parallel shards back into dense weights, and re-split them for
another tp size: the heart of every "change the TP size of my checkpoint" script (seed 002 §5.4:
write the conversion script before you need it).

Shards come in rank order (shards[r] is rank r's tensor). The layouts (tpedu/tp/layers.py,
tpedu/tp/attention.py):

    column-parallel  dense [out, in]  -> rank r: rows    [r·out/t, (r+1)·out/t)   [out/t, in]
                     (a column-parallel bias [out] -> [out/t] likewise)
    row-parallel     dense [out, in]  -> rank r: columns [r·in/t, (r+1)·in/t)     [out, in/t]
    fused QKV        dense [(nq + 2·nkv)·d, H], rows | q0 .. q(nq-1) | k0 .. | v0 .. | (d each)
                     -> rank r: [its q heads | its k heads | its v heads], see
                        tpedu.tp.attention.split_qkv / local_heads / qkv_rows. With GQA and
                        tp > nkv every rank keeps a replica of one KV head.

Fill in the four functions, then run `make grade EX=l14`. You may use tpedu.tp.attention
(local_heads, qkv_rows, split_qkv) but not tpedu.model.state.
"""

from __future__ import annotations

import torch


def merge_column(shards: list[torch.Tensor]) -> torch.Tensor:
    """Column-parallel shards [out/t, in] (or [out/t]) in rank order -> the dense [out, in]."""
    raise NotImplementedError(
        "l14: merge column-parallel shards; hint: tpedu.grading.hint('l14', 1)"
    )


def merge_row(shards: list[torch.Tensor]) -> torch.Tensor:
    """Row-parallel weight shards [out, in/t] in rank order -> the dense [out, in]."""
    raise NotImplementedError("l14: merge row-parallel shards; hint: tpedu.grading.hint('l14', 1)")


def merge_qkv(shards: list[torch.Tensor], n_heads: int, n_kv_heads: int) -> torch.Tensor:
    """Fused-QKV shards in rank order -> the dense [(nq + 2·nkv)·d, ...] weight (or bias).

    Rank r's shard is [(nq/t + 2·nkv_r)·d, ...] = [its q | its k | its v] with nkv_r = nkv/t
    (or 1, a replica, when t > nkv). Concatenating the shards is WRONG (it interleaves q, k, v).
    Work out d from the shapes; replicas of a KV head are equal, use any one.
    """
    raise NotImplementedError("l14: merge fused-QKV shards; hint: tpedu.grading.hint('l14', 1)")


def reshard(
    shards: list[torch.Tensor],
    kind: str,
    new_tp: int,
    n_heads: int | None = None,
    n_kv_heads: int | None = None,
) -> list[torch.Tensor]:
    """Shards at tp = len(shards) -> the list of `new_tp` shards of the same dense weight.

    kind: "column", "row" or "qkv" (n_heads, n_kv_heads given). The new shards must be exactly
    what a model built at new_tp holds (for qkv: tpedu.tp.attention.split_qkv).
    """
    raise NotImplementedError("l14: reshard for the new tp; hint: tpedu.grading.hint('l14', 1)")
