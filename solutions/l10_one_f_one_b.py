"""Reference for exercises/l10_one_f_one_b.py."""

# the reference lives in tpedu/parallel/pipeline/schedules.py
from tpedu.parallel.pipeline.schedules import one_f_one_b

__all__ = ["one_f_one_b"]
