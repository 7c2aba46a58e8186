"""Reference for exercises/l11_bucketed_allreduce.py."""

from tpedu.data_parallel import (
    allreduce_bucket,
    assign_buckets,
)  # the reference: tpedu/data_parallel.py

__all__ = ["allreduce_bucket", "assign_buckets"]
