"""Reference for exercises/l11_bucketed_allreduce.py."""

from tpedu.parallel.data_parallel import (  # the reference: tpedu/parallel/data_parallel.py
    all_reduce_bucket,
    assign_buckets,
)

__all__ = ["all_reduce_bucket", "assign_buckets"]
