"""Lesson 07: rotary position embeddings (RoPE), as in Llama: rotate each (x_i, x_{i+d/2}) pair
of a query or key by an angle that grows with the position.

RoPE acts on each head independently and identically, so under tensor parallelism every rank
applies it to its own heads with no communication and no change: a TP attention with RoPE is the
dense one, sliced by heads.
"""

from __future__ import annotations

import torch


def rope_angles(
    seq: int,
    head_dim: int,
    theta: float,
    device: torch.device | str = "cpu",
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Angles [seq, head_dim/2]: position p, frequency i -> p · theta^(-2i/head_dim).
    `positions` [seq]: the global positions (context parallelism), else 0 .. seq-1; or
    [b, seq], each sequence's own (a KV cache's batch) -> angles [b, seq, head_dim/2]."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head dimension, got {head_dim}")
    inv_freq = theta ** (
        -torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim
    )
    if positions is None:
        positions = torch.arange(seq, device=device)
    return positions.to(device=device, dtype=torch.float64)[..., None] * inv_freq


def apply_rope(
    x: torch.Tensor, theta: float = 10000.0, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """x [b, heads, s, d] (queries or keys) -> the same shape, rotated by position
    (`positions` [s]: each row's global position; [b, s]: each sequence's own, as a KV cache
    decodes sequences of different lengths; default 0 .. s-1)."""
    angles = rope_angles(x.shape[-2], x.shape[-1], theta, x.device, positions)
    if angles.dim() == 3:  # [b, s, d/2]: one set per sequence, shared by its heads
        angles = angles[:, None]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
