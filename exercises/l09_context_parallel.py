"""Lesson 09 exercise: the three pieces of ring attention.

Fill in the functions, then run `make grade EX=l09` (or
`python -m tpedu.course.grading l09`);
notebooks/09_context_parallelism.ipynb uses them through `pick("l09_context_parallel")`.
All three work on one process: no ranks, no communication.
"""

from __future__ import annotations

import torch


def merge_partials(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over two disjoint sets of keys into attention over their union.

    out_a [..., s, d] is softmax attention of the queries over key set A alone (normalised over
    A), lse_a [..., s] the log of that softmax's denominator, log Σ_{j∈A} e^{score_j}; the same
    for B. Return (out, lse) for A ∪ B, the same shapes.

    The union's denominator is the sum of the two; each part's output then counts in proportion
    to its share of that denominator. Work with logs throughout (e^lse overflows for large
    scores). A query row that sees no key in a part has lse = −inf there: that part must weigh
    exactly 0, and a row with −inf in both parts must come out as 0 with lse −inf (no NaN).
    """
    raise NotImplementedError(
        "l09: merge two partial attentions; hint: tpedu.grading.hint('l09', 1)"
    )


def zigzag_positions(s: int, cp: int, rank: int) -> torch.Tensor:
    """The global positions [s/cp] (int64, increasing) that rank `rank` of `cp` holds under the
    zig-zag split.

    Cut the sequence into 2·cp equal chunks; rank r takes one chunk from the front and the
    mirror-image chunk from the back, so that every rank gets the same amount of causal work
    (an early chunk sees few keys, a late one many). cp = 2, s = 8: rank 0 -> [0, 1, 6, 7],
    rank 1 -> [2, 3, 4, 5].
    s not divisible by 2·cp -> ValueError naming s and 2·cp.
    """
    raise NotImplementedError(
        "l09: write the zig-zag positions; hint: tpedu.grading.hint('l09', 1)"
    )


def ring_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One ring step: this rank's queries against one visiting K/V block, causally masked.

    q [b, h, sq, d]; k, v [b, h, sk, d]; q_positions [sq] and k_positions [sk] are the global
    positions of the rows. A query may see a key whose position is ≤ its own. Scores are scaled
    by 1/√d. Return (out [b, h, sq, d], lse [b, h, sq]): the softmax attention over the visible
    keys of this block only (normalised over them), and the log of its denominator, ready for
    merge_partials. A query that sees no key of this block gets out = 0 and lse = −inf (no NaN).
    """
    raise NotImplementedError("l09: write one ring step; hint: tpedu.grading.hint('l09', 1)")
