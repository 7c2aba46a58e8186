"""Lesson 04 reference: column- and row-parallel linear forward, given the shards."""

from tpedu.tp.layers import (  # the reference lives in tpedu/tp/layers.py
    column_parallel_linear,
    row_parallel_linear,
)

__all__ = ["column_parallel_linear", "row_parallel_linear"]
