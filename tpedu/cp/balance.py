"""Lesson 09: how much causal attention each CP rank does, contiguous vs zig-zag.

Counted from the assignment the code uses (`chunk_positions`) and the rule RingAttention masks
with (query position ≥ key position, global positions). Two measures of the work:

    useful pairs     the (query, key) pairs the causal mask keeps, over every ring step. With
                     n positions per chunk:
                       contiguous (n = s/cp)      rank r:  n²·r + n(n+1)/2
                       zig-zag    (n = s/(2cp))   rank r:  n²·(2cp − 1) + n(n+1), the same for all r
                     (chunk c alone has n²·c + n(n+1)/2; zig-zag holds chunks r and 2cp − 1 − r)
    computed blocks  the [s/cp, s/cp] blocks RingAttention multiplies out: every block with at
                     least one kept pair (a fully masked block is skipped; a partly masked one
                     is computed whole and then masked). Contiguous: r + 1; zig-zag: cp.

Forward FLOPs are 4·b·h·d per pair (QKᵀ and P·V, 2 FLOPs per multiply-add). The ring is
synchronous, so a step costs what its busiest rank computes: contiguous has rank cp − 1 busy at
every step, zig-zag every rank at every step, so both take cp block-times per layer here.
Zig-zag balances the useful work; turning that into a shorter step needs a kernel that skips
the masked half of each off-diagonal block (half of q, or half of k/v), which tpedu does not do.
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from tpedu.cp.ring import block_scores, check_cp_length, chunk_positions


def block_mask(s: int, cp: int, rank: int, owner: int, layout: str = "zigzag") -> torch.Tensor:
    """[s/cp, s/cp] bool: which of `rank`'s queries may see which of `owner`'s keys."""
    q = chunk_positions(s, cp, rank, layout)
    k = chunk_positions(s, cp, owner, layout)
    return q[:, None] >= k[None, :]


def ring_schedule(s: int, cp: int, layout: str = "zigzag") -> list[list[tuple[int, int]]]:
    """schedule[rank][step] = (owner of the visiting K/V block, useful pairs in that block).

    Step i: rank r holds the block of rank (r − i) mod cp, as in RingAttention."""
    out = []
    for rank in range(cp):
        row = []
        for step in range(cp):
            owner = (rank - step) % cp
            row.append((owner, int(block_mask(s, cp, rank, owner, layout).sum())))
        out.append(row)
    return out


def causal_pairs(s: int, cp: int, rank: int, layout: str = "zigzag") -> int:
    """Useful (query, key) pairs of `rank`'s queries over the whole ring (counted)."""
    return sum(pairs for _, pairs in ring_schedule(s, cp, layout)[rank])


def causal_pairs_formula(s: int, cp: int, rank: int, layout: str = "zigzag") -> int:
    """The same, closed form (see the module docstring)."""
    check_cp_length(s, cp, layout)
    if layout == "contiguous":
        n = s // cp
        return n * n * rank + n * (n + 1) // 2
    n = s // (2 * cp)
    return n * n * (2 * cp - 1) + n * (n + 1)


def computed_blocks(s: int, cp: int, rank: int, layout: str = "zigzag") -> int:
    """Blocks RingAttention computes on `rank` (those with at least one useful pair)."""
    return sum(pairs > 0 for _, pairs in ring_schedule(s, cp, layout)[rank])


def attention_flops(
    s: int,
    cp: int,
    rank: int,
    layout: str,
    batch: int,
    n_heads: int,
    head_dim: int,
    computed: bool = False,
) -> int:
    """Forward FLOPs of `rank`'s attention core (4·b·h·d per pair): the useful pairs, or with
    computed=True every pair of the blocks the code multiplies out."""
    if computed:
        pairs = computed_blocks(s, cp, rank, layout) * (s // cp) ** 2
    else:
        pairs = causal_pairs(s, cp, rank, layout)
    return 4 * batch * n_heads * head_dim * pairs


def time_rank(
    s: int,
    cp: int,
    rank: int,
    layout: str = "zigzag",
    batch: int = 1,
    n_heads: int = 4,
    head_dim: int = 16,
    repeats: int = 5,
) -> float:
    """Median seconds of `rank`'s forward block computations, in this process, no
    communication: the same block rule and arithmetic as RingAttention.forward."""
    g = torch.Generator().manual_seed(0)
    n = s // cp
    q, k, v = (torch.randn(batch, n_heads, n, head_dim, generator=g) for _ in range(3))
    scale = 1.0 / math.sqrt(head_dim)
    masks = [block_mask(s, cp, rank, (rank - i) % cp, layout) for i in range(cp)]
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        for mask in masks:
            if mask.any():
                scores = block_scores(q, k, mask, scale)
                lse = torch.logsumexp(scores, dim=-1)
                safe = torch.where(torch.isinf(lse), 0.0, lse)
                torch.matmul(torch.exp(scores - safe[..., None]), v)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])  # the first run warms the allocator
