"""Reference for exercises/l12_zero.py (tpedu/parallel/zero.py's FlatBuffer does the same
inside ShardedDataParallel, for many parameters per buffer and asynchronously)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tpedu.comm import collectives


def reduce_scatter_mean(flat: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """This rank's shard [ceil(numel / N)] of the mean over `group` of the flat gradient; one
    reduce-scatter."""
    size = dist.get_world_size(group)
    n = -(-flat.numel() // size)
    padded = torch.nn.functional.pad(flat, (0, n * size - flat.numel()))  # a new tensor
    out = flat.new_empty(n)
    collectives.reduce_scatter_into(out, padded, group)
    return out / size  # the collective sums; the mean is ours to take


class LazyParams:
    """A block's whole flat parameters, gathered before use and freed after; one buffer for
    the object's life, so views handed out by gather() stay valid across free()/gather()."""

    def __init__(
        self, shard: torch.Tensor, numel: int, group: dist.ProcessGroup | None = None
    ) -> None:
        self.shard, self.numel, self.group = shard, numel, group
        self.full = shard.new_empty(shard.numel() * dist.get_world_size(group))
        self.nbytes = self.full.untyped_storage().nbytes()
        self.full.untyped_storage().resize_(0)  # at rest only the shard exists
        self.gathered = False

    def gather(self) -> torch.Tensor:
        if not self.gathered:
            self.full.untyped_storage().resize_(self.nbytes)
            collectives.all_gather_into(self.full, self.shard, self.group)
            self.gathered = True
        return self.full[: self.numel]

    def free(self) -> None:
        self.full.untyped_storage().resize_(0)  # the memory goes, the tensor (and its views) stay
        self.gathered = False

    def held_bytes(self) -> int:
        return self.full.untyped_storage().nbytes()


def zero_bytes_per_rank(
    psi: float,
    dp: int,
    stage: int,
    weight_bytes: float = 2,
    grad_bytes: float = 2,
    optimizer_bytes: float = 12,
) -> tuple[float, float, float]:
    """(weights, gradients, optimizer states) in bytes per rank under ZeRO `stage`."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    if dp < 1:
        raise ValueError(f"dp must be at least 1, got {dp}")
    weights = psi * weight_bytes / (dp if stage >= 3 else 1)
    grads = psi * grad_bytes / (dp if stage >= 2 else 1)
    optimizer = psi * optimizer_bytes / (dp if stage >= 1 else 1)
    return weights, grads, optimizer
