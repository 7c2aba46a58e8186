"""Lesson 12 exercise: the three pieces of ZeRO.

Fill in the functions and the class, then run `make grade EX=l12_zero` (or
`python -m tpedu.course.grading l12_zero`); notebooks/12_data_parallelism.ipynb uses
them through `pick("l12_zero")`. Communicate only through `tpedu.comm.collectives` (the tests
count the calls with a CommTracer).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def reduce_scatter_mean(flat: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """ZeRO-2's gradient step: this rank's shard of the mean over `group` of a flat gradient.

    flat [numel] is this rank's whole gradient (the same numel on every rank). With N ranks in
    the group, pad it with zeros to a multiple of N, N·n elements; rank r owns elements
    [r·n, (r+1)·n). Return a new tensor [n]: the mean over the ranks of those elements (padding
    positions come out 0). Use exactly one `collectives.reduce_scatter_into`; do not modify flat.
    numel 10, N = 3: n = 4, rank 2 gets the mean of elements 8, 9 and two zeros.
    """
    raise NotImplementedError(
        "l12_zero: write ZeRO-2's gradient step; hint: tpedu.grading.hint('l12_zero', 1)"
    )


class LazyParams:
    """ZeRO-3's rhythm for one block: keep only a flat shard at rest, gather the whole
    parameters just before they are used, free them right after.

    shard [n]: this rank's slice (rank r holds elements [r·n, (r+1)·n) of the whole flat
    parameters padded to N·n); numel: the unpadded length; group: the N ranks sharing the block.

    - Nothing whole is held at rest: after construction and after free(), held_bytes() == 0.
    - gather() all-gathers the shards (one `collectives.all_gather_into`) and returns the whole
      flat parameters [numel]; calling it again while gathered communicates nothing.
    - free() gives the whole buffer's memory back, but a tensor handed out by an earlier
      gather() must show the right values again after the next gather(): autograd saves such
      views in forward and reads them in backward, after a free and a re-gather. So keep one
      buffer for the life of the object and give up (and take back) its memory, not the
      tensor itself.
    """

    def __init__(
        self, shard: torch.Tensor, numel: int, group: dist.ProcessGroup | None = None
    ) -> None:
        raise NotImplementedError(
            "l12_zero: set up the lazy buffer; hint: tpedu.grading.hint('l12_zero', 1)"
        )

    def gather(self) -> torch.Tensor:
        raise NotImplementedError(
            "l12_zero: gather the whole parameters; hint: tpedu.grading.hint('l12_zero', 1)"
        )

    def free(self) -> None:
        raise NotImplementedError(
            "l12_zero: free the whole parameters; hint: tpedu.grading.hint('l12_zero', 1)"
        )

    def held_bytes(self) -> int:
        """Bytes of whole parameters this object holds now."""
        raise NotImplementedError(
            "l12_zero: report the bytes held; hint: tpedu.grading.hint('l12_zero', 1)"
        )


def zero_bytes_per_rank(
    psi: float,
    dp: int,
    stage: int,
    weight_bytes: float = 2,
    grad_bytes: float = 2,
    optimizer_bytes: float = 12,
) -> tuple[float, float, float]:
    """The ZeRO paper's memory per rank for Ψ = psi parameters over dp ranks:
    (weight bytes, gradient bytes, optimizer-state bytes).

    Plain data parallelism (stage 0) holds 2Ψ + 2Ψ + KΨ bytes on every rank (fp16/bf16 weights
    and gradients, K = 12 bytes of fp32 master weight, momentum and variance for AdamW). Stage 1
    shards the optimizer states over the dp ranks, stage 2 the gradients as well, stage 3 the
    weights as well: each sharded part is divided by dp.
    Ψ = 7.5e9, dp = 64: stage 0 120 GB in all, stage 1 31.4, stage 2 16.6, stage 3 1.9.
    stage not in 0..3 or dp < 1 -> ValueError naming the value.
    """
    raise NotImplementedError(
        "l12_zero: write the ZeRO memory per rank; hint: tpedu.grading.hint('l12_zero', 1)"
    )
