"""Lesson 05: self-attention split by heads (seed §2.3): each rank computes its own heads, end to
end.

Heads are independent until the output projection, so with t ranks and nq query heads rank r
computes heads [r·nq/t, (r+1)·nq/t) and nothing moves until the end:

    x [b, s, H] (full on every rank)
      -> f (copy_to_tp_region)                 fwd: nothing    bwd: all-reduce b·s·H
      -> QKV projection, this rank's rows      [b, s, (nq/t + 2·nkv_r)·d]
      -> attention on nq/t heads               no communication
      -> out projection (RowParallelLinear)    fwd: all-reduce b·s·H    bwd: nothing
    -> y [b, s, H] (full on every rank)

The fused QKV weight [(nq + 2·nkv)·d, H] is stored [q heads | k heads | v heads]. Chunking it
into t row blocks (what ColumnParallelLinear would do) gives rank 0 all of q and part of k, not
"its heads' q, k and v": the classic bug. `split_qkv` picks each rank's rows instead:

    dense rows:  | q0 q1 q2 q3 | k0 k1 k2 k3 | v0 v1 v2 v3 |        (nq = nkv = 4, tp = 2)
    rank 0:      | q0 q1 | k0 k1 | v0 v1 |
    rank 1:      | q2 q3 | k2 k3 | v2 v3 |

GQA (nkv < nq: query head j uses KV head j // (nq/nkv)). If tp <= nkv, KV heads are split like
q heads (needs nkv % tp == 0). If tp > nkv there are not enough KV heads to go round: each rank
keeps a *replica* of the one KV head its q heads use (needs tp % nkv == 0), as inference
engines (vLLM, SGLang) do; Megatron-LM and picotron assert nkv % tp == 0 instead. In training,
replicas receive partial gradients on each rank; `all_reduce_replicated_kv_grads()` must run
after backward (before the optimizer step).

Sequence parallelism (lesson 08, `sequence_parallel=True`): x arrives as this rank's sequence
shard [b, s/t, H]; the f becomes an all-gather fused with the QKV matmul (all_gather_linear)
and the out projection reduce-scatters back to [b, s/t, H]. `recompute_core=True` (selective
recomputation, lesson 10) keeps only q, k, v for backward and recomputes scores, softmax and
dropout from them: the a·s² terms leave the memory ledger.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tpedu.comm import collectives
from tpedu.tp.dense import ATTENTION_DROPOUT_SITE, DenseAttention, attend
from tpedu.tp.dropout import derive_seed, index_dropout
from tpedu.tp.kv_cache import LayerCache
from tpedu.tp.layers import RowParallelLinear, column_parallel_linear
from tpedu.tp.rope import apply_rope
from tpedu.tp.sequence_parallel import all_gather_linear
from tpedu.tp.sharding import divisors


class SplitSequence(Protocol):
    """What attention asks of context parallelism (tpedu.cp.context.ContextParallel, a layer
    above this one): this rank's index among the ranks that split the sequence, and the core
    over all of their positions."""

    @property
    def rank(self) -> int: ...

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor: ...


def tp_sizes_for_heads(n_heads: int, n_kv_heads: int | None = None) -> list[int]:
    """tp sizes that split `n_heads` query heads evenly and split or replicate the KV heads."""
    nkv = n_heads if n_kv_heads is None else n_kv_heads
    return [t for t in divisors(n_heads) if nkv % t == 0 or t % nkv == 0]


def check_heads(n_heads: int, n_kv_heads: int | None, tp: int) -> None:
    """Raise a ValueError naming the numbers and the valid tp values unless tp can split the heads."""
    nkv = n_heads if n_kv_heads is None else n_kv_heads
    if n_heads < 1 or nkv < 1 or n_heads % nkv:
        raise ValueError(
            f"n_heads = {n_heads} must be a positive multiple of n_kv_heads = {nkv} "
            "(each KV head serves the same number of query heads)"
        )
    valid = ", ".join(str(v) for v in tp_sizes_for_heads(n_heads, nkv))
    if tp < 1 or n_heads % tp:
        raise ValueError(f"{n_heads} heads are not divisible by tp={tp}; valid tp values: {valid}")
    if nkv % tp and tp % nkv:
        raise ValueError(
            f"{nkv} KV heads can be neither split over nor replicated across tp={tp} "
            f"(tp must divide {nkv} or be a multiple of it); valid tp values: {valid}"
        )


def local_heads(n_heads: int, n_kv_heads: int, tp: int, rank: int) -> tuple[list[int], list[int]]:
    """(query heads, KV heads) that `rank` computes, as global head indices.

    Query heads: [r·nq/t, (r+1)·nq/t). KV heads: exactly the ones those query heads read (query
    head h reads KV head h // (nq/nkv)): [r·nkv/t, (r+1)·nkv/t) if t <= nkv, else the single
    head they share (a replica: t/nkv ranks hold it).
    """
    check_heads(n_heads, n_kv_heads, tp)
    if not 0 <= rank < tp:
        raise ValueError(f"rank must be in [0, tp={tp}), got {rank}")
    nq_r = n_heads // tp
    q = list(range(rank * nq_r, (rank + 1) * nq_r))
    if tp <= n_kv_heads:
        nkv_r = n_kv_heads // tp
        kv = list(range(rank * nkv_r, (rank + 1) * nkv_r))
    else:
        kv = [rank // (tp // n_kv_heads)]
    return q, kv


def qkv_rows(n_heads: int, n_kv_heads: int, head_dim: int, tp: int, rank: int) -> torch.Tensor:
    """int64 [(nq/t + 2·nkv_r)·d]: the rows of the dense fused [q|k|v] weight that `rank` keeps,
    ordered [its q heads | its k heads | its v heads]."""
    q, kv = local_heads(n_heads, n_kv_heads, tp, rank)
    k_base, v_base = n_heads * head_dim, (n_heads + n_kv_heads) * head_dim
    heads = [h * head_dim for h in q] + [k_base + h * head_dim for h in kv]
    heads += [v_base + h * head_dim for h in kv]
    return (torch.tensor(heads, dtype=torch.int64)[:, None] + torch.arange(head_dim)).flatten()


def split_qkv(
    weight: torch.Tensor, n_heads: int, n_kv_heads: int, tp: int, rank: int
) -> torch.Tensor:
    """This rank's rows of the fused QKV weight [(nq + 2·nkv)·d, H] (or bias [(nq + 2·nkv)·d]).

    Returns [(nq/t + 2·nkv_r)·d, ...] laid out [q | k | v] for the rank's own heads, with
    nkv_r = nkv/t, or 1 (a replica) when t > nkv. A copy; no communication.
    """
    rows = weight.shape[0]
    if rows % (n_heads + 2 * n_kv_heads):
        raise ValueError(
            f"fused QKV has {rows} rows, not a multiple of n_heads + 2·n_kv_heads = "
            f"{n_heads} + 2·{n_kv_heads} = {n_heads + 2 * n_kv_heads}"
        )
    head_dim = rows // (n_heads + 2 * n_kv_heads)
    idx = qkv_rows(n_heads, n_kv_heads, head_dim, tp, rank).to(weight.device)
    return weight.detach().index_select(0, idx).contiguous()


class FusedQKV(nn.Module):
    """This rank's rows of the fused QKV projection: its heads' q, k, v rows (`split_qkv`),
    weight [(nq/t + 2·nkv_r)·d, H] and bias [(nq/t + 2·nkv_r)·d] or None. Parameters only:
    ParallelAttention runs the matmul (behind its f, or sequence parallelism's all-gather)."""

    shard_kinds = {"weight": "qkv", "bias": "qkv"}  # how the shard map stores them

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, q_rows: int, kv_replicas: int
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None
        self.q_rows, self.kv_replicas = q_rows, kv_replicas

    def copies(self) -> torch.Tensor:
        """Ranks holding each row [rows] (float64): 1 for the q rows, kv_replicas for the k and v
        rows (the shard map's replica counts)."""
        rows = torch.ones(self.weight.shape[0], dtype=torch.float64)
        rows[self.q_rows :] = self.kv_replicas
        return rows


class ParallelAttention(nn.Module):
    """Causal multi-head (or grouped-query) self-attention with heads split over the group.

    Built from a DenseAttention (the same on every rank): its qkv weight [(nq + 2·nkv)·d, H] in
    fused [q|k|v] order, qkv bias [(nq + 2·nkv)·d] or None, out weight [H, nq·d], out bias [H]
    or None. Local: .qkv a FusedQKV (weight [(nq/t + 2·nkv_r)·d, H], bias likewise), .out a
    RowParallelLinear: DenseAttention's names.
    forward x [b, s, H] -> [b, s, H], both full and identical on every rank.
    Forward: 1 all-reduce of b·s·H (out projection). Backward: 1 all-reduce of b·s·H (the f in
    front of the QKV projection). Attention-probability dropout uses `index_dropout` at this
    rank's head offset in the global [b, nq, s, s] tensor, so TP == dense with dropout on.
    """

    def __init__(
        self,
        dense: DenseAttention,
        group: dist.ProcessGroup | None = None,
        *,
        sequence_parallel: bool = False,
        recompute_core: bool = False,
        overlap_comm: bool = False,
        context: SplitSequence | None = None,
    ) -> None:
        super().__init__()
        qkv_weight, qkv_bias = dense.qkv.weight, dense.qkv.bias
        out_weight, out_bias = dense.out.weight, dense.out.bias
        n_heads, n_kv_heads = dense.n_heads, dense.n_kv_heads
        self.fused = dense.fused  # tp.dense.attend: flash attention unless a dropout mask is drawn
        self.overlap_comm = overlap_comm  # overlap f's backward all-reduce (lesson 15)
        self.sequence_parallel, self.recompute_core = sequence_parallel, recompute_core
        self.context = context  # context parallelism (tpedu.cp): its attention is the core
        self.rope_theta = dense.rope_theta  # RoPE rotates each head on its own: no communication
        self.group = group
        self.tp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.n_heads = n_heads
        self.n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        check_heads(self.n_heads, self.n_kv_heads, self.tp)
        rows, self.hidden = qkv_weight.shape
        if rows % (n_heads + 2 * self.n_kv_heads):
            raise ValueError(
                f"qkv_weight has {rows} rows, not a multiple of n_heads + 2·n_kv_heads = "
                f"{n_heads + 2 * self.n_kv_heads}"
            )
        self.head_dim = rows // (n_heads + 2 * self.n_kv_heads)
        if tuple(out_weight.shape) != (self.hidden, n_heads * self.head_dim):
            raise ValueError(
                f"out_weight must be [H, n_heads·head_dim] = [{self.hidden}, "
                f"{n_heads * self.head_dim}], got {tuple(out_weight.shape)}"
            )
        self.causal, self.dropout_p, self.dropout_seed = (
            dense.causal,
            dense.dropout_p,
            dense.dropout_seed,
        )
        self.q_heads, self.kv_heads = local_heads(n_heads, self.n_kv_heads, self.tp, self.rank)
        split = lambda w: split_qkv(w, n_heads, self.n_kv_heads, self.tp, self.rank)
        self.qkv = FusedQKV(
            split(qkv_weight),
            split(qkv_bias) if qkv_bias is not None else None,
            len(self.q_heads) * self.head_dim,
            self.kv_replicas,
        )
        self.out = RowParallelLinear(
            out_weight, out_bias, group, input_is_parallel=True, sequence_parallel=sequence_parallel
        )

    @classmethod
    def from_dense(
        cls, dense: DenseAttention, group: dist.ProcessGroup | None = None, **options: object
    ) -> ParallelAttention:
        """Shard a `tpedu.tp.dense.DenseAttention` (the same on every rank), named like the
        linear layers' `from_dense`; `options`: the constructor's keyword arguments."""
        return cls(dense, group, **options)

    @property
    def kv_replicas(self) -> int:
        """How many ranks hold a copy of each KV head (1 unless tp > n_kv_heads)."""
        return max(1, self.tp // self.n_kv_heads)

    def forward(
        self,
        x: torch.Tensor,
        step: int = 0,
        positions: torch.Tensor | None = None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        """x [b, s, H] -> [b, s, H] (sequence_parallel: [b, s/t, H] -> [b, s/t, H]).

        `step` selects this step's dropout mask. `positions` [cp, s] (context parallelism: every
        CP rank's global positions, the same on all; x holds this rank's): RoPE at the global
        positions, and the core is `self.context`'s attention (tpedu.cp).
        `cache` (inference, tpedu.tp.kv_cache): x holds s new tokens per sequence; their K
        and V (this rank's KV heads only) join the cache and the queries attend to every cached
        position up to their own. Still 1 all-reduce of b·s·H (s = 1 per decoded token).
        """
        nq, nkv, d = len(self.q_heads), len(self.kv_heads), self.head_dim
        if self.sequence_parallel:  # all-gather the sequence; backward: reduce-scatter
            qkv = all_gather_linear(x, [self.qkv.weight], [self.qkv.bias], self.group)[0]
        else:
            qkv = column_parallel_linear(
                x,
                self.qkv.weight,
                self.qkv.bias,
                self.group,
                async_grad_all_reduce=self.overlap_comm,
            )
        b, s, _ = qkv.shape
        q, k, v = qkv.split([nq * d, nkv * d, nkv * d], dim=-1)
        q = q.view(b, s, nq, d).transpose(1, 2)  # [b, nq/t, s, d]
        k = k.view(b, s, nkv, d).transpose(1, 2)
        v = v.view(b, s, nkv, d).transpose(1, 2)
        mine = self.local_positions(positions)
        if cache is not None:  # [b, s]: each sequence's own positions
            mine = cache.positions()
        if self.rope_theta is not None:
            q, k = apply_rope(q, self.rope_theta, mine), apply_rope(k, self.rope_theta, mine)
        if cache is not None:
            k, v, mask = cache.update(k, v)  # [b, nkv_r, L, d], mask [b, 1, s, L] or None
            return self.out(self._cached_core(q, k, v, mask))
        if positions is not None:  # context parallel: the core spans every CP rank's positions
            return self.out(self.context_core(q, k, v, positions))
        if self.recompute_core and torch.is_grad_enabled():
            # Saves q, k, v only; the recomputation redraws the same index_dropout mask.
            out = checkpoint(self._core, q, k, v, step, use_reentrant=False)
        else:
            out = self._core(q, k, v, step)
        return self.out(out)

    def local_positions(self, positions: torch.Tensor | None) -> torch.Tensor | None:
        """This CP rank's row [s] of every rank's global positions [cp, s] (None: None)."""
        return None if positions is None else positions[self.context.rank]

    def context_core(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """The core over every CP rank's positions [cp, s]: q [b, nq/t, s, d], k, v
        [b, nkv_r, s, d] -> [b, s, nq/t·d]; `self.context`'s attention over its group (ring:
        K/V sends around the CP ring; Ulysses: all-to-alls), forward and backward."""
        b, nq, s, d = q.shape
        out = self.context.attention(q, k, v, positions)
        return out.transpose(1, 2).reshape(b, s, nq * d)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: int) -> torch.Tensor:
        """softmax(q·kᵀ/√d)·v on this rank's heads: q [b, nq/t, s, d], k, v [b, nkv_r, s, d]
        -> [b, s, nq/t·d]. No communication. It saves q, k, v plus, on the explicit path (dropout
        drawn), the O(a·s²) probabilities; the fused path keeps only its output and logsumexp."""
        b, nq, s, d = q.shape
        nkv = k.shape[1]
        if nq != nkv:  # each KV head serves its group of q heads (a copy: skip it when 1:1)
            k = k.repeat_interleave(nq // nkv, dim=1)
            v = v.repeat_interleave(nq // nkv, dim=1)

        seed = derive_seed(self.dropout_seed, ATTENTION_DROPOUT_SITE, step)
        drop = lambda p: index_dropout(
            p,
            self.dropout_p,
            seed,
            (b, self.n_heads, s, s),
            (0, self.q_heads[0], 0, 0),
            self.training,
        )
        drops = self.training and self.dropout_p > 0  # else attend() may use the fused kernel
        out = attend(q, k, v, self.causal, self.fused, drop if drops else None)
        return out.transpose(1, 2).reshape(b, s, nq * d)  # heads stay in rank order

    def _cached_core(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Attention of s new queries q [b, nq/t, s, d] over the cached k, v [b, nkv_r, L, d];
        mask [b, 1, s, L] (True: visible; None: every slot) -> [b, s, nq/t·d]. No communication,
        no dropout. The caller (TPGPT) checks once per forward that a cache can be used."""
        b, nq, s, d = q.shape
        if nq != k.shape[1]:
            k = k.repeat_interleave(nq // k.shape[1], dim=1)
            v = v.repeat_interleave(nq // v.shape[1], dim=1)
        if self.fused:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            scores = q @ k.transpose(-2, -1) / d**0.5
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            out = scores.softmax(dim=-1) @ v
        return out.transpose(1, 2).reshape(b, s, nq * d)

    def qkv_params(self) -> list[nn.Parameter]:
        """The fused QKV weight (and bias): what all_reduce_replicated_kv_grads touches."""
        return [p for p in (self.qkv.weight, self.qkv.bias) if p is not None]

    def all_reduce_replicated_kv_grads(self) -> None:
        """Sum the partial gradients of replicated KV heads over their replicas (in place).

        Needed only when tp > n_kv_heads; call it after backward and before the optimizer step,
        every step. One all-reduce over the TP group of a [nkv, 2·d·(H+1)] buffer in which each
        rank writes its replica's gradient into its KV head's row (the others stay 0), so the
        sum of row h is the sum over h's replicas.
        """
        if self.kv_replicas == 1:
            return
        d = self.head_dim
        parts = [self.qkv.weight.grad[-2 * d :]]
        if self.qkv.bias is not None:
            parts.append(self.qkv.bias.grad[-2 * d :, None])
        local = torch.cat(parts, dim=1)  # [2·d, H (+1)]: this rank's k and v rows
        buf = local.new_zeros(self.n_kv_heads, *local.shape)
        buf[self.kv_heads[0]] = local
        collectives.all_reduce(buf, self.group)
        summed = buf[self.kv_heads[0]]
        self.qkv.weight.grad[-2 * d :] = summed[:, : self.hidden]
        if self.qkv.bias is not None:
            self.qkv.bias.grad[-2 * d :] = summed[:, self.hidden]

    def _dense_fused(self, local: torch.Tensor) -> torch.Tensor:
        """Per-rank [q|k|v] rows -> the dense fused layout [(nq + 2·nkv)·d, ...] (all-gathers).

        A replicated KV head is taken from its first replica (replicas are equal for weights,
        and for gradients after all_reduce_replicated_kv_grads).
        """
        d = self.head_dim
        nq, nkv = len(self.q_heads) * d, len(self.kv_heads) * d
        q, k, v = local.detach().split([nq, nkv, nkv], dim=0)
        q, k, v = (collectives.all_gather(p.contiguous(), self.group, dim=0) for p in (q, k, v))
        if self.kv_replicas > 1:  # gathered [t·d, ...]: keep every kv_replicas-th head
            k = k.view(self.n_kv_heads, self.kv_replicas, d, *k.shape[1:])[:, 0].flatten(0, 1)
            v = v.view(self.n_kv_heads, self.kv_replicas, d, *v.shape[1:])[:, 0].flatten(0, 1)
        return torch.cat([q, k, v], dim=0)

    def dense_qkv_weight(self, grad: bool = False) -> torch.Tensor:
        """The dense fused QKV weight [(nq + 2·nkv)·d, H] (or its gradient); 3 all-gathers.

        With tp > n_kv_heads, call all_reduce_replicated_kv_grads() before asking for gradients.
        """
        return self._dense_fused(self.qkv.weight.grad if grad else self.qkv.weight)

    def dense_qkv_bias(self, grad: bool = False) -> torch.Tensor | None:
        """The dense fused QKV bias [(nq + 2·nkv)·d] (or its gradient), or None."""
        if self.qkv.bias is None:
            return None
        return self._dense_fused(self.qkv.bias.grad if grad else self.qkv.bias)

    def extra_repr(self) -> str:
        return (
            f"heads={self.n_heads}, kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, "
            f"tp={self.tp}, local q heads={self.q_heads}, local kv heads={self.kv_heads}"
        )
