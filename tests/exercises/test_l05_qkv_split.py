"""Grades exercises/l05_qkv_split.py: each rank's rows of the fused [q|k|v] weight.

The row selection is checked exactly (labelled rows, torch.equal) against a layout built here in
a different way (per-head views of the three blocks). The end-to-end test runs tp "ranks" in one
process: the sum of their out-projection partial sums must equal DenseAttention's output; float64
and the only difference is the order of that sum, so 1e-12 absolute on O(1) outputs.

tpedu's own head split (tpedu.tp.attention: local_heads, qkv_rows, split_qkv) refuses to run
while the tests do, so a wrapper or an alias of it fails.
"""

import pytest
import torch

from tests.exercises import refusing
from tpedu.course.grading import implementation
from tpedu.tp import attention
from tpedu.tp.dense import DenseAttention

NAME = "l05_qkv_split"
TWINS = (attention.local_heads, attention.qkv_rows, attention.split_qkv)


def _labelled(nq: int, nkv: int, d: int, hidden: int = 5) -> torch.Tensor:
    """Fused weight whose column 0 is the row number (so a wrong row is visible), rest random."""
    w = torch.randn(
        (nq + 2 * nkv) * d,
        hidden,
        generator=torch.Generator().manual_seed(nq * d),
        dtype=torch.float64,
    )
    w[:, 0] = torch.arange(w.shape[0], dtype=torch.float64)
    return w


def _expected(w: torch.Tensor, nq: int, nkv: int, tp: int, rank: int) -> torch.Tensor:
    d = w.shape[0] // (nq + 2 * nkv)
    q, k, v = (
        b.reshape(n, d, *w.shape[1:])
        for b, n in zip(w.split([nq * d, nkv * d, nkv * d]), (nq, nkv, nkv), strict=True)
    )
    q = q.chunk(tp)[rank]
    if tp <= nkv:
        k, v = k.chunk(tp)[rank], v.chunk(tp)[rank]
    else:
        h = rank * nkv // tp
        k, v = k[h : h + 1], v[h : h + 1]
    return torch.cat([q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)])


def _check_split(nq: int, nkv: int, d: int, tps: tuple[int, ...]) -> None:
    m = implementation(NAME)
    w = _labelled(nq, nkv, d)
    for tp in tps:
        for rank in range(tp):
            got = m.split_qkv(w, nq, nkv, tp, rank)
            want = _expected(w, nq, nkv, tp, rank)
            assert got.shape == want.shape, (
                f"tp={tp} rank={rank}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
            )
            assert torch.equal(got, want), (
                f"tp={tp} rank={rank}: rows {got[:, 0].long().tolist()}, "
                f"expected {want[:, 0].long().tolist()}"
            )
            assert got.data_ptr() != w.data_ptr(), "return a new tensor, not a view of weight"


@refusing(*TWINS)
def test_local_heads():
    m = implementation(NAME)
    assert m.local_heads(8, 8, 2, 1) == ([4, 5, 6, 7], [4, 5, 6, 7])
    assert m.local_heads(6, 6, 3, 0) == ([0, 1], [0, 1])
    assert m.local_heads(8, 4, 2, 1) == ([4, 5, 6, 7], [2, 3])
    assert m.local_heads(12, 4, 4, 2) == ([6, 7, 8], [2])
    assert [m.local_heads(8, 2, 4, r)[1] for r in range(4)] == [[0], [0], [1], [1]]
    assert [m.local_heads(6, 1, 3, r) for r in range(3)] == [
        ([0, 1], [0]),
        ([2, 3], [0]),
        ([4, 5], [0]),
    ]


@refusing(*TWINS)
def test_split_mha():
    _check_split(nq=6, nkv=6, d=3, tps=(1, 2, 3, 6))


@refusing(*TWINS)
def test_split_gqa_split_kv():
    _check_split(nq=8, nkv=4, d=2, tps=(2, 4))  # nkv > tp, nkv == tp


@refusing(*TWINS)
def test_split_gqa_replicated_kv():
    _check_split(nq=8, nkv=2, d=3, tps=(4, 8))  # tp > nkv: each KV head on tp/nkv ranks
    _check_split(nq=6, nkv=1, d=2, tps=(2, 3))  # multi-query: one KV head everywhere


@pytest.mark.parametrize("nq,nkv,tp", [(6, 6, 2), (8, 4, 2), (8, 2, 4), (6, 1, 3)])
@refusing(*TWINS)
def test_tp_attention_equals_dense(nq, nkv, tp):
    """Simulate tp ranks in one process with the split weights and bias: the sum of the ranks'
    out-projection partial results must be the dense attention output."""
    m = implementation(NAME)
    torch.manual_seed(nq + nkv + tp)
    dense = DenseAttention(10, nq, nkv, head_dim=3, dtype=torch.float64)
    x = torch.randn(2, 5, 10, dtype=torch.float64)
    d = 3
    total = 0
    for rank in range(tp):
        w = m.split_qkv(dense.qkv.weight.detach(), nq, nkv, tp, rank)
        b = m.split_qkv(dense.qkv.bias.detach(), nq, nkv, tp, rank)
        nq_r = nq // tp
        nkv_r = (w.shape[0] // d - nq_r) // 2
        q, k, v = (x @ w.T + b).split([nq_r * d, nkv_r * d, nkv_r * d], dim=-1)
        q = q.view(2, 5, nq_r, d).transpose(1, 2)
        k = k.view(2, 5, nkv_r, d).transpose(1, 2).repeat_interleave(nq_r // nkv_r, dim=1)
        v = v.view(2, 5, nkv_r, d).transpose(1, 2).repeat_interleave(nq_r // nkv_r, dim=1)
        s = (q @ k.transpose(-2, -1) / d**0.5).masked_fill(
            torch.ones(5, 5).triu(1).bool(), -torch.inf
        )
        o = (s.softmax(-1) @ v).transpose(1, 2).reshape(2, 5, nq_r * d)
        total = total + o @ dense.out.weight.detach()[:, rank * nq_r * d : (rank + 1) * nq_r * d].T
    diff = (total + dense.out.bias.detach() - dense(x).detach()).abs().max().item()
    assert diff < 1e-12, f"max |parallel - dense| = {diff:.3e}"


@refusing(*TWINS)
def test_invalid_tp_is_an_error():
    m = implementation(NAME)
    w = _labelled(8, 8, 2)
    with pytest.raises(ValueError):
        m.split_qkv(w, 8, 8, 3, 0)  # 8 heads over 3 ranks
    with pytest.raises(ValueError):
        m.local_heads(12, 4, 6, 0)  # 4 KV heads: 6 neither divides 4 nor is a multiple of it
