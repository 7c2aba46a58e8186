"""Lesson 08 reference: the sequence-parallel operators."""

from tpedu.tp.sequence_parallel import (  # the reference lives in tpedu/tp/sequence_parallel.py
    all_reduce_sequence_parallel_grads,
    gather_from_sp_region,
    reduce_scatter_to_sp_region,
    scatter_to_sp_region,
)

__all__ = [
    "all_reduce_sequence_parallel_grads",
    "gather_from_sp_region",
    "reduce_scatter_to_sp_region",
    "scatter_to_sp_region",
]
