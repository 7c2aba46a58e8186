"""Lesson 20 exercise: survey the layouts a budget allows, then choose one and say why.

Fill in `survey` and `choose`, then run `make grade EX=l20` (or
`python -m tpedu.course.grading l20`);
notebooks/20_capstone.ipynb calls both through `pick("l20_capstone")`, continues the pretrained
model under the layout `choose` returns, checkpoints, reshards and serves it, and grades the
files that run leaves behind (the reason included).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tpedu.course.capstone import Budget, Candidate
from tpedu.model.config import GPTConfig
from tpedu.parallel.config import ParallelConfig


def survey(config: GPTConfig, budget: Budget) -> list[Candidate]:
    """Every layout of this space, each measured by `tpedu.course.capstone.measure(config,
    parallel, budget)` (the dry run of lesson 13 on every rank: bytes held by the fullest rank,
    bytes the busiest puts on the wire):

    - tp and pp powers of two with tp · pp dividing `budget.ranks`, and dp the rest
      (tp · pp · dp = budget.ranks);
    - with dp > 1, each ZeRO stage 0, 1, 2, 3; with tp > 1, sequence parallelism off and on.

    A layout this model cannot run (tp not dividing the heads, more stages than layers) makes
    `measure` raise a ValueError: leave it out. Return them all, those over the budget too
    (`Candidate.fits(budget)` says which are within it), in any order: no ranking, that is
    `choose`'s job.
    """
    raise NotImplementedError(
        "l20: enumerate the layouts of the space and measure each; hint: tpedu.grading.hint('l20', 1)"
    )


def choose(
    found: Sequence[Candidate], seconds: Mapping[str, float], budget: Budget
) -> tuple[ParallelConfig, str]:
    """Your decision: one layout of `found` within `budget`, and why.

    `seconds` maps `describe(layout)` to its measured step (`step_seconds`, on this machine's
    CPU ranks) for the layouts within the budget. Several fit; they trade memory headroom
    against bytes on the wire and step time, and any of them passes if the reason holds up. The
    reason is a sentence or two for a colleague: it names the layout first (tp, pp, dp as
    `describe` writes them, the ZeRO stage and sequence parallelism if on), then the figures
    you weighed, with their units (MB held, MB on the wire, ms per step), then the layouts you
    compared it with. The grader checks the figures against its own dry run: at least one of
    those you cite before naming another layout must be within 5 % of the choice's MB held or
    MB on the wire, and most of them must be its figures, the budget's, or the headroom.

    Nothing within the budget -> ValueError saying so.
    """
    raise NotImplementedError(
        "l20: pick one of the layouts within the budget and write down why; hint: tpedu.grading.hint('l20', 1)"
    )
