"""Reference for exercises/l10_activation_ledger.py: a saved-bytes counter and the formula."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

RECOMPUTE = ("none", "selective", "full")


def saved_bytes(fn: Callable[..., Any], *args: Any, skip: Iterable[torch.Tensor] = ()) -> int:
    skipped = {t.untyped_storage().data_ptr() for t in skip}
    seen: set[int] = set()
    kept: list[torch.Tensor] = []  # alive until fn returns, so no address is reused meanwhile
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in skipped and key not in seen:  # one storage, counted once
            seen.add(key)
            kept.append(t)
            total += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return total


def activation_bytes_per_layer(
    seq_len: int,
    micro_batch: int,
    hidden: int,
    heads: int,
    tp: int = 1,
    sp: bool = False,
    recompute: str = "none",
) -> float:
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    s, b, h, a, t = seq_len, micro_batch, hidden, heads, tp
    sbh = s * b * h
    if recompute == "full":  # only the layer's input is kept
        return 2 * sbh / (t if sp else 1)
    scores = 0.0 if recompute == "selective" else 5 * a * s / h  # softmax, its mask and output
    if sp:
        return sbh / t * (34 + scores)
    return sbh * (10 + 24 / t + scores / t)  # the 10 stays replicated under TP alone
