"""Lesson 18 exercise: choose the capstone's layout, one that fits the budget.

Fill in `choose`, then run `make grade` (or
`python -m tpedu.course.grading exercises l18_capstone`);
notebooks/18_capstone.ipynb trains the layout it returns through `pick("l18_capstone")`,
checkpoints, reshards and serves it, and grades the files that run leaves behind.
"""

from __future__ import annotations

from tpedu.course.capstone import Budget
from tpedu.model.config import GPTConfig
from tpedu.parallel.config import ParallelConfig


def choose(config: GPTConfig, budget: Budget) -> ParallelConfig:
    """A ParallelConfig that trains `config` on exactly `budget.ranks` ranks with no rank
    holding more than `budget.bytes_per_rank` during one training step of `budget.batch`
    sequences: weights, gradients, AdamW states, saved activations, and the parameters ZeRO-3
    gathers.

    Do not guess: measure. `tpedu.course.capstone.fits(config, parallel, budget)` runs the dry
    run of lesson 13 on every rank and says whether the fullest one fits (and its bytes); a
    layout that cannot run the model at all raises a ValueError. Any fitting layout passes.
    Look at which term dominates before adding features: splitting what is largest helps most.
    No fitting layout among the ones you tried -> ValueError saying so.
    """
    raise NotImplementedError(
        "l18: find a layout whose fullest rank fits the budget; hint: tpedu.grading.hint('l18', 1)"
    )
