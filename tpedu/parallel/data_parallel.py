"""Lesson 12: data parallelism (数据并行): every DP rank holds the same model, sees its own slice of
the batch, and the gradients are averaged before the optimizer step.

    DataParallel(model, group)   gradient all-reduce in buckets, launched from backward hooks

(ZeRO, which shards the optimizer states, gradients and parameters over the DP ranks, is
tpedu.parallel.zero.)

Buckets: parameters are grouped in reverse registration order (roughly the order backward
produces their gradients) into buckets of about `bucket_numel` elements. A hook registered with
`register_post_accumulate_grad_hook` counts the gradients that arrived; when a bucket is full its
gradients are flattened and an *asynchronous* all-reduce starts, while autograd keeps computing the
earlier layers' gradients: communication overlaps the rest of backward (the tracer sees these
all-reduces in the 'backward' phase). `finish()` waits for them and writes the averages back.

Per step: one all-reduce per bucket, Σ bucket sizes = all parameters (ring: 2·(N-1)/N of the
gradient bytes sent per rank). Gradient accumulation: backward inside `no_sync()` only
accumulates into .grad; the last micro-batch's backward (outside it) reduces the sum.
Averaging is right when the loss is a mean over each rank's batch: the mean of N per-rank means
over equal-sized batches is the mean over the global batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
import torch._dynamo  # optimizers import it (≈3-5 s): once here, not per forked rank
import torch.distributed as dist
from torch import nn

from tpedu.comm import collectives


def assign_buckets(numels: Sequence[int], bucket_numel: int) -> list[list[int]]:
    """Group parameter indices into buckets, walking from the LAST parameter to the first (the
    order backward produces gradients); a bucket closes as soon as it holds ≥ bucket_numel
    elements. numels [7, 3, 5, 2], bucket_numel 6 -> [[3, 2], [1, 0]]."""
    if bucket_numel < 1:
        raise ValueError(f"bucket_numel must be at least 1, got {bucket_numel}")
    buckets: list[list[int]] = []
    current: list[int] = []
    for i in reversed(range(len(numels))):
        current.append(i)
        if sum(numels[j] for j in current) >= bucket_numel:
            buckets.append(current)
            current = []
    return buckets + [current] if current else buckets


def all_reduce_bucket(
    grads: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None
) -> list[torch.Tensor]:
    """Average tensors of any shapes over the group with ONE all-reduce: flatten them into one
    buffer, all-reduce it, divide by the group size, and cut it back into the original shapes.
    Returns new tensors (the inputs are unchanged)."""
    flat = torch.cat([g.reshape(-1) for g in grads])
    collectives.all_reduce(flat, group)
    flat /= dist.get_world_size(group)
    out, offset = [], 0
    for g in grads:
        out.append(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
    return out


def split_by_group(
    params: Sequence[nn.Parameter],
    group: dist.ProcessGroup | None,
    group_of: Callable[[nn.Parameter], dist.ProcessGroup | None] | None,
) -> list[tuple[dist.ProcessGroup | None, list[nn.Parameter]]]:
    """[(group, its parameters in order)]: `group` first, then any other `group_of` names, in
    the order they first appear. A bucket holds one group's gradients: one all-reduce each."""
    out: dict[int, tuple[dist.ProcessGroup | None, list[nn.Parameter]]] = {id(group): (group, [])}
    for p in params:
        g = group_of(p) if group_of is not None else group
        out.setdefault(id(g), (g, []))[1].append(p)
    return [(g, ps) for g, ps in out.values() if ps]


class _Bucket:
    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup | None) -> None:
        self.params, self.group = params, group
        self.ready = 0
        self.buf: torch.Tensor | None = None
        self.work: dist.Work | None = None


class GradientSync:
    """What DataParallel and ZeRO (tpedu.parallel.zero) share: `sync`, whether their
    backward hooks reduce now, and `no_sync()` for the micro-batches that only accumulate."""

    sync = True

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward inside this only accumulates gradients (no reduction)."""
        self.sync = False
        try:
            yield
        finally:
            self.sync = True


class DataParallel(GradientSync):
    """Average the gradients of `module` over the DP `group`, bucket by bucket, during backward.

    Usage per step:
        loss.backward()        # buckets all-reduce as soon as their gradients are complete
        dp.finish()            # wait; .grad now holds the average over the DP ranks
    With accumulation: `with dp.no_sync(): loss_i.backward()` for all but the last micro-batch.
    Every DP rank must run the same backward (same graph), so buckets start in the same order.
    `reduce_dtype` (e.g. torch.bfloat16) sends the buckets in that dtype: half the bytes of
    fp32, and the sum of N replicas rounded at every step of the ring (lesson 16 measures it).
    Its timeline (lesson 12) is the rank's recording: tpedu.comm.recorder logs every bucket's
    asynchronous all-reduce as issued and when it was waited on.

    `group_of(p)`: the group parameter p's gradient is summed over, where it is not `group`
    (tpedu.train.optim.gradient_groups reads it from each parameter's placements: an expert
    split over ep is summed over the ranks holding the same experts only). Each group's
    parameters get buckets of their own. `mean_over`: the divisor (default: `group`'s size),
    the number of replicas whose batches differ, for every bucket: an expert's sum over its
    replicas is still divided by the whole DP size, as Megatron-core does, because the
    all-to-all's backward has already summed every EP rank's tokens into it.
    """

    def __init__(
        self,
        module: nn.Module,
        group: dist.ProcessGroup | None = None,
        bucket_numel: int = 2**16,
        reduce_dtype: torch.dtype | None = None,
        group_of: Callable[[nn.Parameter], dist.ProcessGroup | None] | None = None,
        mean_over: int | None = None,
    ) -> None:
        self.module, self.group, self.reduce_dtype = module, group, reduce_dtype
        self.size = mean_over or dist.get_world_size(group)
        self.sync = True
        trained = [p for p in module.parameters() if p.requires_grad]
        by_group = split_by_group(trained, group, group_of)
        self.buckets = [
            _Bucket([params[i] for i in b], reduce_over)
            for reduce_over, params in by_group
            for b in assign_buckets([p.numel() for p in params], bucket_numel)
        ]
        self.launched: list[_Bucket] = []  # in launch order (the same on every DP rank)
        for bucket in self.buckets:
            for p in bucket.params:
                p.register_post_accumulate_grad_hook(self._hook(bucket))

    def _hook(self, bucket: _Bucket) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            if not self.sync:
                return
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                self._launch(bucket)

        return hook

    def _launch(self, bucket: _Bucket) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
        bucket.buf = torch.cat([g.reshape(-1) for g in grads])  # one message, not one per tensor
        if self.reduce_dtype is not None:
            bucket.buf = bucket.buf.to(self.reduce_dtype)
        if dist.get_world_size(bucket.group) > 1:
            bucket.work = collectives.all_reduce(bucket.buf, bucket.group, async_op=True)
        self.launched.append(bucket)

    def finish(self) -> None:
        """Start any bucket whose gradients never all arrived (unused parameters), wait for all,
        and write each averaged gradient back into .grad."""
        for bucket in self.buckets:
            if bucket not in self.launched:
                self._launch(bucket)
        for bucket in self.launched:
            if bucket.work is not None:
                bucket.work.wait()
            offset = 0
            for p in bucket.params:
                g = bucket.buf[offset : offset + p.numel()].view_as(p).to(p.dtype) / self.size
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)
                offset += p.numel()
            bucket.ready, bucket.buf, bucket.work = 0, None, None
        self.launched = []


def all_reduce_grads(params: Iterable[nn.Parameter], group: dist.ProcessGroup | None = None) -> int:
    """The unbucketed baseline: one blocking all-reduce per parameter, after backward.

    Averages each .grad over the group; returns the number of all-reduces run."""
    n, size = 0, dist.get_world_size(group)
    for p in params:
        if p.grad is not None:
            collectives.all_reduce(p.grad, group)
            p.grad.div_(size)
            n += 1
    return n
