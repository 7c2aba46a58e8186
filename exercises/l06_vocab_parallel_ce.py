"""Exercise l06: the vocab-parallel cross-entropy forward (seed §2.4).

With the vocabulary split over tp ranks, rank r holds logits [..., Vp/tp]: columns
[r·Vp/tp, (r+1)·Vp/tp) of the vocabulary padded to Vp = the smallest multiple of tp >= V.
Columns >= V are padding and must not affect the loss. Never gather the full logits: three
all-reduces of one number per token are enough (notebook 06 derives them):

    m   = max over the vocabulary        all-reduce with op=dist.ReduceOp.MAX
    z_y = the target's logit              all-reduce (sum): the owner adds it, the others add 0
    S   = sum over the vocabulary of exp(z - m)             all-reduce (sum)
    loss = log S + m - z_y

Communicate only through tpedu.comm.collectives (so the tests' tracer sees it):
    from tpedu.comm import collectives
    collectives.all_reduce(x, group, op=dist.ReduceOp.MAX)    # in place, returns x

Fill in both functions, then run `make grade EX=l06`. Only the forward is graded (your version need
not be differentiable).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def vocab_range(vocab_size: int, tp: int, rank: int) -> tuple[int, int]:
    """Rank `rank`'s columns [start, end) of the padded vocabulary.

    Every rank gets Vp/tp columns, Vp = the smallest multiple of tp >= vocab_size.
    Examples: vocab_range(10, 4, 3) == (9, 12) (columns 10 and 11 are padding);
              vocab_range(50257, 2, 1) == (25129, 50258).
    """
    raise NotImplementedError(
        "l06: find the rank's vocabulary columns; hint: tpedu.grading.hint('l06', 1)"
    )


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor,
    target: torch.Tensor,
    vocab_size: int,
    group: dist.ProcessGroup | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Per-token cross-entropy [...] from this rank's logits [..., Vp/tp] and targets [...].

    target holds global ids in [0, vocab_size), or ignore_index (loss 0 there). The result is
    the same on every rank and equals F.cross_entropy(full_logits[..., :vocab_size], target,
    reduction="none"). Communication: at most 3 all-reduces, each of target.numel() elements.
    Stable for large logits (subtract the max before exp).
    """
    raise NotImplementedError(
        "l06: write the vocab-parallel loss; hint: tpedu.grading.hint('l06', 1)"
    )
