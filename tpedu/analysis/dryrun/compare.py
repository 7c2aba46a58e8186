"""Lesson 13: every figure of a dry run beside its prediction (the ledger's and the what-if's)."""

from __future__ import annotations

from tpedu.analysis.dryrun.figures import Comparison, RankFigures
from tpedu.analysis.dryrun.predict_memory import memory_comparisons
from tpedu.analysis.dryrun.predict_traffic import traffic_comparisons
from tpedu.model.config import GPTConfig
from tpedu.parallel.config import ParallelConfig


def compare(
    fig: RankFigures, config: GPTConfig, parallel: ParallelConfig, batch: int
) -> tuple[Comparison, ...]:
    """Every figure of `fig` beside the ledger's or the what-if's prediction, with the named
    differences (see the module docstring)."""
    return tuple(
        memory_comparisons(fig, config, parallel)
        + traffic_comparisons(fig, config, parallel, batch)
    )
