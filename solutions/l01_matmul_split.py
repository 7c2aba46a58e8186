"""Reference for exercises/l01_matmul_split.py."""

# the reference lives in tpedu/tp/matmul_split.py
from tpedu.tp.matmul_split import (
    column_parallel_matmul,
    row_parallel_matmul,
    split_columns,
    split_rows,
)

__all__ = ["column_parallel_matmul", "row_parallel_matmul", "split_columns", "split_rows"]
