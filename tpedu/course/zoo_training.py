"""Lesson 16: the bug zoo's checks that train: ZeRO and expert parallelism against plain data
parallelism, context parallelism against tensor parallelism, on the same ranks, float64, step
by step (tpedu.course.bugzoo's entries use them).

Each check trains the zoo's small GPT twice with `tpedu.train.loop.train` and compares every
step's loss and whole-model gradient norm at 1e-10 relative: the norm shows a gradient scaled
by N, which AdamW's update hides.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from tpedu import model

# The zoo's GPT-2-like model (tpedu.course.bugzoo.GPT2): an odd vocabulary, 4 heads.
GPT2 = model.GPTConfig.gpt2_like(37, seq_len=8, n_layers=2, hidden=16, n_heads=4)


def _train_runs(config: model.GPTConfig, parallels: list[object], steps: int) -> list[dict]:
    """`train` on the same world ranks under each ParallelConfig, float64, the same data."""
    from tpedu.train.config import TrainConfig  # the whole training loop: only when checked
    from tpedu.train.loop import train

    g = torch.Generator().manual_seed(0)
    tr = torch.randint(0, config.vocab_size, (400,), generator=g)
    va = torch.randint(0, config.vocab_size, (100,), generator=g)
    cfg = TrainConfig(steps=steps, batch=4, lr=1e-2, warmup=1, eval_every=1, eval_batches=1)
    cfg = replace(cfg, progress=False)
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return [train(config, cfg, tr, va, parallel=p) for p in parallels]
    finally:
        torch.set_default_dtype(dtype)


def _first_gap(base: dict, other: dict, steps: int) -> tuple[int, float, float, float, float]:
    """(step, base loss, other loss, base gradient norm, other's) at the first step where
    either differs by more than 1e-10 relative; step -1 when none does."""
    for step in range(steps):
        ld, lo = base["losses"][step], other["losses"][step]
        gd, go = base["history"][step]["grad_norm"], other["history"][step]["grad_norm"]
        if abs(lo - ld) / ld > 1e-10 or abs(go - gd) / gd > 1e-10:
            return step, ld, lo, gd, go
    return -1, 0.0, 0.0, 0.0, 0.0


def _vs_data_parallel(level: int, steps: int = 2) -> tuple[bool, str]:
    """ZeRO-`level` training vs plain DP (ZeRO-0) on the same world ranks, float64: every
    step's loss and gradient norm (the whole-model norm: it shows a gradient scaled by N, which
    AdamW's update hides)."""
    from tpedu.parallel.config import ParallelConfig

    world = dist.get_world_size()
    try:
        dp, z = _train_runs(GPT2, [ParallelConfig(dp=world, zero=k) for k in (0, level)], steps)
    except RuntimeError as e:
        msg = str(e).splitlines()[0]
        msg = msg if len(msg) <= 100 else f"{msg[:40]} ... {msg[-50:]}"
        return False, f"ZeRO-{level} crashed: {type(e).__name__}: {msg}"
    step, ld, lz, gd, gz = _first_gap(dp, z, steps)
    if step >= 0:
        return False, (
            f"step {step}: loss {lz:.6f} vs DP {ld:.6f} (rel {abs(lz - ld) / ld:.1e}), gradient "
            f"norm {gz:.4f} vs DP {gd:.4f} (× {gz / gd:.3f})"
        )
    return True, f"{steps} steps: losses and gradient norms equal DP's to 1e-10"


def check_ep_step(steps: int = 2) -> tuple[bool, str]:
    """A mixture of experts at ep = world (each rank its own experts) vs plain DP (every expert
    on every rank) on the same ranks, float64, no auxiliary loss (over different token sets
    it would differ by design): every step's loss and gradient norm."""
    from tpedu.parallel.config import ParallelConfig

    moe = replace(GPT2, experts=4, top_k=2, aux_loss_coef=0.0)
    world = dist.get_world_size()
    dp, ep = _train_runs(moe, [ParallelConfig(dp=world, ep=e) for e in (1, world)], steps)
    step, ld, le, gd, ge = _first_gap(dp, ep, steps)
    if step >= 0:
        return False, (
            f"step {step}: loss {le:.6f} vs DP {ld:.6f}, gradient norm {ge:.4f} vs DP {gd:.4f}"
        )
    return True, f"{steps} steps: losses and gradient norms equal plain DP's to 1e-10"


def check_cp_train_step(steps: int = 2) -> tuple[bool, str]:
    """Training at cp = world (each rank its positions of every sequence) vs tp = world (each
    rank its heads), the same global batches, float64: every step's loss and gradient norm.
    Both are the dense model's arithmetic, so they agree to rounding."""
    from tpedu.parallel.config import ParallelConfig

    world = dist.get_world_size()
    tp, cp = _train_runs(GPT2, [ParallelConfig(tp=world), ParallelConfig(cp=world)], steps)
    step, lt, lc, gt, gc = _first_gap(tp, cp, steps)
    if step >= 0:
        return False, (
            f"step {step}: loss {lc:.6f} vs TP {lt:.6f}, gradient norm {gc:.4f} vs TP {gt:.4f}"
        )
    return True, f"{steps} steps: losses and gradient norms equal TP's to 1e-10"


def check_zero2_step() -> tuple[bool, str]:
    """ZeRO-2 (dp = world) vs plain DP: losses and gradient norms of 2 steps, float64."""
    return _vs_data_parallel(2)


def check_zero3_step() -> tuple[bool, str]:
    """ZeRO-3 / FSDP (dp = world) vs plain DP: losses and gradient norms of 2 steps, float64."""
    return _vs_data_parallel(3)
