"""Lesson 18: moving tokens to their experts and back: all-to-alls of variable sizes, as
autograd Functions.

How many tokens go where is known only after routing, and differs per rank and per step, so
an expert-parallel layer first exchanges the counts, then the tokens:

    operator            forward                                backward
    exchange_counts     all-to-all of the counts per expert    (none: integers)
    all_to_all_tokens   all-to-all, send_counts -> recv_counts all-to-all, recv_counts -> send_counts
    all_reduce_sum      all-reduce (sum)                       all-reduce (sum) of the gradient

all_to_all_tokens is its own adjoint with the counts swapped: row i received from rank s is
row j sent by s, so its gradient goes back to s, into row j. That is why an autograd Function:
torch.distributed's all_to_all_single has no backward at all.

all_reduce_sum is for a value every rank uses (the load-balancing statistics summed over the
EP group): each rank's loss depends on every rank's input through the sum, so the gradient
for this rank's input is the sum of every rank's gradient of the result. f̄
(tpedu.tp.operators), whose backward is the identity, would keep only this rank's own part:
1/ep of it, when the ranks' losses are alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from tpedu.comm import collectives


class AllToAllTokens(torch.autograd.Function):
    """Forward: rows [Σ send_counts, ...] -> [Σ recv_counts, ...] (rank order); backward: the
    same all-to-all with the counts swapped."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        send_counts: Sequence[int],
        recv_counts: Sequence[int],
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        ctx.counts, ctx.group = (send_counts, recv_counts), group
        return collectives.all_to_all_variable(x, send_counts, recv_counts, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        send_counts, recv_counts = ctx.counts
        grad = collectives.all_to_all_variable(grad, recv_counts, send_counts, ctx.group)
        return grad, None, None, None


class AllReduceSum(torch.autograd.Function):
    """Forward: all-reduce (sum); backward: all-reduce (sum) of the gradient. Shapes unchanged."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        out = x.contiguous().clone()  # all_reduce works in place: never overwrite the input
        collectives.all_reduce(out, group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()  # autograd may share this buffer: never modify it
        collectives.all_reduce(grad, ctx.group)
        return grad, None


def all_to_all_tokens(
    x: torch.Tensor,
    send_counts: Sequence[int],
    recv_counts: Sequence[int],
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """x [Σ send_counts, H] -> [Σ recv_counts, H]. Forward: 1 all-to-all of x; backward: 1 of
    the gradient [Σ recv_counts, H]. Rank r sends (Σ send_counts - send_counts[r])·H elements
    forward and (Σ recv_counts - recv_counts[r])·H backward."""
    return AllToAllTokens.apply(x, send_counts, recv_counts, group)


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """x [...] -> the sum over the group [...]. Forward: 1 all-reduce; backward: 1 all-reduce."""
    return AllReduceSum.apply(x, group)


def exchange_counts(counts: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """counts [E] (long): this rank's tokens for each expert, experts split over the ep ranks in
    contiguous blocks of E/ep -> received [ep, E/ep]: received[s, j] = rank s's tokens for this
    rank's j-th expert. 1 all-to-all of E elements, forward only."""
    t = dist.get_world_size(group)
    return collectives.all_to_all(counts.reshape(t, -1), group)


def expert_major(received: torch.Tensor) -> torch.Tensor:
    """received [ep, E/ep] (long) -> index [R]: the rows of the dispatched buffer (source-major:
    rank 0's rows for expert 0, 1, ..., then rank 1's ...) in expert-major order (expert 0's rows
    from rank 0, 1, ..., then expert 1's ...), so each local expert reads one contiguous slice.
    R = received.sum(). Within a (source, expert) chunk the rows keep their order."""
    ep, local = received.shape
    chunk = torch.repeat_interleave(torch.arange(ep * local), received.reshape(-1).cpu())
    source, expert = chunk // local, chunk % local
    return torch.argsort(expert * ep + source, stable=True).to(received.device)
