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

from collections.abc import Sequence

import torch

from tpedu.model.config import GPTConfig
from tpedu.model.dense import DenseGPT
from tpedu.tp.attention import local_heads, qkv_rows, split_qkv
from tpedu.tp.embedding import vocab_range
from tpedu.tp.sharding import check_divisible


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


KINDS = ("replicated", "column", "row", "qkv", "vocab")


def param_kind(name: str, config: GPTConfig) -> str:
    """How the dense tensor `name` (a DenseGPT state-dict key) is sharded over tensor parallel."""
    if name in ("tok_emb.weight", "lm_head.weight"):
        return "vocab" if config.vocab_parallel else "replicated"
    if ".attn.qkv." in name:
        return "qkv"
    if name.endswith(("attn.out.weight", "mlp.fc2.weight")):
        return "row"
    if ".mlp.fc1." in name or ".mlp.up." in name:
        return "column"
    return "replicated"  # norms, learned positions, row-parallel biases


def split_tensor(dense: torch.Tensor, kind: str, tp: int, rank: int,
                 config: GPTConfig) -> torch.Tensor:  # fmt: skip
    """Rank `rank`'s shard of `dense` at tensor-parallel size `tp` (a copy; no communication).

    The same rules as the model's layers: column [out, in] -> [out/t, in], row [out, in] ->
    [out, in/t], qkv -> that rank's heads (`attention.split_qkv`), vocab [V, H] -> [Vp/t, H]
    (zero padding rows at the end of the last shard), replicated -> the whole tensor.
    """
    if kind == "replicated" or dense.dim() == 0:
        return dense.detach().clone()
    if kind in ("column", "row"):
        dim = 0 if kind == "column" else 1
        check_divisible(dense.shape[dim], tp, f"dim {dim} of a {kind}-parallel tensor")
        n = dense.shape[dim] // tp
        return dense.detach().narrow(dim, rank * n, n).clone().contiguous()
    if kind == "qkv":
        return split_qkv(dense, config.n_heads, config.kv_heads, tp, rank)
    if kind == "vocab":
        start, end = vocab_range(dense.shape[0], tp, rank)
        local = dense.new_zeros(end - start, *dense.shape[1:])
        real = max(0, min(end, dense.shape[0]) - start)  # rows that are not padding
        local[:real] = dense.detach()[start : start + real]
        return local
    raise ValueError(f"unknown sharding kind {kind!r}; expected one of {KINDS}")


def merge_shards(shards: Sequence[torch.Tensor], kind: str, config: GPTConfig,
                 rows: int | None = None) -> torch.Tensor:  # fmt: skip
    """The dense tensor from every tp rank's shard, in rank order (the inverse of split_tensor).

    `rows` (vocab only): the real vocabulary size, so the padding rows are dropped.
    qkv: each rank's rows go back to their dense positions; a KV head replicated over several
    ranks (tp > n_kv_heads) is written by each replica: they are equal.
    """
    if kind == "replicated" or shards[0].dim() == 0:
        return shards[0].detach().clone()
    if kind == "column":
        return merge_column(shards)
    if kind == "row":
        return merge_row(shards)
    if kind == "vocab":
        return torch.cat(list(shards), dim=0)[:rows]
    if kind == "qkv":
        return merge_qkv(shards, config.n_heads, config.kv_heads)
    raise ValueError(f"unknown sharding kind {kind!r}; expected one of {KINDS}")


def dense_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every DenseGPT state-dict key -> its shape (built on the meta device: free)."""
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in DenseGPT(config).state_dict().items()}
