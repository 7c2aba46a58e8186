"""tpedu.tp.matmul_split: column and row splits of Y = X·W on one process."""

import matplotlib

matplotlib.use("Agg")  # before pyplot: no display in tests

import matplotlib.pyplot as plt
import pytest
import torch
import torch.nn.functional as F
from matplotlib.patches import Rectangle

from tpedu.tp.matmul_split import (
    act_before_sum_wrong,
    column_parallel_matmul,
    draw_split,
    mlp_column_then_row,
    ordered_matmul,
    rounding_bound,
    row_parallel_matmul,
    split_columns,
    split_rows,
    split_sizes,
)

# (batch, in, out): non-square, uneven for 3 and 4 parts, plus a 3-D x.
SHAPES = [(5, 12, 20), (3, 7, 13), ((2, 3), 10, 9)]
DTYPES = [torch.float32, torch.float64]


def _data(batch, n_in, n_out, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    batch = batch if isinstance(batch, tuple) else (batch,)
    x = torch.randn(*batch, n_in, generator=g, dtype=dtype)
    w = torch.randn(n_in, n_out, generator=g, dtype=dtype)
    return x, w


def test_split_sizes_match_tensor_split_and_reject_bad_parts():
    for n in (1, 7, 12, 20):
        for parts in range(1, n + 1):
            want = [len(c) for c in torch.tensor_split(torch.arange(n), parts)]
            assert split_sizes(n, parts) == want, (n, parts)
    with pytest.raises(ValueError, match=r"3 columns into 4 parts.*parts <= 3"):
        split_sizes(3, 4)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="positive int"):
            split_sizes(8, bad)


def test_split_blocks_are_the_right_slices_in_order():
    _, w = _data(1, 7, 13, torch.float64)
    for parts in (1, 2, 3, 4):
        cols, rows = split_columns(w, parts), split_rows(w, parts)
        assert [c.shape[1] for c in cols] == split_sizes(13, parts)
        assert all(c.shape[0] == 7 for c in cols)
        assert [r.shape[0] for r in rows] == split_sizes(7, parts)
        assert all(r.shape[1] == 13 for r in rows)
        assert torch.equal(torch.cat(cols, dim=1), w)
        assert torch.equal(torch.cat(rows, dim=0), w)
    with pytest.raises(ValueError, match=r"7 rows into 8 parts"):
        split_rows(w, 8)
    with pytest.raises(ValueError, match="2-D"):
        split_columns(w[None], 2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_column_split_is_bit_exact_with_an_ordered_kernel(dtype):
    # Each output element is the same dot product in the same order: identical bits, any parts.
    for batch, n_in, n_out in SHAPES:
        x, w = _data(batch, n_in, n_out, dtype)
        dense = ordered_matmul(x, w)
        for parts in range(1, n_out + 1):
            y = column_parallel_matmul(x, w, parts, matmul=ordered_matmul)
            assert torch.equal(y, dense), (batch, n_in, n_out, parts)


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_split_is_within_the_rounding_bound(dtype):
    # Any summation order of `in` products is within rounding_bound of the exact result, so two
    # orders (dense BLAS, ordered, row split of either) differ by at most twice the bound.
    for batch, n_in, n_out in SHAPES:
        x, w = _data(batch, n_in, n_out, dtype, seed=1)
        bound = 2 * rounding_bound(x, w)
        dense = x @ w
        assert ((ordered_matmul(x, w) - dense).abs() <= bound).all()
        for parts in range(1, n_in + 1):
            for matmul in (torch.matmul, ordered_matmul):
                ys = [row_parallel_matmul(x, w, parts, matmul=matmul)]
                if parts <= n_out:
                    ys.append(column_parallel_matmul(x, w, parts, matmul=matmul))
                for y in ys:
                    err = (y - dense).abs()
                    assert (err <= bound).all(), f"parts={parts}: max err {err.max():.3e}"


def test_row_split_really_reorders_the_sum():
    # Guards against a "row split" that just computes x @ w: with the ordered kernel, parts=2
    # restarts the sum at in/2, which for this seed changes some element's last bit (IEEE
    # arithmetic, so the same on every machine), while parts=1 cannot change anything.
    x, w = _data(5, 12, 20, torch.float32)
    dense = ordered_matmul(x, w)
    assert torch.equal(row_parallel_matmul(x, w, 1, matmul=ordered_matmul), dense)
    assert not torch.equal(row_parallel_matmul(x, w, 2, matmul=ordered_matmul), dense)


def test_integer_valued_matrices_are_exact_for_both_splits():
    # Integers |v| <= 8, in = 12: every partial sum is an integer below 2**24, so fp32 represents
    # it exactly and no order can round: column and row splits equal torch.matmul bit for bit.
    g = torch.Generator().manual_seed(2)
    x = torch.randint(-8, 9, (5, 12), generator=g).float()
    w = torch.randint(-8, 9, (12, 20), generator=g).float()
    dense = x @ w
    for parts in (1, 2, 3, 4, 12):
        assert torch.equal(column_parallel_matmul(x, w, parts), dense)
        assert torch.equal(row_parallel_matmul(x, w, parts), dense)


def test_gradients_match_dense():
    # fp64; the backward of a split is a split of the backward, so grads obey the same kind of
    # bound. 1e-12 relative is ~4000 u for sums of <= 20 terms: ample and still sharp.
    x, w = _data(5, 12, 20, torch.float64, seed=3)
    g = torch.randn(5, 20, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    xd, wd = x.clone().requires_grad_(), w.clone().requires_grad_()
    (xd @ wd).backward(g)
    for fn in (column_parallel_matmul, row_parallel_matmul):
        for parts in (1, 2, 3, 4):
            xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
            fn(xs, ws, parts).backward(g)
            torch.testing.assert_close(xs.grad, xd.grad, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(ws.grad, wd.grad, rtol=1e-12, atol=1e-12)


def test_nn_linear_column_split_is_a_split_of_weight_dim0():
    lin = torch.nn.Linear(12, 20, bias=False, dtype=torch.float64)
    x, _ = _data(5, 12, 20, torch.float64)
    w = lin.weight.detach().T  # [in, out]
    for parts in (2, 3, 4):
        by_rows_of_weight = torch.tensor_split(lin.weight.detach(), parts, dim=0)
        for block, wb in zip(split_columns(w, parts), by_rows_of_weight, strict=True):
            assert torch.equal(block.T, wb)
        err = (column_parallel_matmul(x, w, parts) - lin(x).detach()).abs()
        assert (err <= 2 * rounding_bound(x, w)).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_mlp_column_then_row_matches_dense(dtype):
    x, w1 = _data(5, 12, 10, dtype, seed=5)  # hidden = 10: uneven for 3 and 4 parts
    w2 = torch.randn(10, 7, generator=torch.Generator().manual_seed(6), dtype=dtype)
    h = F.gelu(ordered_matmul(x, w1))
    dense = ordered_matmul(h, w2)
    for parts in (1, 2, 3, 4):
        # Column split + elementwise gelu leaves H bit-exact, so only the final sum reorders.
        y = mlp_column_then_row(x, w1, w2, parts, act=F.gelu, matmul=ordered_matmul)
        err = (y - dense).abs()
        assert (err <= 2 * rounding_bound(h, w2)).all(), f"parts={parts}: {err.max():.3e}"
    with pytest.raises(ValueError, match="w2 must be"):
        mlp_column_then_row(x, w1, w2.T, 2)


def test_act_before_sum_is_wrong_for_gelu_and_right_only_for_linear():
    x, w = _data(5, 12, 20, torch.float64, seed=7)
    right = F.gelu(x @ w)
    assert torch.equal(act_before_sum_wrong(x, w, 1), right)  # one part: nothing to sum
    for parts in (2, 3, 4):
        wrong = act_before_sum_wrong(x, w, parts, act=F.gelu)
        assert (wrong - right).abs().max() > 0.1, parts  # O(1) error, not rounding
        linear = act_before_sum_wrong(x, w, parts, act=lambda t: 3 * t)
        assert ((linear - 3 * (x @ w)).abs() <= 6 * rounding_bound(x, w) + 1e-12).all()


def test_bad_shapes_name_the_problem():
    x, w = _data(5, 12, 20, torch.float32)
    with pytest.raises(ValueError, match=r"12 features but w has 20 rows.*weight\.T"):
        column_parallel_matmul(x, w.T, 2)
    with pytest.raises(ValueError, match=r"12 rows into 13 parts"):
        row_parallel_matmul(x, w, 13)


def test_draw_split_colours_one_block_per_rank():
    for kind in ("column", "row"):
        for parts in (2, 4):
            fig = draw_split(kind, parts)
            n = sum(isinstance(p, Rectangle) for ax in fig.axes for p in ax.patches)
            # column: X replicated (1) + W and Y blocks; row: X, W blocks + full-size partials.
            assert n == (1 + 2 * parts if kind == "column" else 3 * parts), (kind, parts)
            assert len(fig.axes) == 3
            plt.close(fig)
    with pytest.raises(ValueError, match="'column' or 'row'"):
        draw_split("diagonal", 2)
