"""Lesson 07: batches for language-model training, the same on every rank that must see the same
data.

- `packed_batch`: fixed-length windows cut from one long token stream (no padding, no waste).
  The windows are drawn from a generator seeded by (seed, step), so every tensor-parallel rank
  draws the *same* batch without communicating, and a resumed run draws the same batches again.
- `padded_batch`: variable-length samples (paragraphs of the novel vary from a few characters to
  thousands) padded to the longest in the batch ("dynamic padding", seed §5.5), with a loss mask:
  padded positions get target `IGNORE`, so they never contribute to the loss.
"""

from __future__ import annotations

import torch

from tpedu.tp.vocab_parallel import IGNORE


def packed_batch(
    tokens: torch.Tensor,
    batch: int,
    seq: int,
    step: int,
    seed: int = 0,
    dp_rank: int = 0,
    dp_size: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets, each [batch, seq], for training step `step`.

    The global batch has `batch · dp_size` windows; data-parallel rank `dp_rank` gets its own
    `batch` of them, so dp ranks see different data and tp/pp ranks of one replica the same.
    """
    if tokens.numel() <= seq + 1:
        raise ValueError(
            f"the token stream ({tokens.numel()} tokens) is shorter than seq+1 = {seq + 1}"
        )
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, tokens.numel() - seq - 1, (batch * dp_size,), generator=g)
    starts = starts[dp_rank * batch : (dp_rank + 1) * batch]
    x = torch.stack([tokens[s : s + seq] for s in starts.tolist()])
    y = torch.stack([tokens[s + 1 : s + 1 + seq] for s in starts.tolist()])
    return x, y


def padded_batch(
    samples: list[list[int]], pad_id: int, max_len: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad token lists to the longest (truncated to `max_len` + 1) and shift for next-token targets.

    Returns inputs [b, L] (padded with `pad_id`) and targets [b, L] with `IGNORE` wherever the
    target is padding, so `cross_entropy(..., ignore_index=IGNORE)` averages over real tokens.
    """
    if not samples or any(len(s) < 2 for s in samples):
        raise ValueError("every sample needs at least 2 tokens (an input and its next token)")
    cut = [s[: max_len + 1] if max_len else s for s in samples]
    length = max(len(s) for s in cut) - 1
    x = torch.full((len(cut), length), pad_id, dtype=torch.long)
    y = torch.full((len(cut), length), IGNORE, dtype=torch.long)
    for i, s in enumerate(cut):
        t = torch.tensor(s, dtype=torch.long)
        x[i, : len(s) - 1] = t[:-1]
        y[i, : len(s) - 1] = t[1:]
    return x, y
