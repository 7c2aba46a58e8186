"""Reference for exercises/l17_kv_decode.py."""

from __future__ import annotations

import math

import torch


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    length: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [b, heads_r, 1, d], k, v [b, kv_r, 1, d], caches [b, kv_r, capacity, d] with `length`
    filled slots -> (out [b, 1, heads_r·d], cache_k, cache_v with slot `length` written)."""
    capacity = cache_k.shape[2]
    if length >= capacity:
        raise ValueError(
            f"the KV cache is full ({capacity} slots, {length} filled): make a larger cache"
        )
    cache_k[:, :, length] = k[:, :, 0]
    cache_v[:, :, length] = v[:, :, 0]
    keys, values = cache_k[:, :, : length + 1], cache_v[:, :, : length + 1]
    group = q.shape[1] // keys.shape[1]  # query heads per KV head on this rank
    keys = keys.repeat_interleave(group, dim=1)  # [b, heads_r, length + 1, d]
    values = values.repeat_interleave(group, dim=1)
    scores = q @ keys.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [b, heads_r, 1, length + 1]
    out = torch.softmax(scores, dim=-1) @ values  # [b, heads_r, 1, d]
    b, heads, _, d = out.shape
    return out.transpose(1, 2).reshape(b, 1, heads * d), cache_k, cache_v
