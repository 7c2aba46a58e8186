"""Exercise l01: split one matmul Y = X·W by columns (列并行) and by rows (行并行).

W is [in, out] (for an nn.Linear, W = weight.T). "Ranks" are list entries: no processes yet.
Fill in each body, then run `make grade EX=l01`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Matmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def split_columns(w: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """Split W [in, out] into `parts` column blocks [in, out_r], left to right.

    Sizes as torch.tensor_split makes them: the first out % parts blocks get one extra column
    (out=20, parts=3 -> 7, 7, 6). Raise ValueError if parts < 1 or parts > out (a block would be
    empty), saying which values are valid.
    """
    raise NotImplementedError("l01: split W into column blocks; hint: tpedu.grading.hint('l01', 1)")


def split_rows(w: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """Split W [in, out] into `parts` row blocks [in_r, out], top to bottom.

    Same size rule and the same ValueError as split_columns, along `in` instead of `out`.
    """
    raise NotImplementedError("l01: split W into row blocks; hint: tpedu.grading.hint('l01', 1)")


def column_parallel_matmul(
    x: torch.Tensor, w: torch.Tensor, parts: int, matmul: Matmul = torch.matmul
) -> torch.Tensor:
    """列并行: x [..., in], w [in, out] -> Y [..., out].

    Rank r holds all of X and the column block W_r = split_columns(w, parts)[r], [in, out_r];
    it computes Y_r = matmul(x, W_r), [..., out_r]. Join the Y_r in rank order along the last dim.
    Use `matmul` for every local product (the tests pass their own).
    """
    raise NotImplementedError(
        "l01: write the column-parallel matmul; hint: tpedu.grading.hint('l01', 1)"
    )


def row_parallel_matmul(
    x: torch.Tensor, w: torch.Tensor, parts: int, matmul: Matmul = torch.matmul
) -> torch.Tensor:
    """行并行: x [..., in], w [in, out] -> Y [..., out].

    Rank r holds the row block W_r = split_rows(w, parts)[r], [in_r, out], and the matching
    features of X, X_r = x[..., rows of block r], [..., in_r]; it computes the full-size partial
    Y_r = matmul(X_r, W_r), [..., out]. Y is the SUM of the partials (not a concatenation).
    Use `matmul` for every local product (the tests pass their own).
    """
    raise NotImplementedError(
        "l01: write the row-parallel matmul; hint: tpedu.grading.hint('l01', 1)"
    )
