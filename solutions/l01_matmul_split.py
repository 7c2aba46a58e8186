"""Reference for exercises/l01_matmul_split.py: one matmul split by columns and by rows."""

from __future__ import annotations

from collections.abc import Callable

import torch

Matmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _check_parts(n: int, parts: int, what: str) -> None:
    if isinstance(parts, bool) or not isinstance(parts, int) or not 1 <= parts <= n:
        raise ValueError(f"cannot split {n} {what} into {parts!r} parts; use 1 <= parts <= {n}")


def split_columns(w: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """W [in, out] -> `parts` blocks [in, out_r], left to right."""
    _check_parts(w.shape[1], parts, "columns")
    return list(torch.tensor_split(w, parts, dim=1))


def split_rows(w: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """W [in, out] -> `parts` blocks [in_r, out], top to bottom."""
    _check_parts(w.shape[0], parts, "rows")
    return list(torch.tensor_split(w, parts, dim=0))


def column_parallel_matmul(
    x: torch.Tensor, w: torch.Tensor, parts: int, matmul: Matmul = torch.matmul
) -> torch.Tensor:
    """Every "rank" multiplies all of x by its columns; the outputs sit side by side."""
    outputs = [matmul(x, w_r) for w_r in split_columns(w, parts)]  # [..., out_r] each
    return torch.cat(outputs, dim=-1)


def row_parallel_matmul(
    x: torch.Tensor, w: torch.Tensor, parts: int, matmul: Matmul = torch.matmul
) -> torch.Tensor:
    """Every "rank" multiplies its features of x by its rows; the partials add up."""
    w_blocks = split_rows(w, parts)
    x_blocks = torch.tensor_split(x, parts, dim=-1)  # the same cut of `in` as W's rows
    y = matmul(x_blocks[0], w_blocks[0])  # [..., out], a partial sum
    for x_r, w_r in zip(x_blocks[1:], w_blocks[1:], strict=True):
        y = y + matmul(x_r, w_r)
    return y
