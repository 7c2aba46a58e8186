"""Lesson 18 exercise: send each token to the rank of its expert and bring the result back.

Expert parallelism (EP) puts experts [r·E/ep, (r+1)·E/ep) on rank r of the EP group; every
rank routes its own T tokens, then the tokens travel. Nobody knows in advance how many rows a
rank will receive, so the counts travel first, then the rows, and the way back is the same
all-to-all with the counts swapped. Write the four pieces:

    sort_by_expert   which kept assignments go where, in the order they are sent
    send_counts      how many rows go to each rank
    dispatch         the counts' all-to-all, then the rows' (variable sizes)
    combine          the rows' way back, weighted and summed per token

Then run `make grade EX=l18` (or `python -m tpedu.course.grading l18`);
notebooks/18_mixture_of_experts.ipynb uses them through `pick("l18_expert_dispatch")`.

An assignment is one (token t, choice j) pair of the router's top-k, numbered a = t·k + j (the
index into experts.reshape(-1)). Collectives: tpedu.comm.collectives (`all_to_all` for equal
chunks) and tpedu.moe.dispatch.all_to_all_tokens (all_to_all_variable as an autograd
Function: its backward is the same all-to-all with the counts swapped), so gradients reach the
tokens. group None is the world.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def sort_by_expert(experts: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The kept assignments in the order they are sent: by expert, then by token.

    experts [T, k] (int64): the router's choices; keep [T, k] (bool): which assignments the
    capacity kept. Return order [A] (int64), A = keep.sum(): the numbers a = t·k + j of the
    kept assignments, grouped by expert (expert 0's first, then expert 1's, ...), and within an
    expert in increasing a (token order). Dropped assignments do not appear.

    experts [[2, 0], [0, 1], [2, 1]] (k = 2), all kept -> [1, 2, 3, 5, 0, 4].
    """
    raise NotImplementedError("l18: sort the kept assignments; hint: tpedu.grading.hint('l18', 1)")


def send_counts(kept_per_expert: torch.Tensor, ep: int) -> list[int]:
    """Rows this rank sends to each of the ep ranks: a list of ep ints.

    kept_per_expert [E] (int64): this rank's kept assignments for each expert. Rank d holds
    experts [d·E/ep, (d+1)·E/ep), so it receives the sum over that block. With E = 4, ep = 2:
    [3, 1, 0, 2] -> [4, 2]. ep not dividing E -> ValueError naming both numbers.
    """
    raise NotImplementedError("l18: count rows per rank; hint: tpedu.grading.hint('l18', 1)")


def dispatch(
    rows: torch.Tensor, kept_per_expert: torch.Tensor, group: dist.ProcessGroup | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Send the rows to the ranks of their experts; return (received, received_counts).

    rows [A, H]: this rank's tokens in `sort_by_expert` order (rows[i] = x[order[i] // k]), so
    the rows for rank d are one contiguous block; kept_per_expert [E] (int64).

    First every rank tells every other how many rows of each of its experts to expect:
    received_counts [ep, E/ep] (int64), received_counts[s, j] = how many rows rank s sends to
    this rank's j-th expert. Then the rows themselves: received [R, H], R = received_counts.sum(),
    source-major (rank 0's rows first, then rank 1's, ...; within a source, by expert, as sent).
    Two all-to-alls; the second must carry gradients back to `rows`.
    """
    raise NotImplementedError("l18: exchange counts, then rows; hint: tpedu.grading.hint('l18', 1)")


def combine(
    expert_out: torch.Tensor,
    received_counts: torch.Tensor,
    kept_per_expert: torch.Tensor,
    order: torch.Tensor,
    weights: torch.Tensor,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Send the experts' outputs home and sum them per token, weighted: y [T, H].

    expert_out [R, H]: the outputs for the rows `dispatch` received, in the same (source-major)
    order; received_counts [ep, E/ep] and kept_per_expert [E] as in `dispatch`; order [A] from
    `sort_by_expert`; weights [T, k]: the router's combine weights. After the way back, row i
    is the output for assignment a = order[i] of this rank:
    y[t] = Σ over the kept (t, j) of weights[t, j] · output of assignment t·k + j. A token
    whose assignments were all dropped gets 0. Differentiable in expert_out and weights.
    """
    raise NotImplementedError("l18: send back and add up; hint: tpedu.grading.hint('l18', 1)")
