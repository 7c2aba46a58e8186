"""Reference for exercises/l07_tp_block.py."""

from tpedu.model.gpt import TPBlock  # the reference lives in tpedu/model/gpt.py

__all__ = ["TPBlock"]
