"""Lesson 09: `ContextParallel`, context parallelism as a model runs it, in one object.

The run options carry it (`RunOptions.context`) and each layer that meets the split sequence
asks it, so the model's wiring names it once:

    group     the CP ranks; each holds s/cp positions of every sequence
    strategy  "ring": K/V blocks sent around the CP ranks (tpedu.cp.ring); "ulysses":
              all-to-alls from sequence shards to head shards and back (tpedu.cp.ulysses)
    layout    which positions a rank holds: "zigzag" (causal work balanced) or "contiguous"

    local(t)           this rank's positions of ids or targets [b, s] -> [b, s/cp]   no comm
    positions(s/cp)    every rank's global positions [cp, s/cp] (RoPE, learned)   no comm
    attention(q, ...)  the core over the whole sequence     ring sends or all-to-alls, fwd and bwd
    mean(total, count) the loss's mean over the whole sequence   2 all-reduces (fwd only)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from tpedu.comm import collectives
from tpedu.cp.ring import LAYOUTS, chunk_positions, ring_attention, split_sequence
from tpedu.cp.ulysses import ulysses_attention

ATTENTION = {"ring": ring_attention, "ulysses": ulysses_attention}
STRATEGIES = tuple(ATTENTION)


@dataclass(frozen=True)
class ContextParallel:
    """The sequence split over `group`'s ranks; `strategy` and `layout` checked on construction
    (a ValueError names the choices)."""

    group: dist.ProcessGroup | None
    strategy: str = "ring"
    layout: str = "zigzag"

    def __post_init__(self) -> None:
        for name, value, choices in (
            ("cp_strategy", self.strategy, STRATEGIES),
            ("cp_layout", self.layout, LAYOUTS),
        ):
            if value not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {value!r}")

    @property
    def size(self) -> int:
        """The CP ranks (the sequence is split in this many pieces)."""
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's positions of ids or targets [b, s] -> [b, s/cp]."""
        return split_sequence(t, self.size, self.rank, self.layout, dim=1)

    def positions(self, s_local: int) -> torch.Tensor:
        """[cp, s_local]: every CP rank's global positions for a sequence of s_local · cp."""
        cp = self.size
        return torch.stack([chunk_positions(s_local * cp, cp, r, self.layout) for r in range(cp)])

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """q [b, nq, s, d], k, v [b, nkv, s, d] (this rank's s/cp positions; `positions` [cp, s]
        every rank's) -> [b, nq, s, d]: causal attention over the whole sequence."""
        return ATTENTION[self.strategy](q, k, v, positions, self.group)

    def mean(self, total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """The mean loss over every rank's counted tokens from this rank's `total` loss and
        `count`: the value is the global mean on every rank, the gradient flows through this
        rank's tokens only (the parameters' gradients are then summed over CP)."""
        count = collectives.all_reduce(count.clone(), self.group).clamp_min(1)
        mine = total / count
        whole = collectives.all_reduce(mine.detach().clone(), self.group)
        return mine + (whole - mine).detach()
