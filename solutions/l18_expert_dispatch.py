"""Lesson 18 reference: expert parallelism's dispatch and combine, with counts first."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tpedu.comm import collectives
from tpedu.moe.dispatch import all_to_all_tokens


def sort_by_expert(experts: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    flat = experts.reshape(-1)
    kept_at = keep.reshape(-1).nonzero()[:, 0]  # the kept assignments, in a = t·k + j order
    return kept_at[torch.argsort(flat[kept_at], stable=True)]


def send_counts(kept_per_expert: torch.Tensor, ep: int) -> list[int]:
    n = kept_per_expert.numel()
    if ep < 1 or n % ep:
        raise ValueError(f"{n} experts do not split over ep = {ep} ranks; choose ep dividing {n}")
    return [int(c) for c in kept_per_expert.reshape(ep, -1).sum(dim=1)]


def dispatch(
    rows: torch.Tensor, kept_per_expert: torch.Tensor, group: dist.ProcessGroup | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    ep = dist.get_world_size(group)
    received = collectives.all_to_all(kept_per_expert.reshape(ep, -1), group)  # [ep, E/ep]
    send = send_counts(kept_per_expert, ep)
    recv = [int(c) for c in received.sum(dim=1)]
    return all_to_all_tokens(rows, send, recv, group), received


def combine(
    expert_out: torch.Tensor,
    received_counts: torch.Tensor,
    kept_per_expert: torch.Tensor,
    order: torch.Tensor,
    weights: torch.Tensor,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    ep = dist.get_world_size(group)
    send = send_counts(kept_per_expert, ep)
    recv = [int(c) for c in received_counts.sum(dim=1)]
    back = all_to_all_tokens(expert_out, recv, send, group)  # the reverse: counts swapped
    tokens, top_k = weights.shape
    w = weights.reshape(-1)[order, None]
    y = expert_out.new_zeros((tokens, expert_out.shape[1]))
    return y.index_add(0, order // top_k, back * w)
