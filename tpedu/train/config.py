"""Lesson 07: a training run's settings (`TrainConfig`) and its learning-rate schedule."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tpedu.train.precision import DTYPES

REDUCE_DTYPES = ("fp32", "low")  # a collective in fp32, or in the run's low-precision dtype


@dataclass
class TrainConfig:
    steps: int = 200
    batch: int = 8  # the global batch: DP replicas split it, the pipeline its micro-batches
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 50
    eval_batches: int = 4
    seed: int = 0
    progress: bool = True
    ckpt_dir: str | None = None  # sharded checkpoints (lesson 14) go here ...
    save_every: int = 0  # ... every this many steps (and at the end); 0: only at the end
    resume: str | None = None  # a checkpoint (step dir or its parent) to continue from
    dtype: str = "fp32"  # "bf16" / "fp16": autocast compute, fp32 master weights (precision.py)
    grad_reduce: str = "fp32"  # DP all-reduce of the gradients: "fp32", or "low" (= dtype)
    param_gather: str = "fp32"  # ZeRO-2/3's parameter all-gathers: "fp32", or "low" (= dtype)
    loss_scale: float = 2.0**16  # fp16: the initial loss scale ...
    loss_scale_window: int = 1000  # ... doubled after this many steps without an overflow

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        for name in ("grad_reduce", "param_gather"):
            if getattr(self, name) not in REDUCE_DTYPES:
                raise ValueError(f"{name} must be 'fp32' or 'low', got {getattr(self, name)!r}")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to min_lr (the seed's 'warmup + cosine')."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(frac, 1.0)))
