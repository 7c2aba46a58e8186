"""Grades exercises/l09_context_parallel.py: the log-sum-exp merge, the zig-zag assignment and
one ring step, against softmax attention written out densely. float64 throughout: the merge and
the blocked softmax are the dense arithmetic up to summation order (~1e-16 relative; 1e-12
asserted), while a wrong weight, mask or chunk is off by order one. tpedu's own ring attention
(tpedu.cp.ring, tpedu.cp.blocks) refuses to run while the learner's code does, so a wrapper or an
alias of it fails; the package's assignment, to compare with, is taken before."""

import math

import pytest
import torch
import torch.nn.functional as F

from tests.exercises import refusing
from tpedu.course.grading import implementation
from tpedu.cp import blocks, ring
from tpedu.cp.ring import chunk_positions

NAME = "l09_context_parallel"
TWINS = (
    ring.merge_partials,
    ring.chunk_positions,
    ring.split_sequence,
    ring.block_scores,
    ring.RingAttention.forward,
    blocks.block_forward,
)


def _attention_over(q, k, v, visible):
    """Softmax attention of q over the keys `visible` [sq, sk] allows, and its log-denominator."""
    scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(scores, -1)
    weights = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return weights @ v, lse


def _qkv(sq=6, sk=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 3, n, 4, generator=g, dtype=torch.float64) for n in (sq, sk, sk))


@refusing(*TWINS)
def test_merge_of_two_key_sets_equals_softmax_over_their_union():
    merge = implementation(NAME).merge_partials
    q, k, v = _qkv()
    g = torch.Generator().manual_seed(1)
    in_a = torch.rand(6, 10, generator=g) < 0.5  # each query its own random split of the keys
    want, want_lse = _attention_over(q, k, v, torch.ones(6, 10, dtype=torch.bool))
    out, lse = merge(*_attention_over(q, k, v, in_a), *_attention_over(q, k, v, ~in_a))
    assert out.shape == want.shape and lse.shape == want_lse.shape
    assert (out - want).abs().max() < 1e-12
    assert (lse - want_lse).abs().max() < 1e-12


@refusing(*TWINS)
def test_merge_in_any_order_and_with_empty_parts():
    merge = implementation(NAME).merge_partials
    q, k, v = _qkv()
    parts = [torch.zeros(6, 10, dtype=torch.bool) for _ in range(3)]
    for j in range(10):
        parts[j % 3][:, j] = True
    parts[0][:2] |= parts[1][:2]  # queries 0, 1 see nothing in part 1 (its lse is -inf there)
    parts[1][:2] = False
    a, b, c = (_attention_over(q, k, v, p) for p in parts)
    want, _ = _attention_over(q, k, v, parts[0] | parts[1] | parts[2])
    for x, y, z in ((a, b, c), (c, a, b), (b, c, a)):
        out, _ = merge(*merge(*x, *y), *z)
        assert (out - want).abs().max() < 1e-12


@refusing(*TWINS)
def test_merge_of_nothing_is_zero_and_large_scores_do_not_overflow():
    merge = implementation(NAME).merge_partials
    out_a, out_b = (
        torch.randn(2, 3, 4, dtype=torch.float64),
        torch.randn(2, 3, 4, dtype=torch.float64),
    )
    lse_a = torch.tensor([[-math.inf, 1000.0, 5.0], [-math.inf, 0.0, 800.0]], dtype=torch.float64)
    lse_b = torch.tensor(
        [[-math.inf, 1000.0, -math.inf], [2.0, 0.0, 800.0 + math.log(3)]], dtype=torch.float64
    )
    out, lse = merge(out_a, lse_a, out_b, lse_b)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(out[0, 0], torch.zeros(4, dtype=torch.float64)) and lse[0, 0] == -math.inf
    assert (out[0, 1] - (out_a[0, 1] + out_b[0, 1]) / 2).abs().max() < 1e-12  # equal shares
    assert (lse[0, 1] - (1000 + math.log(2))).abs() < 1e-12
    assert (out[0, 2] - out_a[0, 2]).abs().max() < 1e-12  # B is empty for this row
    assert (out[1, 0] - out_b[1, 0]).abs().max() < 1e-12
    assert (out[1, 2] - (out_a[1, 2] + 3 * out_b[1, 2]) / 4).abs().max() < 1e-12  # 1 : 3


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_zigzag_positions(cp):
    f = implementation(NAME).zigzag_positions
    s = 12 * cp
    package = [chunk_positions(s, cp, r, "zigzag") for r in range(cp)]
    with refusing(*TWINS):
        assert f(8, 2, 0).tolist() == [0, 1, 6, 7] and f(8, 2, 1).tolist() == [2, 3, 4, 5]
        got = [f(s, cp, r) for r in range(cp)]
    assert all(p.dtype == torch.int64 and p.shape == (s // cp,) for p in got)
    assert sorted(torch.cat(got).tolist()) == list(range(s)), "every position exactly once"
    work = {int((p + 1).sum()) for p in got}  # query at position p sees p + 1 keys
    assert len(work) == 1, f"unequal causal work per rank: {work}"
    for r in range(cp):  # the same assignment the package uses
        assert torch.equal(got[r], package[r])


@refusing(*TWINS)
def test_zigzag_refuses_a_length_it_cannot_split():
    with pytest.raises(ValueError, match=r"10.*8|8.*10"):
        implementation(NAME).zigzag_positions(10, 4, 0)


@refusing(*TWINS)
def test_ring_step_is_attention_over_the_visible_keys():
    step = implementation(NAME).ring_step
    q, k, v = _qkv(sq=6, sk=10)
    qpos = torch.tensor([0, 3, 4, 9, 15, 2])
    kpos = torch.tensor([5, 1, 2, 8, 0, 3, 4, 9, 7, 6])
    out, lse = step(q, k, v, qpos, kpos)
    want, want_lse = _attention_over(q, k, v, qpos[:, None] >= kpos[None, :])
    assert out.shape == (2, 3, 6, 4) and lse.shape == (2, 3, 6)
    assert (out - want).abs().max() < 1e-12
    assert torch.allclose(lse, want_lse, rtol=0, atol=1e-12)
    # the same queries against keys all in their future: nothing to see, and no NaN
    out, lse = step(q, k, v, qpos, kpos + 100)
    assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all())


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_a_whole_ring_on_one_process_equals_dense_causal_attention(layout):
    """Every rank's queries, merged over every rank's block in ring order == dense attention."""
    m = implementation(NAME)
    s, cp = 24, 3
    q, k, v = _qkv(sq=s, sk=s, seed=2)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    held = [chunk_positions(s, cp, rank, layout) for rank in range(cp)]
    for rank in range(cp):
        mine = held[rank]
        out = torch.zeros(2, 3, s // cp, 4, dtype=torch.float64)
        lse = torch.full((2, 3, s // cp), -math.inf, dtype=torch.float64)
        for i in range(cp):
            theirs = held[(rank - i) % cp]
            with refusing(*TWINS):
                block = m.ring_step(q[:, :, mine], k[:, :, theirs], v[:, :, theirs], mine, theirs)
                out, lse = m.merge_partials(out, lse, *block)
        assert (out - want[:, :, mine]).abs().max() < 1e-12, (layout, rank)
