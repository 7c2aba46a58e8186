"""Lesson 04: cut a dense tensor into per-rank shards and glue the shards back together.

Every tensor-parallel layer in tpedu is built FROM a dense weight: `shard` keeps this rank's
contiguous chunk, so TP=N starts identical to the dense layer, and `unshard` (an all-gather)
gives the dense tensor back for tests and checkpoints.

    w_local = shard(w, dim=0, group)     # [out, in] -> [out/t, in] on rank r: rows [r·out/t, (r+1)·out/t)
    w_full  = unshard(w_local, 0, group) # [out/t, in] -> [out, in] (1 all-gather)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tpedu.comm import collectives


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending: every tp size that splits n evenly (12 -> 1, 2, 3, 4, 6, 12)."""
    return [d for d in range(1, n + 1) if n % d == 0]


def check_divisible(n: int, t: int, what: str) -> None:
    """Raise a ValueError naming `what`, the numbers and the valid tp values unless t divides n."""
    if t < 1 or n % t != 0:
        valid = ", ".join(str(d) for d in divisors(n))
        raise ValueError(f"{what} = {n} is not divisible by tp={t}; valid tp values: {valid}")


def rank_chunk(
    x: torch.Tensor, dim: int, rank: int, tp: int, what: str | None = None
) -> torch.Tensor:
    """Chunk `rank` of `tp` equal, contiguous chunks of x along `dim`: a view, no copy.

    Shapes: [..., n, ...] -> [..., n/tp, ...], indices [rank·n/tp, (rank+1)·n/tp). Raises
    (check_divisible, naming `what`, by default the dim and shape) unless tp divides n.
    """
    dim = dim % x.dim()
    n = x.shape[dim]
    check_divisible(n, tp, what or f"size of dim {dim} of a {tuple(x.shape)} tensor")
    if not 0 <= rank < tp:
        raise ValueError(f"rank must be in [0, tp={tp}), got {rank}")
    return x.narrow(dim, rank * (n // tp), n // tp)


def shard(tensor: torch.Tensor, dim: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """This rank's contiguous chunk of `tensor` along `dim` (a detached, contiguous clone).

    Shapes: [..., n, ...] -> [..., n/t, ...]; rank r keeps indices [r·n/t, (r+1)·n/t).
    No communication (every rank already holds the dense tensor).
    """
    t, r = dist.get_world_size(group), dist.get_rank(group)
    return rank_chunk(tensor.detach(), dim, r, t).clone().contiguous()


def unshard(local: torch.Tensor, dim: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The full tensor from every rank's chunk: [..., n/t, ...] -> [..., n, ...] (1 all-gather)."""
    return collectives.all_gather(local.detach().contiguous(), group, dim=dim % local.dim())
