"""Lesson 04: dropout whose mask is a function of (seed, global element index): TP == dense with
dropout on.

torch's dropout draws its mask from a generator's stream, so the mask of an element depends on
how many numbers were drawn before it: a TP rank holding columns [r·n, (r+1)·n) of a [b, s, H]
activation cannot reproduce the dense model's mask for them. Production systems accept this
(each rank draws its own stream; their TP-vs-dense tests switch dropout off). Here the mask is
counter-based instead:

    keep[i] = hash(seed, i) >= p·2²⁴        i = the element's flat index in the GLOBAL tensor

so a shard only needs its offsets in the global tensor to draw exactly its slice of the dense
mask. The hash is a keyed murmur3 finalizer on 32-bit words kept in int64 tensors; every product
stays below 2⁶³, so there is no integer overflow and the bits are the same on CPU and CUDA.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import nn

_M32 = 0xFFFFFFFF
_M16 = 0xFFFF
_BITS = 24  # uniform numbers k / 2²⁴: exact in float32, compared as integers


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """(h · c) mod 2³² for h in [0, 2³²), without overflowing int64: split h into 16-bit halves."""
    lo = (h & _M16) * c  # < 2⁴⁸
    hi = ((h >> 16) * c) & _M16  # only its low 16 bits survive the << 16 below
    return (lo + (hi << 16)) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finalizer (a bijection with full avalanche) on int64 holding uint32."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def _fmix32_int(h: int) -> int:
    """The same finalizer on a Python int (for seeds)."""
    h &= _M32
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def _mix63(a: int) -> int:
    """A Python int -> a well-mixed non-negative 63-bit int (two keyed 32-bit finalizers)."""
    lo, hi = a & _M32, (a >> 32) & _M32
    h1 = _fmix32_int(lo ^ _fmix32_int(hi ^ 0x9E3779B9))
    h2 = _fmix32_int(hi ^ _fmix32_int(h1 ^ 0x7F4A7C15))
    return ((h2 << 32) | h1) & (2**63 - 1)


@functools.lru_cache(maxsize=4096)  # pure, and asked for at every site of every forward
def derive_seed(base: int, *keys: int) -> int:
    """A seed for one call site, e.g. derive_seed(base, layer_id, site, step): differs per key."""
    s = _mix63(base)
    for k in keys:
        s = _mix63(s ^ _mix63((k + 0x632BE5AB) & (2**64 - 1)))
    return s


def global_index(
    local_shape: Sequence[int],
    global_shape: Sequence[int],
    offsets: Sequence[int],
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """int64 tensor [local_shape]: each local element's flat (row-major) index in the global tensor.

    offsets[d] is where this shard starts along dim d of the global tensor.
    """
    if not (len(local_shape) == len(global_shape) == len(offsets)):
        raise ValueError(
            f"local shape {tuple(local_shape)}, global shape {tuple(global_shape)} and offsets "
            f"{tuple(offsets)} must have the same number of dimensions"
        )
    for d, (n, g, o) in enumerate(zip(local_shape, global_shape, offsets, strict=True)):
        if o < 0 or o + n > g:
            raise ValueError(
                f"dim {d}: a shard of size {n} at offset {o} does not fit in the global size {g} "
                f"(global shape {tuple(global_shape)}, offsets {tuple(offsets)})"
            )
    idx = torch.zeros((), dtype=torch.int64, device=device)
    for d, (n, g, o) in enumerate(zip(local_shape, global_shape, offsets, strict=True)):
        view = [1] * len(local_shape)
        view[d] = n
        coord = torch.arange(o, o + n, dtype=torch.int64, device=device).view(view)
        idx = idx * g + coord  # Horner: ((i0·G1 + i1)·G2 + i2)...
    return idx.expand(*local_shape) if len(local_shape) else idx


def uniform_bits(seed: int, index: torch.Tensor) -> torch.Tensor:
    """Integers in [0, 2²⁴) (int64, shape of `index`): a keyed hash of (seed, index)."""
    k1 = _fmix32_int(seed ^ 0x243F6A88)
    k2 = _fmix32_int((seed >> 32) ^ 0x85A308D3)
    h = _fmix32((index & _M32) ^ k1)
    h = _fmix32(h ^ (index >> 32) ^ k2)
    return h >> (32 - _BITS)


def keep_mask(
    seed: int,
    p: float,
    local_shape: Sequence[int],
    global_shape: Sequence[int],
    offsets: Sequence[int],
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """bool [local_shape]: True where the element is kept (probability 1 - p)."""
    threshold = int(round(p * 2**_BITS))  # keep iff k/2²⁴ >= p, decided in integers (exact)
    return uniform_bits(seed, global_index(local_shape, global_shape, offsets, device)) >= threshold


def index_dropout(
    x: torch.Tensor,
    p: float,
    seed: int,
    global_shape: Sequence[int] | None = None,
    offsets: Sequence[int] | None = None,
    training: bool = True,
) -> torch.Tensor:
    """Dropout of x (this rank's shard of a global tensor) with the dense tensor's mask slice.

    x [local] at `offsets` inside a tensor of `global_shape` (defaults: x is the whole tensor)
    -> x · mask / (1 - p), same shape. No communication. The same elementwise ops as the dense
    call, so TP and dense results are bit-identical.
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")
    if not training or p == 0.0:
        return x
    if p == 1.0:
        return x * 0.0
    global_shape = tuple(x.shape) if global_shape is None else tuple(global_shape)
    offsets = (0,) * x.dim() if offsets is None else tuple(offsets)
    mask = keep_mask(seed, p, x.shape, global_shape, offsets, x.device)
    return x * mask.to(x.dtype) / (1.0 - p)


class ParallelDropout(nn.Module):
    """index_dropout as a module: `ParallelDropout(p, seed)(x, global_shape, offsets)`."""

    def __init__(self, p: float, seed: int = 0) -> None:
        super().__init__()
        self.p, self.seed = p, seed

    def forward(
        self,
        x: torch.Tensor,
        global_shape: Sequence[int] | None = None,
        offsets: Sequence[int] | None = None,
        step: int | None = None,
    ) -> torch.Tensor:
        """x [local] -> same shape; `step` (if given) changes the mask every step."""
        seed = self.seed if step is None else derive_seed(self.seed, step)
        return index_dropout(x, self.p, seed, global_shape, offsets, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}, seed={self.seed}"
