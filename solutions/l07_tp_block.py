"""Reference for exercises/l07_tp_block.py."""

from tpedu.model import TPBlock  # the reference lives in tpedu/model.py

__all__ = ["TPBlock"]
