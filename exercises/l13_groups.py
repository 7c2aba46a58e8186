"""Lesson 13 exercise: the process groups of a 3D (tp, pp, dp) layout.

Run `make grade EX=l13` (or `python -m tpedu.course.grading l13`) to check your work.
"""

from __future__ import annotations


def rank_groups(tp: int, pp: int, dp: int) -> dict[str, list[list[int]]]:
    """Every group of a tp·pp·dp layout, as lists of global ranks, TP varying fastest:

        rank = tp_rank + tp · (pp_rank + pp · dp_rank)

    Return {"tp": ..., "pp": ..., "dp": ..., "emb": ...} where
      tp:  ranks that differ only in tp_rank, ordered by tp_rank; groups ordered by
           (dp_rank, pp_rank)
      pp:  ranks that differ only in pp_rank (stage 0 first); groups ordered by (dp_rank, tp_rank)
      dp:  ranks that differ only in dp_rank; groups ordered by (pp_rank, tp_rank)
      emb: [first stage, last stage] of every pp group, same order; [] when pp == 1
    Example tp=2, pp=2, dp=1: tp [[0, 1], [2, 3]], pp [[0, 2], [1, 3]], dp [[0], [1], [2], [3]],
    emb [[0, 2], [1, 3]].
    """
    raise NotImplementedError(
        "l13: list the groups of the layout; hint: tpedu.grading.hint('l13', 1)"
    )
