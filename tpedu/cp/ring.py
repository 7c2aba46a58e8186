"""Lesson 09: ring attention: causal attention over a sequence split across the CP ranks.

Each of the cp ranks of a context-parallel group holds s/cp positions of q, k and v for the
whole layer. Attention needs every earlier key, so the K/V blocks travel around the ring:

    step i: rank r attends its q to the K/V block of rank (r − i) mod cp, while it already
            sends that block on to rank r + 1 and receives the next one from rank r − 1

cp − 1 sends of the local K/V per layer forward ([b, n_kv, s/cp, d] each for k and v: the ring
carries KV heads, not the query heads GQA expands them to). The partial results of the blocks
are merged with their log-sum-exps (the online-softmax rule):

    lse = log(e^lse_a + e^lse_b),   out = e^(lse_a − lse)·out_a + e^(lse_b − lse)·out_b

so no rank ever holds the [s, s] scores, only [s/cp, s/cp] blocks, one at a time. Backward runs
the ring again: each block's dK/dV travels with it, collecting every rank's contribution, and
arrives back at its owner after cp sends (forward: cp − 1; backward: cp − 1 for K/V, cp for
dK/dV).

Causal masking works on global positions, so it is right for any assignment of positions to
ranks. `chunk_positions` gives two: contiguous (rank r holds [r·s/cp, (r+1)·s/cp): the last rank
does cp times the work of the first) and zig-zag (rank r holds chunks r and 2·cp − 1 − r of
2·cp: every rank the same work). A block whose keys all come after the queries is skipped.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from tpedu.comm import collectives
from tpedu.cp.blocks import Visible, block_backward, block_forward, kernel_available, visible
from tpedu.tp.sharding import divisors

LAYOUTS = ("contiguous", "zigzag")


def check_cp_length(s: int, cp: int, layout: str) -> None:
    """Raise a ValueError naming the valid lengths if `s` cannot be split over `cp` ranks."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    parts = 2 * cp if layout == "zigzag" else cp
    if s % parts:
        raise ValueError(
            f"sequence length {s} is not divisible by {parts} ({'2·' if layout == 'zigzag' else ''}"
            f"cp = {parts}); use a multiple of {parts}: {parts}, {2 * parts}, {3 * parts}, ..."
            + (f" (or cp in {divisors(s)} for a contiguous split)" if layout == "zigzag" else "")
        )


def chunk_positions(s: int, cp: int, rank: int, layout: str = "zigzag") -> torch.Tensor:
    """The global positions [s/cp] that CP rank `rank` holds, in its local order."""
    check_cp_length(s, cp, layout)
    if layout == "contiguous":
        n = s // cp
        return torch.arange(rank * n, (rank + 1) * n)
    n = s // (2 * cp)
    first, second = rank, 2 * cp - 1 - rank
    return torch.cat(
        [torch.arange(first * n, (first + 1) * n), torch.arange(second * n, (second + 1) * n)]
    )


def split_sequence(
    x: torch.Tensor, cp: int, rank: int, layout: str = "zigzag", dim: int = 2
) -> torch.Tensor:
    """This rank's positions of `x` along `dim` (a copy)."""
    return x.index_select(dim, chunk_positions(x.shape[dim], cp, rank, layout).to(x.device))


def merge_partials(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attention results over disjoint key sets -> the result over both.

    out_* [..., s, d] are each normalised over its own keys, lse_* [..., s] the log of each
    softmax denominator: lse = log(e^lse_a + e^lse_b), and each part is weighted by its share of
    the total, e^(lse_* − lse). A row with no key in a part has lse = −inf and weight 0."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), 0.0, lse)
    out = out_a * torch.exp(lse_a - safe)[..., None] + out_b * torch.exp(lse_b - safe)[..., None]
    return out, lse


def block_scores(
    q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Scores of q [b, hq, sq, d] against k [b, hq, sk, d] with `mask` [sq, sk] (True = keep)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask.to(scores.device), float("-inf"))
    return scores


def _expand(kv: torch.Tensor, groups: int) -> torch.Tensor:
    """KV heads [b, nkv, s, d] -> query heads [b, nkv·groups, s, d] (GQA: head j uses j // g)."""
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)


def _fold(g: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient w.r.t. expanded KV heads, summed back onto the KV heads (_expand's adjoint)."""
    if groups == 1:
        return g
    b, h, s, d = g.shape
    return g.view(b, h // groups, groups, s, d).sum(2)


class Ring:
    """Passes tensors to the next rank of the group and takes the previous rank's, async."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        ranks = (
            dist.get_process_group_ranks(group)
            if group is not None
            else list(range(dist.get_world_size()))
        )
        me = ranks.index(dist.get_rank())
        self.group, self.cp = group, len(ranks)
        self.next, self.prev = ranks[(me + 1) % self.cp], ranks[(me - 1) % self.cp]

    def start(self, tensors: list[torch.Tensor]) -> tuple[list, list[torch.Tensor]]:
        bufs = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
        works = [collectives.isend(t.contiguous(), self.next, self.group) for t in tensors]
        works += [collectives.irecv(b, self.prev, self.group) for b in bufs]
        return works, bufs


def _mask(pos: torch.Tensor, rank: int, owner: int, seen: Visible | None) -> torch.Tensor:
    """[sq, sk] True where this rank's query sees the owner's key (causal, global positions)."""
    if seen is not None and seen.mask is not None:
        return seen.mask.to(pos.device)
    return pos[rank][:, None] >= pos[owner][None, :]


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over the whole ring's keys and values.

    q [b, nq, s/cp, d], k and v [b, nkv, s/cp, d] (this rank's positions, `positions[rank]`),
    positions [cp, s/cp] (every rank's global positions, the same on every rank) -> [b, nq, s/cp, d].
    Forward: cp − 1 sends/receives of (k, v). Backward: cp − 1 of (k, v) and cp of (dk, dv).
    fused: each block through the flash kernel, only its seen part (tpedu.cp.blocks); else
    the explicit [s/cp, s/cp] scores written out below, the lesson's reference.
    """

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        group: dist.ProcessGroup | None,
        fused: bool,
    ) -> torch.Tensor:
        ring = Ring(group)
        rank = dist.get_rank(group) if group is not None else dist.get_rank()
        groups, scale = q.shape[1] // k.shape[1], 1.0 / math.sqrt(q.shape[-1])
        # meta tensors (the dry run) have no values: which blocks to skip is decided on the CPU
        pos = positions.cpu() if q.device.type == "meta" else positions.to(q.device)
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        kv, started, seen_all = [k, v], False, []
        for i in range(ring.cp):
            owner = (rank - i) % ring.cp
            works, nxt = ring.start(kv) if i < ring.cp - 1 else ([], None)
            seen = visible(pos[rank].cpu(), pos[owner].cpu()) if fused else None
            seen_all.append(seen)
            kx, vx = _expand(kv[0], groups), _expand(kv[1], groups)
            if seen is not None and seen.kind == "none":
                pass  # a block entirely in the queries' future adds nothing
            elif seen is not None and seen.kind != "mask":
                r = seen.rows
                out_b, lse_b = block_forward(q, kx, vx, seen, scale)
                out_b, lse_b = out_b.to(q.dtype), lse_b.to(q.dtype)
                if not started and r == slice(None):  # the first block: nothing to merge with
                    out, lse = out_b, lse_b
                else:
                    out[:, :, r], lse[:, :, r] = merge_partials(
                        out[:, :, r], lse[:, :, r], out_b, lse_b
                    )
                started = True
            elif (mask := _mask(pos, rank, owner, seen)).any():  # else: in the future, skipped
                scores = block_scores(q, kx, mask, scale)
                lse_b = torch.logsumexp(scores, dim=-1)
                safe = torch.where(torch.isinf(lse_b), 0.0, lse_b)  # rows with no key here
                out_b = torch.matmul(torch.exp(scores - safe[..., None]), vx)
                out, lse = merge_partials(out, lse, out_b, lse_b)
                started = True
            for w in works:
                w.wait()
            kv = nxt if nxt is not None else kv
        ctx.save_for_backward(q, k, v, out, lse, pos)
        ctx.group, ctx.seen = group, seen_all
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, pos = ctx.saved_tensors
        ring = Ring(ctx.group)
        rank = dist.get_rank(ctx.group) if ctx.group is not None else dist.get_rank()
        groups, scale = q.shape[1] // k.shape[1], 1.0 / math.sqrt(q.shape[-1])
        # D = rowsum(dO ∘ O) for the explicit blocks (the fused kernel works it out itself)
        explicit = any(seen is None or seen.kind == "mask" for seen in ctx.seen)
        delta = (grad_out * out).sum(-1, keepdim=True) if explicit else None
        dq = torch.zeros_like(q)
        kv, dkv = [k, v], [torch.zeros_like(k), torch.zeros_like(v)]  # of one owner's block
        for i in range(ring.cp):
            owner = (rank - i) % ring.cp
            # k and v do not change here: they are on their way on while this block computes
            works, next_kv = ring.start(kv) if i < ring.cp - 1 else ([], kv)
            seen = ctx.seen[i]  # as in forward
            kx, vx = _expand(kv[0], groups), _expand(kv[1], groups)
            if seen is not None and seen.kind == "none":
                pass  # a block entirely in the queries' future adds nothing
            elif seen is not None and seen.kind != "mask":
                r, c = seen.rows, seen.cols
                dq_b, dk_b, dv_b = block_backward(grad_out, q, kx, vx, out, lse, seen, scale)
                dq[:, :, r] += dq_b
                dkv[0][:, :, c] += _fold(dk_b, groups)
                dkv[1][:, :, c] += _fold(dv_b, groups)
            elif (mask := _mask(pos, rank, owner, seen)).any():
                p = torch.exp(
                    block_scores(q, kx, mask, scale) - lse[..., None]
                )  # the softmax block
                dv = torch.matmul(p.transpose(-1, -2), grad_out)
                ds = p * (torch.matmul(grad_out, vx.transpose(-1, -2)) - delta)
                dq = dq + torch.matmul(ds, kx) * scale
                dk = torch.matmul(ds.transpose(-1, -2), q) * scale
                dkv = [dkv[0] + _fold(dk, groups), dkv[1] + _fold(dv, groups)]
            if ring.cp > 1:  # dk, dv follow their block; after cp passes they are home
                more, dkv = ring.start(dkv)
                works += more
            for w in works:
                w.wait()
            kv = next_kv
        return dq, dkv[0], dkv[1], None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    fused: bool | None = None,
) -> torch.Tensor:
    """Causal attention with the sequence split over the ranks of `group` (see RingAttention).
    fused: None (default) where the kernel runs (CPU, meta: `blocks.kernel_available`)."""
    fused = kernel_available(q) if fused is None else fused
    return RingAttention.apply(q, k, v, positions, group, fused)
