"""Lesson 08 reference: the sequence-parallel operators."""

from tpedu.tp.sequence_parallel import (  # the reference lives in tpedu/tp/sequence_parallel.py
    allreduce_sequence_parallel_grads,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)

__all__ = [
    "allreduce_sequence_parallel_grads",
    "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
]
