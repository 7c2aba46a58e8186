"""Reference for exercises/l18_capstone.py."""

from __future__ import annotations

from tpedu.course.capstone import Budget, fits
from tpedu.model.config import GPTConfig
from tpedu.parallel.config import ParallelConfig


def choose(config: GPTConfig, budget: Budget) -> ParallelConfig:
    """The first layout, simplest first, whose fullest rank fits the budget (the dry run says).

    Plain layouts come first, data parallelism before pipeline before tensor parallelism (the
    cheapest communication first); then the memory savers on top of each: ZeRO-1 (AdamW's
    states over dp), sequence parallelism with selective recompute (activations over tp).
    At the capstone's budget the logits [b, s, V] and the vocabulary-sized embedding dominate,
    and tp=2 × pp=2 is the first fit: tp splits both over the vocabulary, pp halves the blocks
    and, with 4 micro-batches, the batch each stage holds at once.
    """
    n = budget.ranks
    plain = [
        ParallelConfig(tp=tp, pp=pp, dp=n // (tp * pp))
        for tp in (1, 2, 4, 8)
        for pp in (1, 2, 4, 8)
        if n % (tp * pp) == 0
    ]
    plain.sort(key=lambda p: (p.tp, p.pp))  # dp first: the least communication per step
    savers = [ParallelConfig(tp=p.tp, pp=p.pp, dp=p.dp, zero=1) for p in plain if p.dp > 1]
    savers += [
        ParallelConfig(tp=p.tp, pp=p.pp, dp=p.dp, sequence_parallel=True, recompute="selective")
        for p in plain
        if p.tp > 1
    ]
    for parallel in plain + savers:
        try:
            ok, _ = fits(config, parallel, budget)
        except ValueError:  # this model cannot run so (tp not dividing the heads, ...)
            continue
        if ok:
            return parallel
    raise ValueError(
        f"no layout tried fits {budget.bytes_per_rank:,} bytes per rank on {n} ranks; "
        "try ZeRO-3, full recompute, or a larger budget"
    )
