"""Lessons 08–19: `RunOptions`, how a TPGPT runs on its ranks, never what it computes.

One object, given to `TPGPT(dense, group, options=...)` and handed down to every block, so a
new way of running is one field here and the code that reads it, not a keyword threaded
through every constructor. `ParallelConfig.model_options(mesh)` makes the one a training run
uses; the GPTConfig (what the model is) never holds any of it.

    sequence_parallel   between the TP regions every rank keeps only its s/t positions; each
                        all-reduce becomes a reduce-scatter and each f an all-gather (lesson 08)
    recompute           "none", "selective" (the attention core) or "full" (the whole block from
                        its input) recomputed in backward (lesson 10)
    overlap_comm        f's backward all-reduce runs while dL/dW is computed (lesson 15)
    cp_group            context parallelism (lesson 09): each rank of this group feeds its chunk
    cp_strategy         of the sequence ("zigzag" or "contiguous", `cp_layout`), attention is
    cp_layout           ring or Ulysses attention over the group (None: no CP)
    ep_group            expert parallelism (lesson 19): the MoE layers' experts split over this
                        group's ranks, tokens traded with all-to-all (None: every expert here)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from tpedu.cp.ring import LAYOUTS
from tpedu.model.config import RECOMPUTE

CP_STRATEGIES = ("ring", "ulysses")


@dataclass(frozen=True)
class RunOptions:
    """How TPGPT runs; every choice checked on construction (a ValueError names the fix)."""

    sequence_parallel: bool = False
    recompute: str = "none"
    overlap_comm: bool = False
    cp_group: dist.ProcessGroup | None = None
    cp_strategy: str = "ring"
    cp_layout: str = "zigzag"
    ep_group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        for name, choices in (
            ("recompute", RECOMPUTE),
            ("cp_strategy", CP_STRATEGIES),
            ("cp_layout", LAYOUTS),
        ):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")

    @property
    def cp(self) -> int:
        """Ranks of the CP group (1: no context parallelism)."""
        return dist.get_world_size(self.cp_group) if self.cp_group is not None else 1
