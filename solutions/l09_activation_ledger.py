"""Lesson 09 reference: the byte counter and the paper's formula."""

# the references live in tpedu/analysis/activation_memory.py and tpedu/analysis/memory.py
from tpedu.analysis.activation_memory import saved_bytes
from tpedu.analysis.memory import activation_bytes_per_layer

__all__ = ["activation_bytes_per_layer", "saved_bytes"]
