"""Lesson 17 exercise: one decode step of attention against a KV cache sharded by heads.

Fill in `decode_attention`, then run `make grade EX=l17` (or
`python -m tpedu.course.grading l17`);
notebooks/17_serving.ipynb uses it through `pick("l17_kv_decode")`.
It works on one rank's tensors: no communication (the cache never moves).
"""

from __future__ import annotations

import torch


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    length: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attend the newest token of every sequence over all of its positions, using the cache.

    This rank holds `heads_r` query heads and `kv_r` KV heads (heads_r a multiple of kv_r):
    q [b, heads_r, 1, d] and k, v [b, kv_r, 1, d] are the projections of the new token (RoPE, if
    any, already applied at its position); cache_k, cache_v [b, kv_r, capacity, d] hold the keys
    and values of positions 0 .. length-1 of every sequence in their first `length` slots.

    Write the new token's key and value into slot `length`, then compute softmax attention
    (scores scaled by 1/√d) of the new query over positions 0 .. length: all of them are in its
    past, so no causal mask is needed beyond not reading slots that are not filled yet. With
    grouped-query attention, each KV head serves heads_r / kv_r consecutive query heads.

    Return (out [b, 1, heads_r·d], the heads side by side as the out-projection expects them,
    cache_k, cache_v) with the new slot filled (updating the given tensors in place is fine).
    length >= capacity -> ValueError saying the cache is full.
    """
    raise NotImplementedError("l17: write the decode step; hint: tpedu.grading.hint('l17', 1)")
