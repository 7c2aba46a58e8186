"""tpedu's ZeRO-3 against PyTorch's FSDP2 (`fully_shard` on every block and the root of a plain
DenseGPT, gloo CPU ranks): the same training, step by step.

float64 (F64 = 1e-10 relative, as tests/test_zero.py): the two run the same arithmetic per rank
and differ only in the order of a few sums (the loss: vocab-parallel vs F.cross_entropy; the
gradient norm: float64 vs the parameters' dtype; gloo's sums over differently laid-out
buffers), ≈1e-16 each. A missing 1/N in either gradient mean doubles the gradient norm; a lost
weight decay or a shard stepped twice moves the losses from step 2 on: far outside 1e-10.
"""

import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard

from tests.helpers import CFG, CONFIG, F64, data, f64
from tpedu import launch
from tpedu.data.batches import packed_batch
from tpedu.model.dense import DenseGPT
from tpedu.parallel.config import ParallelConfig
from tpedu.train.config import lr_at
from tpedu.train.loop import train

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))
import bench_fsdp  # noqa: E402 - benchmarks/ is a folder of scripts, not a package

DP = 2


def like_train(config, cfg, tokens) -> dict:
    """A launched rank: tpedu's ZeRO-3 (make_sharded) and FSDP2 on train()'s batches and
    learning rates; also how FSDP2 holds the parameters."""
    import torch.distributed as dist

    rank, b = dist.get_rank(), cfg.batch // DP

    def batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return packed_batch(tokens, b, config.seq_len, step, cfg.seed, rank, DP)

    built = bench_fsdp.build(config, cfg)
    out = bench_fsdp.train_both(config, cfg, batches, lambda s: lr_at(s, cfg), cfg.steps, built)
    params = list(built[2].parameters())
    out["dtensor_shard0"] = all(
        isinstance(p, DTensor) and p.placements == (Shard(0),) for p in params
    )
    out["local_numel"] = sum(p.to_local().numel() for p in params)
    return out


def test_fsdp2_trains_like_tpedu_zero3_step_by_step():
    """dp 2, float64, 3 steps of train()'s recipe (warm-up, clipping active, weight decay,
    tied embedding): FSDP2, tpedu's ZeRO-3 driven the same way, and tpedu's own train() with
    ParallelConfig(dp=2, zero=3) give the same losses and gradient norms."""
    tr, va = data()
    ours = launch(f64, DP, train, CONFIG, CFG, tr, va, parallel=ParallelConfig(dp=DP, zero=3))[0]
    both = launch(f64, DP, like_train, CONFIG, CFG, tr)
    r = both[0]
    assert all(b["fsdp2"] == r["fsdp2"] and b["tpedu"] == r["tpedu"] for b in both)
    norms = [h["grad_norm"] for h in ours["history"]]
    assert min(norms) > CFG.grad_clip  # clipping rescales every step
    for name in ("tpedu", "fsdp2"):
        assert r[name]["losses"] == pytest.approx(ours["losses"], rel=F64), name
        assert r[name]["norms"] == pytest.approx(norms, rel=F64), name
    # FSDP2 really shards: DTensors on dim 0, each rank holding about half of the elements
    psi = sum(p.numel() for p in DenseGPT(CONFIG).parameters())
    assert r["dtensor_shard0"]
    assert psi / DP <= r["local_numel"] < psi / DP + 64
