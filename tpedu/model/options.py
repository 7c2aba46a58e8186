"""Lessons 08–20: `RunOptions`, how a TPGPT runs on its ranks, never what it computes.

One object, given to `TPGPT(dense, group, options=...)` and handed down to every block, so a
new way of running is one field here and the code that reads it, not a keyword threaded
through every constructor. `ParallelConfig.model_options(mesh)` makes the one a training run
uses; the GPTConfig (what the model is) never holds any of it.

    sequence_parallel   between the TP regions every rank keeps only its s/t positions; each
                        all-reduce becomes a reduce-scatter and each f an all-gather (lesson 08)
    recompute           "none", "selective" (the attention core) or "full" (the whole block from
                        its input) recomputed in backward (lesson 10)
    overlap_comm        f's backward all-reduce runs while dL/dW is computed (lesson 15)
    context             context parallelism (lesson 09), a tpedu.cp.context.ContextParallel: each
                        rank of its group feeds its positions of the sequence, attention is
                        ring or Ulysses attention over the group (None: no CP)
    ep_group            expert parallelism (lesson 18): the MoE layers' experts split over this
                        group's ranks, tokens traded with all-to-all (None: every expert here)
    tp_overlap          hide TP's communication (lesson 19): "none"; "chunks", each block run
    tp_chunks           as tp_chunks batch chunks, one's all-reduce on the wire while the next
                        computes (tpedu.tp.chunked); "ring", sequence parallelism's all-gather
                        and reduce-scatter as ring steps under the matmuls
                        (tpedu.tp.collective_matmul)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from tpedu.cp.context import ContextParallel
from tpedu.model.config import RECOMPUTE

TP_OVERLAPS = ("none", "chunks", "ring")


@dataclass(frozen=True)
class RunOptions:
    """How TPGPT runs; every choice checked on construction (a ValueError names the fix)."""

    sequence_parallel: bool = False
    recompute: str = "none"
    overlap_comm: bool = False
    context: ContextParallel | None = None
    ep_group: dist.ProcessGroup | None = None
    tp_overlap: str = "none"
    tp_chunks: int = 2

    def __post_init__(self) -> None:
        for name, choices in (
            ("recompute", RECOMPUTE),
            ("tp_overlap", TP_OVERLAPS),
        ):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")
        check_tp_overlap(self.tp_overlap, self.tp_chunks, self.sequence_parallel)


def check_tp_overlap(overlap: str, chunks: int, sequence_parallel: bool) -> None:
    """Raise a ValueError (naming the fix) for a tp_overlap that cannot run so."""
    if chunks < 1:
        raise ValueError(f"tp_chunks must be at least 1, got {chunks}")
    if overlap == "ring" and not sequence_parallel:
        raise ValueError(
            "tp_overlap 'ring' decomposes sequence parallelism's all-gather and reduce-scatter; "
            "turn sequence parallelism on (--sequence-parallel) or use tp_overlap 'chunks'"
        )
    if overlap == "chunks" and sequence_parallel:
        raise ValueError(
            "tp_overlap 'chunks' splits the all-reduces of plain TP; with sequence parallelism "
            "use tp_overlap 'ring' (or drop --sequence-parallel)"
        )
