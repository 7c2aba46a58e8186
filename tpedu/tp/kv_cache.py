"""Lesson 17: a key/value cache sharded by heads: each tensor-parallel rank keeps the K and V of
its own KV heads only, so decoding one token reuses every earlier position's keys and values
instead of recomputing the whole window (generation itself: tpedu.serve).

Per layer, rank r holds

    k, v   [b, nkv_r, capacity, d]     nkv_r = nkv/t (split), or 1 (a replica when t > nkv)
    lengths [b]                         how many positions of each sequence are filled

so the cache takes 2 · layers · b · capacity · nkv_r · d elements per rank: 1/t of the dense
cache when the KV heads are split, one KV head's worth when they are replicated (t > nkv).
Nothing about the cache is communicated: attention needs only the rank's own heads.

Slot j of sequence i holds position j (no left padding): sequences of different lengths keep
their own `lengths`, RoPE and learned positions use each sequence's true position, and a query
at position p attends to the slots j <= p. Right padding in a batched prefill fills slots that
`truncate` then hands back and the next decode steps overwrite: a batch computes what each
sequence alone would.

The cache never grows past `capacity` <= the model's context length (seq_len): a learned
position table has no row beyond it and RoPE was trained within it. Asking for more is a
ValueError; the recompute path (`use_cache=False`) slides a window instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


def check_cache_usable(training: bool, sequence_parallel: bool, context: object | None) -> None:
    """Raise a ValueError unless the model can run with a KV cache (inference, plain TP):
    `context` is the model's context parallelism (tpedu.cp.context; None: none)."""
    if training:
        raise ValueError(
            "a KV cache is for inference: call model.eval() (and use torch.no_grad()) first"
        )
    if sequence_parallel:
        raise ValueError(
            "a KV cache needs the full sequence on every rank: build the model without "
            "sequence_parallel for generation"
        )
    if context is not None:
        raise ValueError(
            "a KV cache with context parallelism (cp > 1) is not supported: build the model "
            "without RunOptions.context for generation"
        )


class KVCache:
    """K and V of this rank's KV heads for every layer of a model, for a batch of sequences.

    k[i], v[i]: [b, nkv_r, capacity, d] for layer i; lengths [b] int64: filled positions per
    sequence (the position of its next token). `layer(i)` is what attention layer i writes to.
    """

    def __init__(
        self,
        n_layers: int,
        batch: int,
        kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if batch < 1 or capacity < 1:
            raise ValueError(
                f"a KV cache needs batch >= 1 and capacity >= 1, got {batch}, {capacity}"
            )
        shape = (batch, kv_heads, capacity, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.lengths = torch.zeros(batch, dtype=torch.int64, device=device)
        self.capacity = capacity
        self.step: Step | None = None  # the forward being served (`begin`)

    @classmethod
    def for_model(cls, model: nn.Module, batch: int, capacity: int | None = None) -> KVCache:
        """An empty cache for this rank's shard of `model` (a TPGPT): its blocks' local KV heads,
        its weights' dtype and device; capacity defaults to the context length seq_len."""
        seq_len = model.config.seq_len
        capacity = seq_len if capacity is None else capacity
        if capacity > seq_len:
            raise ValueError(
                f"KV cache capacity {capacity} is more than the model's context length "
                f"seq_len = {seq_len}: generate at most {seq_len} tokens per sequence "
                "(prompt included), or use the recompute path (use_cache=False, --no-cache), "
                f"which slides a window over the last {seq_len}"
            )
        attn = model.blocks[0].attn
        w = attn.qkv.weight
        return cls(
            len(model.blocks),
            batch,
            len(attn.kv_heads),
            attn.head_dim,
            capacity,
            w.dtype,
            w.device,
        )

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    def positions(self, s: int) -> torch.Tensor:
        """[b, s] int64: the positions of s new tokens per sequence (lengths + 0 .. s-1)."""
        pos = self.lengths[:, None] + torch.arange(s, device=self.lengths.device)
        top = int(pos.max())
        if top >= self.capacity:
            raise ValueError(
                f"the KV cache holds {self.capacity} positions; position {top} does not fit: "
                "generate fewer tokens, or use the recompute path (use_cache=False, --no-cache)"
            )
        return pos

    def begin(self, s: int) -> Step:
        """Before a forward of s new tokens per sequence: what every layer writes and attends
        with, worked out once, not once per layer (`Step`)."""
        pos = self.positions(s)
        lengths = self.lengths.tolist()
        filled = int(pos.max()) + 1
        start = lengths[0] if len(set(lengths)) == 1 else None  # one length: slices, no indexing
        if start is not None and s == 1:
            mask = None  # one query at the newest position sees every filled slot
        else:
            mask = torch.arange(filled, device=pos.device) <= pos[:, None, :, None]
        self.step = Step(pos, filled, start, mask)
        return self.step

    def layer(self, i: int) -> LayerCache:
        return LayerCache(self, i)

    def advance(self, s: int) -> None:
        """Every sequence has s more positions filled (after a forward of s tokens)."""
        self.lengths += s
        self.step = None

    def truncate(self, lengths: torch.Tensor | list[int]) -> None:
        """Keep only the first lengths[i] positions of sequence i (after a right-padded
        prefill: the padding's slots are free again and the next tokens overwrite them)."""
        lengths = torch.as_tensor(lengths, dtype=torch.int64, device=self.lengths.device)
        if lengths.shape != self.lengths.shape or bool((lengths > self.lengths).any()):
            raise ValueError(f"truncate needs {self.batch} lengths <= the filled ones")
        self.lengths = lengths.clone()

    def keep(self, rows: torch.Tensor | list[int]) -> None:
        """Keep only these sequences (e.g. drop finished ones from the batch). A copy."""
        rows = torch.as_tensor(rows, dtype=torch.int64, device=self.lengths.device)
        self.k = [k.index_select(0, rows) for k in self.k]
        self.v = [v.index_select(0, rows) for v in self.v]
        self.lengths = self.lengths.index_select(0, rows)

    def nbytes(self) -> int:
        """Bytes this rank's cache takes."""
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))


@dataclass(frozen=True)
class Step:
    """One forward's view of the cache, the same for every layer (KVCache.begin).

    positions [b, s]: the new tokens' positions; filled: slots 0 .. filled-1 are in use after
    the write (L); start: the common length when every sequence has it (the write is then a
    slice), else None; mask [b, 1, s, L] (True: the query at position p sees slot j <= p), or
    None when every query sees every filled slot (one new token, one length)."""

    positions: torch.Tensor
    filled: int
    start: int | None
    mask: torch.Tensor | None


@dataclass
class LayerCache:
    """One layer's view of a KVCache: attention reads its positions and writes its K and V."""

    cache: KVCache
    index: int

    def positions(self) -> torch.Tensor:
        """[b, s]: the positions of this forward's new tokens (KVCache.begin)."""
        return self.cache.step.positions

    def update(
        self, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Write k, v [b, nkv_r, s, d] at this forward's positions; return every filled slot's
        (k, v) [b, nkv_r, L, d] (L = the longest sequence's positions so far) and the mask
        [b, 1, s, L] or None (`Step`)."""
        step, ck, cv = self.cache.step, self.cache.k[self.index], self.cache.v[self.index]
        if step.start is not None:  # every sequence at the same length: a slice
            ck[:, :, step.start : step.start + k.shape[2]] = k
            cv[:, :, step.start : step.start + v.shape[2]] = v
        else:
            rows = torch.arange(k.shape[0], device=k.device)[:, None]  # [b, 1] with [b, s]
            ck[rows, :, step.positions] = k.transpose(1, 2)  # indexed [b, s, nkv_r, d]
            cv[rows, :, step.positions] = v.transpose(1, 2)
        return ck[:, :, : step.filled], cv[:, :, : step.filled], step.mask
