"""Lesson 15 exercise: price a step's communication with the α-β model, and fit α and β.

Run `make grade EX=l15` (or `python -m tpedu.course.grading l15`) to check;
notebooks/15_performance.ipynb uses these functions through `pick("l15_alpha_beta")` to fit α
and β on this machine, predict one tensor-parallel step's communication, then measure it.
No ranks and no communication here: plain arithmetic on numbers.

The model (lesson 02): one message of n bytes takes α + n·β seconds, α the latency, β the
seconds per byte. A ring collective on N ranks is a sequence of such messages, every rank
sending one to its neighbour at each step, all at the same time.
"""

from __future__ import annotations

from collections.abc import Sequence

from tpedu.comm.tracer import CommRecord


def ring_all_reduce_seconds(nbytes: float, ranks: int, alpha: float, beta: float) -> float:
    """Predicted seconds of a ring all-reduce of a tensor of `nbytes` bytes over `ranks` ranks.

    The ring cuts the tensor into `ranks` equal chunks and runs a reduce-scatter then an
    all-gather: 2(N − 1) steps, each a message of one chunk. One rank needs no communication
    (0 seconds). ranks < 1 or a negative nbytes -> ValueError naming the bad value.
    """
    raise NotImplementedError(
        "l15: price the steps of a ring all-reduce; hint: tpedu.grading.hint('l15', 1)"
    )


def step_comm_seconds(records: Sequence[CommRecord], alpha: float, beta: float) -> float:
    """Predicted communication seconds of the collectives in `records`, one after the other.

    `records` are a `CommTracer`'s records of one rank: each has `op`, `group_size` (N) and
    `bytes` (n: the all-reduced tensor, the all-gather's gathered output, the reduce-scatter's
    full input, the message of a send or recv). Price each with the ring algorithm:
    all_reduce as above; all_gather and reduce_scatter are each one half of it (N − 1 steps of
    n/N bytes); a send is one message of n bytes; a recv is one step whose bytes the sender
    has already paid for (the model counts the bytes each rank sends), so only its latency.
    A group of one rank costs nothing. Any other op -> ValueError naming it and the ops above.
    """
    raise NotImplementedError(
        "l15: add up the price of every traced collective; hint: tpedu.grading.hint('l15', 1)"
    )


def fit_alpha_beta(sizes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """Fit (α, β) to measured messages: `sizes[i]` bytes took `seconds[i]` seconds.

    Least squares on time = α + β·bytes, minimising the squared *relative* error of each point
    (sizes span decades: a plain fit lets the largest messages decide everything and leaves α
    meaningless). Both are kept ≥ 0: if the best fit makes one of them negative, that one is 0
    and the other is fitted alone, with the same weighting.
    Different lengths, fewer than two distinct sizes, or a time ≤ 0 -> ValueError naming the
    problem.
    """
    raise NotImplementedError(
        "l15: fit a line to the measured times; hint: tpedu.grading.hint('l15', 1)"
    )
