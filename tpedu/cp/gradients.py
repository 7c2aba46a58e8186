"""Lesson 09: context parallelism's gradient sum. Each CP rank's backward covers only its
positions of the sequence, so a parameter's gradient is the sum of the CP ranks' gradients.

    sum_over_cp(params, group)   1 all-reduce per parameter, after backward (a model alone)

In training this sum is not a step of its own: the CP ranks are folded into data parallelism's
one bucketed reduction, which sums over dp·cp during backward and divides by dp
(tpedu.parallel.mesh's dp_cp groups, tpedu.train.optim.make_data_parallel), and ZeRO shards
over dp·cp.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.distributed as dist
from torch import nn

from tpedu.comm import collectives, tracer


def sum_over_cp(params: Iterable[nn.Parameter], group: dist.ProcessGroup | None) -> None:
    """Sum every gradient over the CP `group`, in place: each CP rank's covers its positions.
    One all-reduce per parameter (phase "grad_sync")."""
    with tracer.phase("grad_sync"):
        for p in params:
            if p.grad is not None:
                collectives.all_reduce(p.grad, group)
