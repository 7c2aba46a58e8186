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

from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
import torch.distributed as dist

from tpedu.comm import collectives

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(dtype: str, device: torch.device) -> AbstractContextManager:
    """The forward's precision context: autocast to `dtype` ("bf16", "fp16"), or nothing. On
    the meta device (lesson 13's dry run), which torch.autocast refuses, `meta_autocast`."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    if dtype == "fp32":
        return nullcontext()
    if device.type == "meta":
        return meta_autocast(DTYPES[dtype])
    return torch.autocast(device.type, dtype=DTYPES[dtype])


# CPU autocast's op lists, as far as tpedu's model calls them (torch.Tensor.__matmul__ is `@`):
# ops that run in the low dtype, and ops that run in fp32. CUDA's lists agree on these; they
# differ on ops CUDA runs in fp32 and the CPU in the low dtype (softmax, exp), which only the
# explicit attention paths call (dropout, the ring).
_LOWER = (
    (torch.nn.functional, "linear"),
    (torch.nn.functional, "scaled_dot_product_attention"),
    (torch, "matmul"),
    (torch.Tensor, "matmul"),
    (torch.Tensor, "__matmul__"),
)
_FP32 = ((torch.nn.functional, "cross_entropy"),)


@contextmanager
def meta_autocast(dtype: torch.dtype) -> Iterator[None]:
    """torch.autocast's casts for meta tensors, which have no autocast dispatch key: while
    active, the ops of `_LOWER` cast their fp32 meta inputs to `dtype` first, and a weight (an
    fp32 leaf that requires grad) once for the whole context, as autocast's cast cache does;
    those of `_FP32` cast low-precision inputs to fp32. So the copies saved for backward are
    those of a CPU autocast run (tests/test_dryrun.py compares them). The functions are
    patched, not intercepted by a mode: checkpointed blocks recompute inside backward, where a
    mode entered here would not reach."""
    cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def cast(t: object) -> object:
        if not (isinstance(t, torch.Tensor) and t.device.type == "meta"):
            return t
        if not t.is_floating_point() or t.dtype in (torch.float64, dtype):
            return t
        if t.dtype == torch.float32 and t.requires_grad and t.is_leaf and not t._is_view():
            if id(t) not in cache:  # keep t alive with its copy: its id is not reused meanwhile
                cache[id(t)] = (t, t.to(dtype))
            return cache[id(t)][1]
        return t.to(dtype)

    def widen(t: object) -> object:
        meta = isinstance(t, torch.Tensor) and t.device.type == "meta"
        return t.float() if meta and t.dtype in (torch.bfloat16, torch.float16) else t

    def casting(fn: Callable, to: Callable) -> Callable:
        def op(*args: object, **kwargs: object) -> object:
            return fn(*map(to, args), **{k: to(v) for k, v in kwargs.items()})

        return op

    originals = [(owner, name, getattr(owner, name), cast) for owner, name in _LOWER]
    originals += [(owner, name, getattr(owner, name), widen) for owner, name in _FP32]
    for owner, name, fn, to in originals:
        setattr(owner, name, casting(fn, to))
    try:
        yield
    finally:
        for owner, name, fn, _ in originals:
            setattr(owner, name, fn)


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
