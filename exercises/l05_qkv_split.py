"""Exercise l05: lay out the fused QKV weight for tensor-parallel attention (seed §2.3).

A fused QKV projection has weight [(nq + 2·nkv)·d, H] whose rows are, top to bottom, the d rows
of each query head, then of each key head, then of each value head:

    | q0 q1 ... q(nq-1) | k0 ... k(nkv-1) | v0 ... v(nkv-1) |      (each block: d rows)

With tp ranks, rank r computes query heads [r·nq/tp, (r+1)·nq/tp) and needs the q, k and v rows
of exactly those heads, in the order [its q | its k | its v]. Chunking the fused matrix into tp
equal row blocks does NOT give that (try it in notebook 05).

Grouped-query attention (GQA): query head j uses KV head j // (nq/nkv).
  - tp <= nkv: KV heads are split like the q heads, rank r keeps [r·nkv/tp, (r+1)·nkv/tp).
  - tp > nkv: each rank keeps one KV head, a replica of the head its query heads use.

Fill in both functions, then run `make grade EX=l05`.
"""

from __future__ import annotations

import torch


def local_heads(n_heads: int, n_kv_heads: int, tp: int, rank: int) -> tuple[list[int], list[int]]:
    """The global indices of the (query heads, KV heads) that `rank` computes.

    Examples: local_heads(8, 8, 2, 1) == ([4, 5, 6, 7], [4, 5, 6, 7]);
              local_heads(8, 4, 2, 1) == ([4, 5, 6, 7], [2, 3]);
              local_heads(8, 2, 4, 3) == ([6, 7], [1])          (KV head 1 replicated on ranks 2, 3).
    Raise ValueError when n_heads is not divisible by tp, or when tp neither divides n_kv_heads
    nor is a multiple of it.
    """
    raise NotImplementedError("l05: find the rank's heads; hint: tpedu.grading.hint('l05', 1)")


def split_qkv(
    weight: torch.Tensor, n_heads: int, n_kv_heads: int, tp: int, rank: int
) -> torch.Tensor:
    """This rank's rows of the fused QKV weight [(nq + 2·nkv)·d, H] (or bias [(nq + 2·nkv)·d]).

    d = weight.shape[0] // (n_heads + 2·n_kv_heads). Returns [(nq/tp + 2·nkv_r)·d, ...] with the
    rows of the rank's query heads, then its key heads, then its value heads (nkv_r = nkv/tp, or 1
    when tp > nkv), each head's d rows in their original order. Works along dim 0 only, so the
    same call splits the bias. Return a new tensor (not a view of `weight`).
    """
    raise NotImplementedError(
        "l05: pick the rank's rows of the fused weight; hint: tpedu.grading.hint('l05', 1)"
    )
