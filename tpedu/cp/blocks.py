"""Lesson 09: one ring step's block of attention through the fused (flash) kernel.

Ring attention (tpedu.cp.ring) attends this rank's queries to one K/V block per step and merges
the partial results with their log-sum-exps. Written out, a block is an [s/cp, s/cp] score
matrix; here it is one call of PyTorch's flash-attention CPU kernel, which returns the
log-sum-exp beside the output and whose backward takes the (global) output and log-sum-exp
back, so the merged result and every gradient are those of the explicit block, to rounding.

Causal masking is by global position, so which keys a block's queries see follows from the
two position lists alone (`visible`), and only what is seen is computed:

    none    every key after every query (a block in the future)          skipped
    all     every key before every query                                 one full call
    causal  the same positions (the diagonal block, in increasing order)  is_causal=True
    rows    some queries see every key, the others none                  those queries only
    cols    every query sees the same keys, the rest none                those keys only
    mask    anything else                                                 the explicit block

Zig-zag (rank r holds chunks r and 2·cp − 1 − r) makes every off-diagonal block a `rows` or a
`cols` block of half the size: its partly masked blocks cost half a block, which is where
zig-zag's balance comes from; contiguous blocks are all `none`, `all` or `causal`.

The kernel runs on CPU and meta tensors (the dry run); elsewhere ring attention uses the
explicit blocks (`kernel_available`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def kernel_available(x: torch.Tensor) -> bool:
    """Whether the fused block kernel runs on x's device (CPU, or meta for the dry run)."""
    return x.device.type in ("cpu", "meta")


@dataclass(frozen=True)
class Visible:
    """Which keys of a block its queries see: `kind` (see the module docstring) with the
    queries (`rows`) or keys (`cols`) that take part, or the whole `mask` [sq, sk]."""

    kind: str
    rows: slice = field(default_factory=lambda: slice(None))
    cols: slice = field(default_factory=lambda: slice(None))
    mask: torch.Tensor | None = None


def _span(flags: torch.Tensor) -> slice | None:
    """The flagged indices as one slice, if they are contiguous."""
    idx = flags.nonzero().flatten()
    if idx.numel() == 0 or idx[-1] - idx[0] + 1 != idx.numel():
        return None
    return slice(int(idx[0]), int(idx[-1]) + 1)


def visible(pos_q: torch.Tensor, pos_k: torch.Tensor) -> Visible:
    """How queries at global positions pos_q [sq] see keys at pos_k [sk] (causal: k <= q)."""
    mask = pos_q[:, None] >= pos_k[None, :]
    if not mask.any():
        return Visible("none")
    if mask.all():
        return Visible("all")
    if torch.equal(pos_q, pos_k) and bool((pos_q[1:] > pos_q[:-1]).all()):
        return Visible("causal")
    rows, cols = mask.all(1), mask.all(0)
    if bool((rows | ~mask.any(1)).all()) and (span := _span(rows)) is not None:
        return Visible("rows", rows=span)
    if bool((mask == cols[None, :]).all()) and (span := _span(cols)) is not None:
        return Visible("cols", cols=span)
    return Visible("mask", mask=mask)


def block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seen: Visible, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [b, h, sq, d] against k, v [b, h, sk, d] (KV heads already expanded) -> the block's
    (out [b, h, sq', d], lse [b, h, sq']) for the queries `seen.rows` (all but for `rows`).
    Not for `none` or `mask` blocks."""
    causal = seen.kind == "causal"
    return _FORWARD(
        q[:, :, seen.rows], k[:, :, seen.cols], v[:, :, seen.cols], 0.0, causal, scale=scale
    )


def block_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    seen: Visible,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block's share of (dq, dk, dv) for the queries `seen.rows` and the keys `seen.cols`,
    from the merged `out` and `lse` of every block: P = exp(S − lse) is then the block's part
    of the whole softmax and D = rowsum(dO ∘ O) the whole row's, as in the explicit backward."""
    r, c = seen.rows, seen.cols
    half = q.dtype in (torch.bfloat16, torch.float16)  # the kernel keeps their lse in fp32
    return _BACKWARD(
        grad_out[:, :, r].contiguous(),
        q[:, :, r],
        k[:, :, c],
        v[:, :, c],
        out[:, :, r].contiguous(),
        lse[:, :, r].to(torch.float32 if half else q.dtype).contiguous(),
        0.0,
        seen.kind == "causal",
        scale=scale,
    )
