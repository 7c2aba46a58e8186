"""Lesson 10 exercise: the activation ledger (激活显存账本): a byte counter and the formula.

Fill in both functions, then run `make grade EX=l10`; notebooks/10_activation_memory.ipynb uses them
through `pick("l10_activation_ledger")`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


def saved_bytes(fn: Callable[..., Any], *args: Any, skip: Iterable[torch.Tensor] = ()) -> int:
    """Bytes autograd saves for backward while fn(*args) runs, as an int.

    Use torch.autograd.graph.saved_tensors_hooks(pack, unpack): every tensor an operation saves
    for its backward passes through pack(t) (return t unchanged; unpack(t) returns t too).
    Count each STORAGE once (t.untyped_storage(): its data_ptr() identifies it, its nbytes() is
    its size): q, k, v can be views of one buffer, and softmax's output may be saved by two ops.
    Storages of the tensors in `skip` (parameters: weights are not activations) do not count.
    Keep a reference to every counted tensor until fn returns, so no address can be reused.
    Example: for a Linear layer, saved_bytes(lin, x, skip=lin.parameters()) == x.nbytes.
    """
    raise NotImplementedError(
        "l10: count the bytes saved for backward; hint: tpedu.grading.hint('l10', 1)"
    )


def activation_bytes_per_layer(
    seq_len: int,
    micro_batch: int,
    hidden: int,
    heads: int,
    tp: int = 1,
    sp: bool = False,
    recompute: str = "none",
) -> float:
    """Bytes one transformer layer saves for backward (Korthikanti et al. 2022, Table 2).

    16-bit activations, 1-byte dropout masks; s = seq_len, b = micro_batch, h = hidden,
    a = heads, t = tp:
        recompute "none":       TP  sbh(10 + 24/t + 5as/(ht))      TP + SP  sbh/t · (34 + 5as/h)
        recompute "selective":  TP  sbh(10 + 24/t)                  TP + SP  34·sbh/t
        recompute "full":       TP  2sbh                            TP + SP  2sbh/t
    (t = 1 gives the no-parallelism row sbh(34 + 5as/h).) Return a float.
    Raise ValueError naming the choices for any other `recompute`.
    """
    raise NotImplementedError(
        "l10: evaluate the paper's formula; hint: tpedu.grading.hint('l10', 1)"
    )
