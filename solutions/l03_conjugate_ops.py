"""Lesson 03 reference: the conjugate operators f and f̄."""

from tpedu.tp_ops import (  # the reference lives in tpedu/tp_ops.py
    CopyToTPRegion,
    ReduceFromTPRegion,
)

__all__ = ["CopyToTPRegion", "ReduceFromTPRegion"]
