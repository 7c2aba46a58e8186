"""Grades exercises/l01_matmul_split.py: column and row splits of Y = X·W on one process.

tpedu's own splits (tpedu.tp.matmul_split) refuse to run while the tests do, so a wrapper or an
alias of them fails."""

import pytest
import torch

from tests.exercises import refusing
from tpedu.course.grading import implementation
from tpedu.tp import matmul_split
from tpedu.tp.matmul_split import ordered_matmul, rounding_bound

TWINS = (
    matmul_split.split_columns,
    matmul_split.split_rows,
    matmul_split.column_parallel_matmul,
    matmul_split.row_parallel_matmul,
)

# W [in, out]: non-square, and uneven for 3 parts (20 = 7+7+6, 13 = 5+4+4, 7 = 3+2+2).
SHAPES = [(5, 12, 20), (3, 7, 13)]
PARTS = (1, 2, 3, 4)


def _data(batch, n_in, n_out, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, n_in, generator=g, dtype=dtype)
    w = torch.randn(n_in, n_out, generator=g, dtype=dtype)
    return x, w


def _sizes(n, parts):
    return [len(c) for c in torch.tensor_split(torch.arange(n), parts)]


class Spy:
    """A matmul that records the shapes and values each "rank" multiplied."""

    def __init__(self, kernel=torch.matmul):
        self.kernel, self.calls = kernel, []

    def __call__(self, a, b):
        self.calls.append((a.clone(), b.clone()))
        return self.kernel(a, b)


def _assert_close(got, want, bound, what):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, want {tuple(want.shape)}"
    err = (got - want).abs()
    assert (err <= bound).all(), f"{what}: max |split - dense| = {err.max():.3e}"


@refusing(*TWINS)
def test_split_columns_blocks_in_order():
    m = implementation("l01_matmul_split")
    for _, n_in, n_out in SHAPES:
        _, w = _data(1, n_in, n_out)
        for parts in PARTS:
            blocks = m.split_columns(w, parts)
            assert [tuple(b.shape) for b in blocks] == [(n_in, s) for s in _sizes(n_out, parts)], (
                f"parts={parts}: block shapes"
            )
            start = 0
            for r, b in enumerate(blocks):
                want = w[:, start : start + b.shape[1]]
                assert torch.equal(b, want), f"parts={parts}: block {r} is not columns of W"
                start += b.shape[1]


@refusing(*TWINS)
def test_split_rows_blocks_in_order():
    m = implementation("l01_matmul_split")
    for _, n_in, n_out in SHAPES:
        _, w = _data(1, n_in, n_out)
        for parts in PARTS:
            blocks = m.split_rows(w, parts)
            assert [tuple(b.shape) for b in blocks] == [(s, n_out) for s in _sizes(n_in, parts)], (
                f"parts={parts}: block shapes"
            )
            assert torch.equal(torch.cat(blocks, dim=0), w), f"parts={parts}: rows out of order"


@refusing(*TWINS)
def test_splits_reject_parts_that_leave_a_block_empty():
    m = implementation("l01_matmul_split")
    _, w = _data(1, 7, 13)
    with pytest.raises(ValueError):
        m.split_columns(w, 14)
    with pytest.raises(ValueError):
        m.split_rows(w, 8)
    with pytest.raises(ValueError):
        m.split_columns(w, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@refusing(*TWINS)
def test_column_parallel_matmul(dtype):
    m = implementation("l01_matmul_split")
    for batch, n_in, n_out in SHAPES:
        x, w = _data(batch, n_in, n_out, dtype, seed=1)
        for parts in PARTS:
            # Each rank multiplies all of X by its own columns: check what it was given.
            spy = Spy(ordered_matmul)
            y = m.column_parallel_matmul(x, w, parts, matmul=spy)
            assert len(spy.calls) == parts, f"parts={parts}: {len(spy.calls)} local products"
            start = 0
            for r, ((a, b), size) in enumerate(zip(spy.calls, _sizes(n_out, parts), strict=True)):
                assert torch.equal(a, x), f"parts={parts}: rank {r} must use all of x"
                cols = w[:, start : start + size]
                assert torch.equal(b, cols), f"parts={parts}: rank {r} must use W_{r}, {cols.shape}"
                start += size
            # Same dot product, same order, per element: bit-exact (0.0) with an ordered kernel.
            _assert_close(y, ordered_matmul(x, w), 0.0, f"column parts={parts}")
            # With BLAS, any order is within rounding_bound of exact, so twice it between two.
            y = m.column_parallel_matmul(x, w, parts)
            _assert_close(y, x @ w, 2 * rounding_bound(x, w), f"column parts={parts}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@refusing(*TWINS)
def test_row_parallel_matmul(dtype):
    m = implementation("l01_matmul_split")
    for batch, n_in, n_out in SHAPES:
        x, w = _data(batch, n_in, n_out, dtype, seed=2)
        for parts in PARTS:
            # Rank r multiplies the features X_r by the matching rows W_r.
            spy = Spy()
            y = m.row_parallel_matmul(x, w, parts, matmul=spy)
            assert len(spy.calls) == parts, f"parts={parts}: {len(spy.calls)} local products"
            start = 0
            for r, ((a, b), size) in enumerate(zip(spy.calls, _sizes(n_in, parts), strict=True)):
                rows = slice(start, start + size)
                assert torch.equal(b, w[rows]), f"parts={parts}: rank {r} must use rows W_{r}"
                assert torch.equal(a, x[:, rows]), f"parts={parts}: rank {r}: x not split to match"
                start += size
            # Summing partials reorders the additions: equal up to rounding, within 2x the bound.
            _assert_close(y, x @ w, 2 * rounding_bound(x, w), f"row parts={parts}")


@refusing(*TWINS)
def test_integer_valued_matrices_are_exact():
    # Integers |v| <= 8, in = 12: every partial sum is an exactly representable fp32 integer, so
    # no summation order can round and both splits must equal the dense product bit for bit.
    m = implementation("l01_matmul_split")
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-8, 9, (5, 12), generator=g).float()
    w = torch.randint(-8, 9, (12, 20), generator=g).float()
    for parts in PARTS:
        _assert_close(m.column_parallel_matmul(x, w, parts), x @ w, 0.0, f"column parts={parts}")
        _assert_close(m.row_parallel_matmul(x, w, parts), x @ w, 0.0, f"row parts={parts}")
