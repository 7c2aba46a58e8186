"""Lessons 07–16: mixed precision: bf16 or fp16 arithmetic, fp32 master weights, loss scaling.

tpedu follows PyTorch's automatic mixed precision (AMP), not Megatron-LM's Float16Optimizer:

                      parameters     gradients      AdamW states    bytes / parameter
    Megatron bf16     bf16 + fp32    fp32 main_grad 2 × fp32        2 + 4 + 4 + 8 = 18
    Megatron fp16     fp16 + fp32    fp16           2 × fp32        2 + 2 + 4 + 8 = 16
    tpedu (AMP)       fp32           fp32           2 × fp32        4 + 4 + 8     = 16

The fp32 parameters ARE the master weights: under `autocast` every matmul casts its weight to
the low-precision dtype on the fly (the copies live for one forward, +2 B per parameter at the
peak, and are never stored) and runs in bf16 / fp16; norms, softmax and the loss stay in fp32
(autocast's op lists). Gradients arrive in fp32, so they are accumulated over micro-batches and
all-reduced over DP in fp32, unless `DataParallel(reduce_dtype=...)` is asked to send them in
low precision. Why this scheme in a course: the model, the optimizer, the checkpoints and the
shard map are the fp32 ones of every other lesson, and "master weights" needs no second copy
to keep in step. What stays low precision is what the seeds talk about: the activations, and
the TP all-reduces of the row-parallel outputs, which now sum bf16 partial results.

fp16 has 5 exponent bits: gradients below 2⁻²⁴ flush to zero. `LossScaler` multiplies the loss
by S before backward (gradients scale by S), divides the gradients by S before clipping and the
step, and adapts S the way torch.amp.GradScaler does: if any gradient on any rank is inf or
NaN, the step is skipped and S halves; after `growth_interval` clean steps, S doubles. bf16 has
fp32's exponent range and needs no scaling.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist

from tpedu.comm import collectives

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(dtype: str, device: torch.device) -> AbstractContextManager:
    """The forward's precision context: autocast to `dtype` ("bf16", "fp16"), or nothing."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    if dtype == "fp32":
        return nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[dtype])


class LossScaler:
    """Dynamic loss scaling (fp16). `scale` multiplies the loss; `unscale_and_check` divides
    the gradients by it and says, agreed over every rank, whether the step must be skipped.

    Per step, 1 all-reduce (MAX) of one element over the world: a TP rank's shard can overflow
    while its neighbours' do not, and if only that rank skipped, the replicas would diverge.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_interval: int = 1000,
        backoff: float = 0.5,
        growth: float = 2.0,
    ) -> None:
        self.scale, self.growth_interval = init_scale, growth_interval
        self.backoff, self.growth = backoff, growth
        self.clean_steps = 0  # since the last overflow or growth
        self.skipped = 0  # steps skipped so far

    def unscale_and_check(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """Divide every gradient by the scale; True if any rank saw inf or NaN. Collective."""
        params = [p for p in params if p.grad is not None]
        device = params[0].grad.device if params else torch.device("cpu")
        bad = torch.zeros((), device=device)
        for p in params:
            p.grad.div_(self.scale)
            bad = torch.maximum(bad, (~torch.isfinite(p.grad)).any().float())
        if dist.is_initialized():
            collectives.all_reduce(bad, op=dist.ReduceOp.MAX)
        return bool(bad.item())

    def update(self, overflow: bool) -> None:
        """After a step: back off on overflow (the step was skipped), grow after a clean run."""
        if overflow:
            self.scale *= self.backoff
            self.clean_steps = 0
            self.skipped += 1
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.scale *= self.growth
            self.clean_steps = 0

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self.clean_steps, self.skipped = int(state["clean_steps"]), int(state["skipped"])


def make_scaler(
    dtype: str, init_scale: float = 2.0**16, growth_interval: int = 1000
) -> LossScaler | None:
    """A LossScaler for fp16, None otherwise (bf16 and fp32 have fp32's exponent range)."""
    return LossScaler(init_scale, growth_interval) if dtype == "fp16" else None
