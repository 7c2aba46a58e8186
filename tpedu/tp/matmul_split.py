"""Lesson 01: column and row splits of one matmul Y = X·W, on one process ("ranks": list entries).

Convention (the seed's): X is [batch, in], W is [in, out], Y = X·W is [batch, out].
torch.nn.Linear stores its weight as [out, in] and computes X·weightᵀ, so W = weight.T: a column
split of W is a split of nn.Linear.weight along dim 0, a row split is a split along dim 1.

    列并行 column parallel: W = [W_0 | W_1 | ...] by output columns. Every rank has all of X and
        computes Y_r = X·W_r, [batch, out_r]; Y = concat(Y_0, Y_1, ...) along features.
    行并行 row parallel: W = [W_0; W_1; ...] by input rows, and X = [X_0 | X_1 | ...] by the same
        features. Rank r computes a full-size partial Y_r = X_r·W_r, [batch, out];
        Y = Y_0 + Y_1 + ... (on real ranks this sum is one all-reduce).

Parts may be uneven, with the sizes of torch.tensor_split (the first n % parts parts get one
extra): one split of a matmul works for any size. The TP layers of later lessons require
divisibility instead, because every rank there must hold a same-shaped shard.

Exactness. A column split adds no arithmetic: each Y element is the same dot product over the same
`in` terms. A row split adds a sum across parts, so it changes the order of the additions. With
`ordered_matmul` (fixed left-to-right order in every element) the column split is bit-exact and
the row split is not. With torch.matmul even the column split may differ in the last bit, because
a BLAS kernel picks its blocking from the matrix shape; both stay inside `rounding_bound`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from matplotlib.figure import Figure

Matmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Act = Callable[[torch.Tensor], torch.Tensor]


def split_sizes(n: int, parts: int, what: str = "columns") -> list[int]:
    """Sizes of `parts` contiguous blocks of n items, as torch.tensor_split makes them."""
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ValueError(f"parts must be a positive int, got {parts!r}")
    if parts > n:
        raise ValueError(
            f"cannot split {n} {what} into {parts} parts: every part needs at least one; "
            f"use parts <= {n}"
        )
    return [n // parts + (1 if r < n % parts else 0) for r in range(parts)]


def _check_weight(w: torch.Tensor) -> None:
    if w.dim() != 2:
        raise ValueError(f"w must be a 2-D [in, out] matrix, got shape {tuple(w.shape)}")


def _check_pair(x: torch.Tensor, w: torch.Tensor) -> None:
    _check_weight(w)
    if x.dim() < 1 or x.shape[-1] != w.shape[0]:
        raise ValueError(
            f"x of shape {tuple(x.shape)} has {x.shape[-1] if x.dim() else 0} features "
            f"but w has {w.shape[0]} rows: "
            f"X·W needs x.shape[-1] == w.shape[0] (w is [in, out]; for an nn.Linear pass "
            f"weight.T)"
        )


def split_columns(w: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """W [in, out] -> `parts` blocks [in, out_r] (views), left to right; sum(out_r) == out."""
    _check_weight(w)
    split_sizes(w.shape[1], parts, "columns")
    return list(torch.tensor_split(w, parts, dim=1))


def split_rows(w: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """W [in, out] -> `parts` blocks [in_r, out] (views), top to bottom; sum(in_r) == in."""
    _check_weight(w)
    split_sizes(w.shape[0], parts, "rows")
    return list(torch.tensor_split(w, parts, dim=0))


def ordered_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """X [..., in] · W [in, out] -> [..., out], each element summed strictly for k = 0, 1, ...

    Separate elementwise multiplies and adds (IEEE, no fused multiply-add), so an element's bits
    depend only on its own row of X and column of W, never on the matrix shape. Slow (a Python
    loop over `in`): for exactness experiments only.
    """
    _check_pair(x, w)
    y = x[..., 0:1] * w[0:1, :]
    for k in range(1, w.shape[0]):
        y = y + x[..., k : k + 1] * w[k : k + 1, :]
    return y


def column_parallel_matmul(
    x: torch.Tensor, w: torch.Tensor, parts: int, matmul: Matmul = torch.matmul
) -> torch.Tensor:
    """列并行: Y = concat_r(X·W_r) along the last dim. x [..., in], w [in, out] -> [..., out].

    Rank r holds all of X and the columns W_r [in, out_r]; its output Y_r is [..., out_r].
    Joining them is a concatenation (an all-gather on real ranks): no arithmetic.
    """
    _check_pair(x, w)
    return torch.cat([matmul(x, w_r) for w_r in split_columns(w, parts)], dim=-1)


def row_parallel_matmul(
    x: torch.Tensor, w: torch.Tensor, parts: int, matmul: Matmul = torch.matmul
) -> torch.Tensor:
    """行并行: Y = sum_r X_r·W_r. x [..., in], w [in, out] -> [..., out].

    Rank r holds the features X_r [..., in_r] and the rows W_r [in_r, out] (the same split of
    `in`); its partial Y_r is full size [..., out]. Joining them is a sum (an all-reduce on real
    ranks), here in rank order 0, 1, ...
    """
    _check_pair(x, w)
    ws = split_rows(w, parts)
    xs = torch.tensor_split(x, parts, dim=-1)  # the same split of `in` as the rows of W
    partials = [matmul(x_r, w_r) for x_r, w_r in zip(xs, ws, strict=True)]
    y = partials[0]
    for p in partials[1:]:
        y = y + p
    return y


def mlp_column_then_row(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    parts: int,
    act: Act = F.gelu,
    matmul: Matmul = torch.matmul,
) -> torch.Tensor:
    """act(X·W1)·W2 with W1 split by columns and W2 by rows (the Megatron MLP).

    x [..., d], w1 [d, h], w2 [h, d_out] -> [..., d_out]. Rank r computes
    H_r = act(X·W1_r) [..., h_r] from its own columns: act is elementwise, so it needs nothing
    from other ranks. H_r is exactly the feature slice that W2's rows W2_r [h_r, d_out] expect,
    so Y_r = H_r·W2_r follows with no communication, and a single sum (one all-reduce) ends it.
    """
    _check_pair(x, w1)
    _check_weight(w2)
    if w1.shape[1] != w2.shape[0]:
        raise ValueError(
            f"w1 [{w1.shape[0]}, {w1.shape[1]}] makes {w1.shape[1]} hidden features but w2 has "
            f"{w2.shape[0]} rows: w2 must be [{w1.shape[1]}, d_out]"
        )
    partials = []
    for w1_r, w2_r in zip(split_columns(w1, parts), split_rows(w2, parts), strict=True):
        h_r = act(matmul(x, w1_r))
        partials.append(matmul(h_r, w2_r))
    y = partials[0]
    for p in partials[1:]:
        y = y + p
    return y


def act_before_sum_wrong(
    x: torch.Tensor, w: torch.Tensor, parts: int, act: Act = F.gelu, matmul: Matmul = torch.matmul
) -> torch.Tensor:
    """Deliberately WRONG: sum_r act(X_r·W_r) instead of act(sum_r X_r·W_r). x [..., in] -> [..., out].

    What you get if a row-parallel layer applied its activation before the sum: act(a + b) is not
    act(a) + act(b) unless act is linear, so a row split must be summed before any nonlinearity.
    """
    _check_pair(x, w)
    ws = split_rows(w, parts)
    xs = torch.tensor_split(x, parts, dim=-1)
    y = None
    for x_r, w_r in zip(xs, ws, strict=True):
        h = act(matmul(x_r, w_r))
        y = h if y is None else y + h
    return y


def rounding_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Elementwise bound on |computed X·W - exact X·W| for ANY order of the sums, [..., out].

    The classic dot-product bound: gamma_n * (|X|·|W|), gamma_n = n·u / (1 - n·u), n = in,
    u = eps/2 (Higham, Accuracy and Stability of Numerical Algorithms, §3.1). A row split is one
    more order (each element still sees at most n roundings), so two results, split or not,
    differ by at most twice this. The extra (1 + gamma_n) covers rounding in |X|·|W| itself.
    """
    _check_pair(x, w)
    n = w.shape[0]
    u = torch.finfo(w.dtype).eps / 2
    gamma = n * u / (1 - n * u)
    return gamma * (1 + gamma) * (x.abs() @ w.abs())


_RANK_COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")


def draw_split(kind: str, parts: int, shape: tuple[int, int, int] = (4, 8, 12)) -> Figure:
    """A matplotlib figure: which rank owns which block of X, W and Y for `kind` in
    {"column", "row"}. shape = (batch, in, out), used for the proportions and the labels.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    if kind not in ("column", "row"):
        raise ValueError(f"kind must be 'column' or 'row', got {kind!r}")
    if parts > len(_RANK_COLOURS):
        raise ValueError(f"draw_split colours up to {len(_RANK_COLOURS)} parts, got {parts}")
    batch, n_in, n_out = shape
    split_sizes(n_out if kind == "column" else n_in, parts)
    colour = _RANK_COLOURS
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2), width_ratios=[n_in, n_out, n_out])

    def blocks(ax, width, height, sizes, along, label):  # one coloured block per rank
        start = 0
        for r, size in enumerate(sizes):
            if along == "x":
                xy, wh = (start, 0), (size, height)
            else:
                xy, wh = (0, height - start - size), (width, size)
            ax.add_patch(Rectangle(xy, *wh, facecolor=colour[r], edgecolor="black", alpha=0.8))
            cx, cy = xy[0] + wh[0] / 2, xy[1] + wh[1] / 2
            ax.text(cx, cy, f"{label}{r}", ha="center", va="center", fontsize=9)
            start += size

    def frame(ax, width, height, title):
        ax.set_xlim(-0.5, width + 0.5)
        ax.set_ylim(-0.5, height + 0.5)
        ax.set_aspect("equal")
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_title(title, fontsize=10)

    ax_x, ax_w, ax_y = axes
    if kind == "column":
        ax_x.add_patch(Rectangle((0, 0), n_in, batch, facecolor="lightgrey", edgecolor="black"))
        ax_x.text(n_in / 2, batch / 2, "every rank: all of X", ha="center", va="center")
        frame(ax_x, n_in, batch, f"X [{batch}, {n_in}] (replicated)")
        blocks(ax_w, n_out, n_in, split_sizes(n_out, parts), "x", "W")
        frame(ax_w, n_out, n_in, f"W [{n_in}, {n_out}] split by columns")
        blocks(ax_y, n_out, batch, split_sizes(n_out, parts), "x", "Y")
        frame(ax_y, n_out, batch, f"Y [{batch}, {n_out}] = concat(Y0..Y{parts - 1})")
    else:
        blocks(ax_x, n_in, batch, split_sizes(n_in, parts), "x", "X")
        frame(ax_x, n_in, batch, f"X [{batch}, {n_in}] split by features")
        blocks(ax_w, n_out, n_in, split_sizes(n_in, parts), "y", "W")
        frame(ax_w, n_out, n_in, f"W [{n_in}, {n_out}] split by rows")
        step = 0.25
        for r in reversed(range(parts)):  # full-size partials, stacked like cards
            off = r * step
            ax_y.add_patch(
                Rectangle((off, -off), n_out, batch, facecolor=colour[r], edgecolor="black")
            )
        ax_y.text(
            n_out / 2, batch / 2, "Y = Y0 + ... + Y" + str(parts - 1), ha="center", va="center"
        )
        ax_y.set_xlim(-0.5, n_out + parts * step + 0.5)
        ax_y.set_ylim(-parts * step - 0.5, batch + 0.5)
        ax_y.set_aspect("equal")
        ax_y.set_xticks([])
        ax_y.set_yticks([])
        ax_y.set_title(f"Y [{batch}, {n_out}]: {parts} full-size partial sums", fontsize=10)
    name = "column parallel" if kind == "column" else "row parallel"
    fig.suptitle(f"{name}, {parts} ranks (colour = owning rank)")
    fig.tight_layout()
    return fig
