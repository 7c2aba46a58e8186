"""Lesson 14: the shard map (used from lesson 07 on). For every parameter of a rank's model: its
dense name (DenseGPT's state-dict key), how it is split over the TP group, and how many ranks
hold a copy of each element. One walker (`shard_map`) serves the dense state-dict gather
(`TPGPT.gather_state_dict`), the gradient norm's replica counts (`TPGPT.norm_weight`),
checkpoint save and load, and resharding; `split_tensor` / `merge_shards` are the one set of
split and merge rules they all use.

    kind        dense tensor          rank r of t keeps                     copies of an element
    column      [out, in] / [out]     rows [r·out/t, (r+1)·out/t)           1
    row         [out, in]             columns [r·in/t, (r+1)·in/t)          1
    qkv         [(nq+2·nkv)·d, ...]   its heads' q, k, v rows (split_qkv)   1; k, v: kv_replicas
    vocab       [V, H]                rows of the table padded to Vp        1
    replicated  any                   all of it                             t
    sequence    any                   all of it, but fed s/t positions      t (gradient summed)

How a parameter is split is said once, by the tensor-parallel module that holds it: its class's
`shard_kinds` (ColumnParallelLinear {"weight": "column", "bias": "column"}, RowParallelLinear,
VocabParallelEmbedding, the attention's FusedQKV); a parameter of any other module (norms,
learned positions, a replicated embedding) is replicated. TPGPT's parameters carry DenseGPT's
names, so the shard map reads each one's kind off its module, and `tpedu.model.plan` reads the
same off a TPGPT built on the meta device when there is no live model (offline resharding). A
new way of splitting is a new kind here and a module that declares it: the gather, the norm,
the checkpoints and the reshard follow.

The classic converter bug is to treat fused QKV as column-parallel: concatenating the shards
gives | q0 q1 k0 v0 | q2 q3 k1 v1 |, not | q0 q1 q2 q3 | k0 k1 | v0 v1 |. Merging must put each
head's rows back where they came from; with GQA at tp > n_kv_heads several ranks hold a copy of
the same KV head (replicas, equal), and any one of them will do. Always go through the dense
tensor: dense -> new shards uses the *same* split the model uses, so the resharded model is
exactly the model built at the new tp.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from tpedu.comm.placement import Placement, Placements, Replicate, Shard, declared
from tpedu.model.config import GPTConfig
from tpedu.model.dense import DenseGPT
from tpedu.tp.attention import local_heads, qkv_rows, split_qkv
from tpedu.tp.embedding import vocab_range
from tpedu.tp.sharding import rank_chunk


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


KINDS = ("replicated", "sequence", "column", "row", "qkv", "vocab")


# A kind's placement over the TP group, in DTensor's terms (tpedu.comm.placement).
TP_PLACEMENTS: dict[str, Placement] = {
    "column": Shard(0),
    "row": Shard(1),
    "qkv": Shard(0),  # by heads
    "vocab": Shard(0),  # by rows, padded
    "replicated": Replicate(),
    "sequence": Replicate(),  # a copy, fed s/t positions: its gradient is summed over TP
}


@dataclass(frozen=True)
class Entry:
    """One parameter of a rank's model in the shard map."""

    name: str  # the dense name (DenseGPT's key, blocks by global index)
    local: str  # the name in this rank's module
    param: nn.Parameter
    kind: str  # one of KINDS
    copies: float | torch.Tensor  # ranks holding each element (a per-row tensor for qkv)
    tied_copy: bool = False  # the last stage's copy of a tied embedding (not saved)
    placements: Placements = field(default_factory=dict)  # per mesh axis: tp, and any declared

    @property
    def stored_kind(self) -> str:
        """The kind on disk: sequence-fed parameters are stored as the replicated tensors they are."""
        return "replicated" if self.kind == "sequence" else self.kind


def dense_name(local: str, layer_ids: Sequence[int], tied: bool) -> tuple[str, bool]:
    """(DenseGPT's name, is_tied_copy) of the TPGPT parameter `local`: the same name, with a
    pipeline stage's blocks numbered as in the whole model."""
    if local.startswith("blocks."):
        _, j, rest = local.split(".", 2)
        local = f"blocks.{layer_ids[int(j)]}.{rest}"
    if local == "lm_head.weight" and tied:
        return "tok_emb.weight", True
    return local, False


def shard_map(model: nn.Module | Sequence[nn.Module]) -> list[Entry]:
    """Every parameter of a TPGPT stage (or a rank's list of pipeline chunks), in module order.
    No communication. (tests/test_state.py checks, for every parameter of GPT-2- and
    Llama-style models, that its shape is what `split_tensor` gives its kind.)"""
    chunks = [model] if isinstance(model, nn.Module) else list(model)
    out: list[Entry] = []
    for m in chunks:
        config, tp = m.config, m.tp
        modules, placed = dict(m.named_modules()), declared(m)
        for local, p in m.named_parameters():
            name, tied = dense_name(local, m.layer_ids, config.tie_embeddings)
            owner, _, pname = local.rpartition(".")
            kind = getattr(modules[owner], "shard_kinds", {}).get(pname, "replicated")
            if kind == "replicated" and getattr(p, "sequence_parallel", False):
                kind = "sequence"
            copies: float | torch.Tensor = float(tp) if kind in ("replicated", "sequence") else 1.0
            if kind == "qkv":
                rows = modules[owner].copies().to(p.device)
                copies = rows[:, None] if p.dim() == 2 else rows
            where = {"tp": TP_PLACEMENTS[kind], **placed[local]}
            out.append(Entry(name, local, p, kind, copies, tied, where))
    return out


def split_tensor(
    dense: torch.Tensor, kind: str, tp: int, rank: int, config: GPTConfig
) -> torch.Tensor:
    """Rank `rank`'s shard of `dense` at tensor-parallel size `tp` (a copy; no communication).

    The same rules as the model's layers: column [out, in] -> [out/t, in], row [out, in] ->
    [out, in/t], qkv -> that rank's heads (`attention.split_qkv`), vocab [V, H] -> [Vp/t, H]
    (zero padding rows at the end of the last shard), replicated -> the whole tensor.
    """
    if kind == "replicated" or dense.dim() == 0:
        return dense.detach().clone()
    if kind in ("column", "row"):
        dim = 0 if kind == "column" else 1
        what = f"dim {dim} of a {kind}-parallel tensor"
        return rank_chunk(dense.detach(), dim, rank, tp, what).clone().contiguous()
    if kind == "qkv":
        return split_qkv(dense, config.n_heads, config.kv_heads, tp, rank)
    if kind == "vocab":
        start, end = vocab_range(dense.shape[0], tp, rank)
        local = dense.new_zeros(end - start, *dense.shape[1:])
        real = max(0, min(end, dense.shape[0]) - start)  # rows that are not padding
        local[:real] = dense.detach()[start : start + real]
        return local
    raise ValueError(f"unknown sharding kind {kind!r}; expected one of {KINDS}")


def merge_shards(
    shards: Sequence[torch.Tensor], kind: str, config: GPTConfig, rows: int | None = None
) -> torch.Tensor:
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
