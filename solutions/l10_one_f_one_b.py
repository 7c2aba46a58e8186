"""Reference for exercises/l10_one_f_one_b.py."""

from tpedu.pipeline import one_f_one_b  # the reference lives in tpedu/pipeline.py

__all__ = ["one_f_one_b"]
