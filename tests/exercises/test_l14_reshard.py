"""Grades exercises/l14_reshard.py: merging and re-splitting column, row and fused-QKV shards.

The expected shards are cut here by the model itself (ColumnParallelLinear, RowParallelLinear,
ParallelAttention built on one process per simulated rank would need ranks, so they are cut with
tpedu's sharding rules: torch.chunk and tpedu.tp.attention.split_qkv). Merging and splitting only
move numbers, so every check is exact (torch.equal). Shapes are uneven and entries random, so
concatenating along the wrong dim or in the wrong order cannot pass. tpedu's own merges
(tpedu.model.state) refuse to run while the tests do, so a wrapper or an alias of them fails;
split_qkv, lesson 05's, is the learner's to use.
"""

import pytest
import torch

from tests.exercises import refusing
from tpedu.course.grading import implementation
from tpedu.model import state
from tpedu.tp.attention import split_qkv

NAME = "l14_reshard"
TWINS = (
    state.merge_column,
    state.merge_row,
    state.merge_qkv,
    state.merge_shards,
    state.split_tensor,
)


def _w(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _same(got, want, what):
    assert got.shape == want.shape, (
        f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    )
    diff = (got - want).abs().max().item()
    assert torch.equal(got, want), f"{what}: max |got - expected| = {diff:.3e}"


@refusing(*TWINS)
def test_merge_column():
    m = implementation(NAME)
    for tp, (out, inp) in ((2, (6, 5)), (3, (9, 4)), (4, (12, 7))):
        w = _w(out, inp, seed=tp)
        _same(m.merge_column(list(w.chunk(tp, dim=0))), w, f"column weight tp={tp}")
        b = _w(out, seed=tp + 10)
        _same(m.merge_column(list(b.chunk(tp))), b, f"column bias tp={tp}")


@refusing(*TWINS)
def test_merge_row():
    m = implementation(NAME)
    for tp, (out, inp) in ((2, (5, 6)), (3, (4, 9)), (4, (7, 12))):
        w = _w(out, inp, seed=tp)
        _same(m.merge_row(list(w.chunk(tp, dim=1))), w, f"row weight tp={tp}")


@pytest.mark.parametrize(
    "nq, nkv, tp", [(4, 4, 2), (6, 3, 3), (8, 2, 2), (4, 2, 4), (6, 1, 3), (4, 1, 1)]
)
@refusing(*TWINS)
def test_merge_qkv(nq, nkv, tp):
    """MHA, GQA split over ranks, and GQA replicated (tp > nkv); weight and bias."""
    m = implementation(NAME)
    d, hidden = 3, 5
    w = _w((nq + 2 * nkv) * d, hidden, seed=nq * 10 + nkv)
    shards = [split_qkv(w, nq, nkv, tp, r) for r in range(tp)]
    _same(m.merge_qkv(shards, nq, nkv), w, f"qkv weight nq={nq} nkv={nkv} tp={tp}")
    b = _w((nq + 2 * nkv) * d, seed=nq)
    _same(
        m.merge_qkv([split_qkv(b, nq, nkv, tp, r) for r in range(tp)], nq, nkv),
        b,
        f"qkv bias nq={nq} nkv={nkv} tp={tp}",
    )


@refusing(*TWINS)
def test_reshard_column_and_row():
    m = implementation(NAME)
    w = _w(12, 24, seed=3)  # both dims divisible by 1, 2, 3, 4
    for old, new in ((1, 4), (4, 2), (2, 3), (3, 1)):
        for kind, dim in (("column", 0), ("row", 1)):
            got = m.reshard(list(w.chunk(old, dim=dim)), kind, new)
            want = list(w.chunk(new, dim=dim))
            assert len(got) == new, f"{kind} {old}->{new}: {len(got)} shards, expected {new}"
            for r, (g, e) in enumerate(zip(got, want, strict=True)):
                _same(g, e, f"{kind} {old}->{new} rank {r}")


@refusing(*TWINS)
def test_reshard_qkv_across_replication():
    """tp 1 -> 4 -> 2 -> 8 -> 1 with 8 query heads and 2 KV heads: KV heads split at tp 2,
    replicated at 4 and 8."""
    m = implementation(NAME)
    nq, nkv, d = 8, 2, 2
    w = _w((nq + 2 * nkv) * d, 6, seed=7)
    shards = [w.clone()]
    for new in (4, 2, 8, 1):
        shards = m.reshard(shards, "qkv", new, nq, nkv)
        assert len(shards) == new, f"qkv ->{new}: {len(shards)} shards"
        for r in range(new):
            _same(shards[r], split_qkv(w, nq, nkv, new, r), f"qkv ->{new} rank {r}")
