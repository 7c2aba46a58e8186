"""Lesson 11 exercise: the 1F1B pipeline schedule.

Run `make grade EX=l11` (or `python -m tpedu.course.grading l11`) to check your work.
"""

from __future__ import annotations


def one_f_one_b(n_micro: int, n_stages: int, stage: int) -> list[tuple[str, int]]:
    """The order in which pipeline stage `stage` (0-based, of `n_stages`) runs the forward ("F")
    and backward ("B") passes of micro-batches 0..n_micro-1 under 1F1B (PipeDream-flush).

    Warm-up: the stage first runs w = min(n_stages - 1 - stage, n_micro) forwards. Steady state:
    for each remaining micro-batch, one forward then the backward of the OLDEST micro-batch in
    flight. Cool-down: the last w backwards, oldest first.

    Example, 4 stages, 6 micro-batches, stage 1 (w = 2):
        [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("F", 4), ("B", 2),
         ("F", 5), ("B", 3), ("B", 4), ("B", 5)]
    The last stage (w = 0) alternates F0 B0 F1 B1 ...; a stage never holds more than
    n_stages - stage activations (GPipe holds n_micro).
    """
    raise NotImplementedError("l11: write the 1F1B order; hint: tpedu.grading.hint('l11', 1)")
