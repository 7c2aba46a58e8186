"""Lesson 09 reference: the byte counter and the paper's formula."""

from tpedu.analysis.activation_memory import (
    saved_bytes,  # the reference lives in tpedu/analysis/activation_memory.py
)
from tpedu.analysis.memory import (
    activation_bytes_per_layer,  # the reference lives in tpedu/analysis/memory.py
)

__all__ = ["activation_bytes_per_layer", "saved_bytes"]
