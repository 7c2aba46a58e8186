"""Lesson 03 reference: the conjugate operators f and f̄."""

from tpedu.tp.operators import (  # the reference lives in tpedu/tp/operators.py
    CopyToTPRegion,
    ReduceFromTPRegion,
)

__all__ = ["CopyToTPRegion", "ReduceFromTPRegion"]
