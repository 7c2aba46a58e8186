"""Lesson 09 reference: the log-sum-exp merge, the zig-zag assignment and one ring step."""

from __future__ import annotations

import math

import torch


def merge_partials(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    lse = torch.logaddexp(lse_a, lse_b)  # log(e^a + e^b) without overflow
    safe = torch.where(torch.isinf(lse), 0.0, lse)  # rows with no key at all: weights e^-inf = 0
    wa = torch.exp(lse_a - safe)[..., None]
    wb = torch.exp(lse_b - safe)[..., None]
    return wa * out_a + wb * out_b, lse


def zigzag_positions(s: int, cp: int, rank: int) -> torch.Tensor:
    if s % (2 * cp):
        raise ValueError(f"sequence length {s} is not divisible by 2·cp = {2 * cp}")
    n = s // (2 * cp)
    front, back = rank, 2 * cp - 1 - rank
    return torch.cat(
        [torch.arange(front * n, (front + 1) * n), torch.arange(back * n, (back + 1) * n)]
    )


def ring_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    visible = q_positions[:, None] >= k_positions[None, :]  # [sq, sk]
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    safe = torch.where(torch.isinf(lse), 0.0, lse)  # a row that sees nothing: exp(-inf) = 0
    return torch.matmul(torch.exp(scores - safe[..., None]), v), lse
