"""index_dropout: the mask is a function of (seed, global element index) only, so any shard at
its offsets draws exactly its slice of the dense mask. Masks are compared exactly (booleans);
values exactly too, since shard and dense run the same elementwise ops on the same numbers.
"""

import pytest
import torch
import torch.distributed as dist

import tpedu
from tpedu import launch
from tpedu.comm.collectives import all_gather
from tpedu.tp.dropout import (
    ParallelDropout,
    derive_seed,
    global_index,
    index_dropout,
    keep_mask,
    uniform_bits,
)

SHAPE = (3, 4, 10)


def fmix32(h):
    """murmur3's finalizer on plain Python ints: the reference for the tensor version."""
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def reference_bits(seed, i):
    k1, k2 = fmix32((seed ^ 0x243F6A88) & 0xFFFFFFFF), fmix32((seed >> 32) ^ 0x85A308D3)
    h = fmix32((i & 0xFFFFFFFF) ^ k1)
    return fmix32(h ^ (i >> 32) ^ k2) >> 8


def test_hash_matches_plain_integer_reference():
    # Indices around 2^31, 2^32 and 2^40 exercise the overflow-free 32-bit multiply.
    idx = [0, 1, 2, 12345, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40 + 7, 2**62 + 3]
    for seed in (0, 1, derive_seed(7, 3), 2**63 - 1):
        got = uniform_bits(seed, torch.tensor(idx)).tolist()
        assert got == [reference_bits(seed, i) for i in idx], f"seed {seed}"


def test_shards_draw_the_dense_mask_slice():
    dense = keep_mask(11, 0.4, SHAPE, SHAPE, (0, 0, 0))
    # Even and uneven splits along every dim, and 2-D blocks.
    for local, offsets in [
        ((3, 4, 5), (0, 0, 5)),
        ((3, 4, 3), (0, 0, 7)),
        ((3, 1, 10), (0, 2, 0)),
        ((1, 4, 10), (2, 0, 0)),
        ((2, 3, 4), (1, 1, 6)),
    ]:
        got = keep_mask(11, 0.4, local, SHAPE, offsets)
        want = dense[tuple(slice(o, o + n) for o, n in zip(offsets, local, strict=True))]
        assert torch.equal(got, want), f"shard {local} at {offsets}"


def test_values_scaling_and_gradient():
    x = torch.randn(SHAPE, dtype=torch.float64, requires_grad=True)
    p = 0.25
    y = index_dropout(x, p, seed=5)
    keep = keep_mask(5, p, SHAPE, SHAPE, (0, 0, 0))
    assert torch.equal(y, torch.where(keep, x * 1.0 / (1 - p), torch.zeros_like(x)))
    y.sum().backward()
    assert torch.equal(x.grad, keep.double() / (1 - p))
    # The shard of x gives the same values as the same slice of the dense result.
    ys = index_dropout(x[..., 4:9], p, 5, global_shape=SHAPE, offsets=(0, 0, 4))
    assert torch.equal(ys, y[..., 4:9])
    # Off switches and limits.
    assert index_dropout(x, 0.0, 5) is x
    assert index_dropout(x, 0.5, 5, training=False) is x
    assert torch.equal(index_dropout(x, 1.0, 5), torch.zeros_like(x))


def test_keep_rate_seeds_and_steps():
    n, p = 200_000, 0.3
    keep = keep_mask(3, p, (n,), (n,), (0,))
    sigma = (p * (1 - p) / n) ** 0.5
    assert abs(keep.double().mean().item() - (1 - p)) < 5 * sigma  # deterministic, not flaky
    other = keep_mask(4, p, (n,), (n,), (0,))
    agree = (keep == other).double().mean().item()
    # Independent masks agree on p² + (1-p)² = 0.58 of the elements, not on all of them.
    assert abs(agree - (p * p + (1 - p) ** 2)) < 5 * (0.58 * 0.42 / n) ** 0.5
    assert torch.equal(keep, keep_mask(3, p, (n,), (n,), (0,))), "same seed, same mask"
    seeds = {
        derive_seed(0, layer, site, step)
        for layer in range(4)
        for site in (1, 2)
        for step in range(5)
    }
    assert len(seeds) == 40 and all(0 <= s < 2**63 for s in seeds)
    drop = ParallelDropout(0.5, seed=9)
    x = torch.ones(50)
    assert not torch.equal(drop(x, step=0), drop(x, step=1))


def test_global_index_and_large_tensors():
    idx = global_index((2, 3), (2**20, 2**14), (2**20 - 2, 100))
    rows = torch.tensor([2**20 - 2, 2**20 - 1]).view(2, 1)
    assert torch.equal(idx, rows * 2**14 + torch.arange(100, 103))
    # The high 32 bits of the index matter: element i and i + 2^32 get different bits.
    lo = uniform_bits(1, torch.arange(1000))
    hi = uniform_bits(1, torch.arange(1000) + 2**32)
    assert (lo != hi).float().mean() > 0.99


def test_bad_arguments():
    with pytest.raises(
        ValueError, match=r"dim 2: a shard of size 5 at offset 7 does not fit in the global size 10"
    ):
        keep_mask(0, 0.5, (3, 4, 5), SHAPE, (0, 0, 7))
    with pytest.raises(ValueError, match="same number of dimensions"):
        keep_mask(0, 0.5, (3, 4), SHAPE, (0, 0, 0))
    with pytest.raises(ValueError, match=r"dropout probability must be in \[0, 1\], got 1.5"):
        index_dropout(torch.ones(3), 1.5, 0)


def tp_dropout_worker(p, seed):
    t, r = dist.get_world_size(), dist.get_rank()
    x = torch.randn(
        SHAPE[:-1] + (12,), generator=torch.Generator().manual_seed(0), dtype=torch.float64
    )
    x = x.to(tpedu.device())
    n = 12 // t
    local = index_dropout(x[..., r * n : (r + 1) * n], p, seed, x.shape, (0, 0, r * n))
    return all_gather(local, dim=-1), index_dropout(x, p, seed)


@pytest.mark.parametrize("t", [2, 3, 4])
def test_tp_ranks_reassemble_the_dense_dropout(t):
    for gathered, dense in launch(tp_dropout_worker, t, 0.35, 77):
        assert torch.equal(gathered, dense), (
            f"max |tp - dense| = {(gathered - dense).abs().max():.3e}"
        )
