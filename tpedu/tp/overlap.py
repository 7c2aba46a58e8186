"""Lesson 15: hide the column-parallel layer's backward all-reduce behind its weight-gradient
matmul.

A column-parallel linear y = f(x)·Wᵀ + b (tpedu.tp.layers) runs in backward, one after another:

    f's all-reduce of dL/dx      (waits on the wire)
    dL/dx = dL/dy · W            (matmul)       — autograd runs F.linear's backward first,
    dL/dW = dL/dyᵀ · x           (matmul)         then f's, so nothing overlaps

But dL/dW does not need the all-reduced dL/dx. Megatron-LM's LinearWithGradAccumulationAndAsync-
Communication fuses f into the linear layer so backward can do:

    dL/dx = dL/dy · W
    issue all-reduce(dL/dx), async   ─┐ on the wire (NCCL stream / gloo's thread)
    dL/dW = dL/dyᵀ · x, dL/db        ─┘ meanwhile, on the compute units
    wait; return dL/dx

Same arithmetic in the same order, so the results are bitwise those of the unfused layer; only
the timeline changes. The rank clock (tpedu.comm.recorder) shows the order: the all-reduce
issued asynchronously, the compute span labelled "weight grad", then the wait; the gain is
measured in benchmarks/bench_overlap.py. In the model it is switched on by
GPTConfig(overlap_comm=True): `tpedu.tp.layers.column_parallel_linear(...,
async_grad_all_reduce=True)` in front of QKV, fc1 and the vocab-parallel head.

(On GPUs Megatron also sets CUDA_DEVICE_MAX_CONNECTIONS=1 so the all-reduce's kernel is
scheduled before the weight-gradient GEMM; with gloo on CPU the collective runs on gloo's own
thread.)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tpedu.comm import collectives, recorder


class LinearWithAsyncGradAllreduce(torch.autograd.Function):
    """Column-parallel linear with f fused in: x [..., in] -> x·Wᵀ + b [..., out/t].

    Forward: no communication. Backward: 1 all-reduce of dL/dx [..., in], issued before and
    overlapped with dL/dW [out/t, in] and dL/db [out/t].
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.group = bias is not None, group
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        # Under autocast the forward ran in grad's dtype (bf16): the backward matmuls too.
        x, weight = x.to(grad.dtype), weight.to(grad.dtype)
        grad_x = work = None
        if ctx.needs_input_grad[0]:
            grad_x = grad.matmul(weight)  # [..., in]: this rank's share of dL/dx
            work = collectives.all_reduce(grad_x, ctx.group, async_op=True)
        with recorder.label("weight grad"):  # the rank clock's span beside the all-reduce
            g2, x2 = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
            grad_w = g2.t().matmul(x2) if ctx.needs_input_grad[1] else None  # while it runs
            grad_b = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if work is not None:
            work.wait()
        return grad_x, grad_w, grad_b, None


def linear_with_async_grad_all_reduce(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Drop-in for `tpedu.tp.layers.column_parallel_linear(x, weight, bias, group)`.

    x [..., in] (replicated), weight [out/t, in], bias [out/t] or None -> [..., out/t].
    Forward: none. Backward: 1 all-reduce of dL/dx, overlapped with the weight gradient.
    """
    return LinearWithAsyncGradAllreduce.apply(x, weight, bias, group)
