"""Grades exercises/l17_kv_decode.py: one decode step against a KV cache sharded by heads.

Token by token from an empty cache, each rank's decode outputs, side by side over the ranks,
must equal causal attention over the whole sequence computed at once. Each rank holds the heads
tpedu.tp.attention.local_heads gives it: its share of the KV heads, or a replica of one when tp
> n_kv_heads. float64: both are the same sums in a different order (~1e-16 relative; 1e-12
asserted), while a wrong slot, a missing or extra key, or KV heads matched to the wrong query
heads are off by order one. tpedu's own cached attention (tpedu.tp.attention, tpedu.tp.kv_cache)
refuses to run while the learner's decode does, so a wrapper or an alias of it fails."""

import math

import pytest
import torch

from tests.exercises import refusing
from tpedu.course.grading import implementation
from tpedu.tp.attention import ParallelAttention, local_heads
from tpedu.tp.kv_cache import LayerCache

NAME = "l17_kv_decode"
B, S, D = 2, 7, 4
TWINS = (ParallelAttention._cached_core, LayerCache.update)


def _projections(heads, kv_heads, seed=0):
    """q [b, heads, S, d] and k, v [b, kv_heads, S, d] of a whole sequence, float64."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, heads, S, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, kv_heads, S, D, generator=g, dtype=torch.float64) for _ in "kv")
    return q, k, v


def _causal_attention(q, k, v):
    """The whole sequence at once, grouped-query: [b, S, heads·d]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)
    future = torch.ones(S, S, dtype=torch.bool).triu(1)
    out = torch.softmax(scores.masked_fill(future, -math.inf), -1) @ v
    return out.transpose(1, 2).reshape(B, S, -1)


@refusing(*TWINS)
def _decode_on_ranks(heads, kv_heads, tp, capacity=S):
    """Every rank decodes positions 0 .. S-1 one at a time from an empty cache of its own KV
    heads; returns the outputs [b, S, heads·d] (ranks' heads side by side) and the caches."""
    decode = implementation(NAME).decode_attention
    q, k, v = _projections(heads, kv_heads)
    per_rank, caches = [], []
    for rank in range(tp):
        qh, kvh = local_heads(heads, kv_heads, tp, rank)
        ck = torch.zeros(B, len(kvh), capacity, D, dtype=torch.float64)
        cv = torch.zeros_like(ck)
        steps = []
        for p in range(S):
            at_p = [t[:, idx, p : p + 1] for t, idx in ((q, qh), (k, kvh), (v, kvh))]
            out, ck, cv = decode(*at_p, ck, cv, p)  # the token at position p
            assert out.shape == (B, 1, len(qh) * D)
            steps.append(out)
        per_rank.append(torch.cat(steps, 1))
        caches.append((kvh, ck, cv))
    return torch.cat(per_rank, -1), caches, (q, k, v)


@pytest.mark.parametrize(
    "heads, kv_heads, tp",
    [(4, 4, 1), (4, 2, 1), (4, 4, 2), (4, 2, 2), (4, 1, 2), (4, 2, 4)],
    ids=["mha-tp1", "gqa-tp1", "mha-tp2", "gqa-split-tp2", "gqa-replica-tp2", "gqa-replica-tp4"],
)
def test_decoding_token_by_token_equals_causal_attention(heads, kv_heads, tp):
    out, _, (q, k, v) = _decode_on_ranks(heads, kv_heads, tp)
    assert (out - _causal_attention(q, k, v)).abs().max() < 1e-12


@pytest.mark.parametrize("heads, kv_heads, tp", [(4, 2, 2), (4, 1, 2)])
def test_each_rank_caches_its_own_kv_heads_at_their_positions(heads, kv_heads, tp):
    _, caches, (_, k, v) = _decode_on_ranks(heads, kv_heads, tp, capacity=S + 3)
    for kvh, ck, cv in caches:
        assert torch.equal(ck[:, :, :S], k[:, kvh]) and torch.equal(cv[:, :, :S], v[:, kvh])
        assert not ck[:, :, S:].any() and not cv[:, :, S:].any()  # unfilled slots untouched


@refusing(*TWINS)
def test_a_full_cache_is_a_value_error():
    decode = implementation(NAME).decode_attention
    q, k, v = _projections(2, 1)
    ck = torch.zeros(B, 1, 3, D, dtype=torch.float64)
    with pytest.raises(ValueError, match="full"):
        decode(q[:, :, :1], k[:, :, :1], v[:, :, :1], ck, ck.clone(), 3)
