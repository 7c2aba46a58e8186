"""Ring attention (tpedu.cp.ring, its blocks through the flash kernel and written out) and
Ulysses (tpedu.cp.ulysses) == dense causal attention, forward and backward, at cp 1, 2, 3, 4,
contiguous and zig-zag, MHA and GQA, in float64 (the same arithmetic up to summation order:
~1e-15 relative, 1e-12 asserted) and float32 (each block's softmax and the merge add rounding
of order 1e-7 per block; 1e-5 asserted)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tpedu import launch
from tpedu.comm.tracer import CommTracer
from tpedu.cp.blocks import visible
from tpedu.cp.ring import check_cp_length, chunk_positions, ring_attention, split_sequence
from tpedu.cp.ulysses import ulysses_attention


def _dense(q, k, v):
    g = q.shape[1] // k.shape[1]
    kx, vx = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    return F.scaled_dot_product_attention(q, kx, vx, is_causal=True)


def _ring_vs_dense(
    nq: int, nkv: int, s: int, layout: str, dtype: torch.dtype, attention=None, fused=None
):
    cp, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, s, 8, generator=g, dtype=dtype) for n in (nq, nkv, nkv))
    dout = torch.randn(2, nq, s, 8, generator=g, dtype=dtype)
    for t in (q, k, v):
        t.requires_grad_()
    want = _dense(q, k, v)
    want.backward(dout)
    positions = torch.stack([chunk_positions(s, cp, r, layout) for r in range(cp)])
    mine = [split_sequence(t.detach(), cp, rank, layout).requires_grad_() for t in (q, k, v)]
    with CommTracer() as trace:
        got = (attention or functools.partial(ring_attention, fused=fused))(*mine, positions)
        got.backward(split_sequence(dout, cp, rank, layout))
    diffs = {
        "out": (got - split_sequence(want.detach(), cp, rank, layout)).abs().max().item(),
        **{
            f"d{n}": (m.grad - split_sequence(t.grad, cp, rank, layout)).abs().max().item()
            for n, m, t in zip("qkv", mine, (q, k, v), strict=True)
        },
    }
    return diffs, trace.summary()


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize(("nq", "nkv"), [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_ring_attention_equals_dense_causal_attention(cp, layout, nq, nkv, fused):
    s = 24  # divisible by cp and 2·cp for cp = 1, 2, 3 (and 4: 8, 24)
    s = 48 if cp == 4 else s
    for rank, (diffs, _) in enumerate(
        launch(_ring_vs_dense, cp, nq, nkv, s, layout, torch.float64, fused=fused)
    ):
        assert max(diffs.values()) < 1e-12, f"cp={cp} {layout} rank {rank}: {diffs}"


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
def test_ring_attention_in_float32(fused):
    for diffs, _ in launch(_ring_vs_dense, 4, 4, 2, 32, "zigzag", torch.float32, fused=fused):
        assert max(diffs.values()) < 1e-5, diffs


def _kinds(s: int, cp: int, layout: str) -> list[list[str]]:
    """visible()'s kind of every (rank, owner) block."""
    pos = [chunk_positions(s, cp, r, layout) for r in range(cp)]
    return [[visible(pos[r], pos[o]).kind for o in range(cp)] for r in range(cp)]


def test_which_part_of_a_block_the_fused_kernel_computes():
    # contiguous: the past whole, the diagonal causal, the future skipped
    assert _kinds(16, 4, "contiguous")[2] == ["all", "all", "causal", "none"]
    # zig-zag: every off-diagonal block is half a block (queries or keys), none is skipped
    kinds = _kinds(16, 4, "zigzag")
    for r in range(4):
        for o in range(4):  # earlier owners: their first chunk; later: only our second chunk
            assert kinds[r][o] == ("cols" if o < r else "rows" if o > r else "causal")
    pos = chunk_positions(8, 2, 0, "zigzag")  # rank 0: positions 0, 1, 6, 7
    assert visible(pos, chunk_positions(8, 2, 1, "zigzag")).rows == slice(2, 4)  # 6, 7 see 2..5
    assert visible(torch.tensor([0, 2]), torch.tensor([1, 3])).kind == "mask"  # irregular


def test_the_ring_sends_kv_heads_cp_minus_1_times_forward():
    """Forward: cp − 1 sends each of k and v ([b, nkv, s/cp, d]: KV heads, not the expanded
    query heads); backward: cp − 1 of k and v, and cp of dk and dv."""
    cp, s = 4, 32
    kv_numel = 2 * 2 * (s // cp) * 8  # b · nkv · s/cp · d
    for _, summary in launch(_ring_vs_dense, cp, 4, 2, s, "zigzag", torch.float64):
        fwd = summary[("world", "send", "forward")]
        bwd = summary[("world", "send", "backward")]
        assert fwd[:2] == (2 * (cp - 1), 2 * (cp - 1) * kv_numel), fwd
        assert bwd[:2] == (4 * (cp - 1) + 2, (4 * (cp - 1) + 2) * kv_numel), bwd


def test_positions_and_lengths():
    assert chunk_positions(8, 2, 0, "zigzag").tolist() == [0, 1, 6, 7]
    assert chunk_positions(8, 2, 1, "zigzag").tolist() == [2, 3, 4, 5]
    assert chunk_positions(8, 2, 1, "contiguous").tolist() == [4, 5, 6, 7]
    with pytest.raises(ValueError, match=r"sequence length 12 is not divisible by 8 .*8, 16, 24"):
        check_cp_length(12, 4, "zigzag")


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize(("nq", "nkv"), [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_ulysses_equals_dense_causal_attention(cp, layout, nq, nkv):
    if nkv % cp:
        with pytest.raises(Exception, match=r"Ulysses needs cp to divide the KV heads"):
            launch(_ring_vs_dense, cp, nq, nkv, 16, layout, torch.float64, ulysses_attention)
        return
    runs = launch(_ring_vs_dense, cp, nq, nkv, 16, layout, torch.float64, ulysses_attention)
    for rank, (diffs, summary) in enumerate(runs):
        assert max(diffs.values()) < 1e-12, f"cp={cp} {layout} rank {rank}: {diffs}"
        if cp > 1:  # q, k, v and out forward; their gradients backward
            assert summary[("world", "all_to_all", "forward")][0] == 4
            assert summary[("world", "all_to_all", "backward")][0] == 4


def _saved_bytes(s: int) -> int:
    from tpedu.analysis.activation_memory import SavedTensorCounter

    cp = dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, s // cp, 8, generator=g, requires_grad=True) for _ in range(3))
    positions = torch.stack([chunk_positions(s, cp, r) for r in range(cp)])
    with SavedTensorCounter() as counter:
        out = ring_attention(q, k, v, positions)
    out.sum().backward()
    return counter.total


def test_what_the_ring_saves_for_backward_shrinks_as_s_over_cp():
    """q, k, v, out [b, h, s/cp, d] and the log-sum-exp [b, h, s/cp]: 4·b·h·(s/cp)·d + b·h·s/cp
    values (+ the [cp, s/cp] positions), never an [s, s] block: doubling cp halves it."""
    s, b, h, d = 64, 1, 4, 8
    for cp in (2, 4):
        saved = launch(_saved_bytes, cp, s)
        n = s // cp
        want = 4 * (4 * b * h * n * d + b * h * n) + 8 * cp * n  # float32 values, int64 positions
        assert saved == [want] * cp, (cp, saved, want)
