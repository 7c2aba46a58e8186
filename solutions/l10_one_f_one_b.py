"""Reference for exercises/l10_one_f_one_b.py."""

from tpedu.parallel.pipeline.schedules import (
    one_f_one_b,  # the reference lives in tpedu/parallel/pipeline/
)

__all__ = ["one_f_one_b"]
