"""Lesson 09 reference: the byte counter and the paper's formula."""

from tpedu.activation_memory import saved_bytes  # the reference lives in tpedu/activation_memory.py
from tpedu.memory import activation_bytes_per_layer  # the reference lives in tpedu/memory.py

__all__ = ["activation_bytes_per_layer", "saved_bytes"]
