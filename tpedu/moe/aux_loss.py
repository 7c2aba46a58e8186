"""Lesson 18: how a layer's auxiliary losses reach backward without travelling with the output.

A GPT's MoE layers each compute a load-balancing loss and a z-loss (tpedu.moe.router). Adding
them to the language-model loss would carry one scalar per layer through every block after it,
and through the pipeline's stages, which send only activations. Instead each layer attaches
its weighted losses to its own output y (Megatron-core's MoEAuxLossAutoScaler):

    forward:  y unchanged
    backward: dL/dy passes through, and the attached loss gets the gradient `scale`: what it
              would get had it been added to the loss the step's backward starts from

The loss a step reports is the language model's alone. `scale` is 1 for a plain
`loss.backward()`; a step that backpropagates (loss / m) · S (m micro-batches, S fp16's loss
scale) runs its backward inside `aux_loss_scale(S / m)`, so each micro-batch's auxiliary losses
weigh as its language-model loss does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_scale = [1.0]  # what backward gives an attached loss; set by aux_loss_scale


@contextlib.contextmanager
def aux_loss_scale(scale: float) -> Iterator[None]:
    """Inside: attached auxiliary losses get gradient `scale` in backward (default 1)."""
    _scale.append(scale)
    try:
        yield
    finally:
        _scale.pop()


class AttachAuxLoss(torch.autograd.Function):
    """y -> y in forward; in backward y's gradient unchanged and `loss` (a scalar) gets
    the current aux_loss_scale. An autograd Function, not a hook: the loss's gradient must
    enter the graph at the moment y's does, on whichever stage and micro-batch it belongs to."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(loss)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (loss,) = ctx.saved_tensors
        return grad, torch.full_like(loss, _scale[-1])


def attach_aux_loss(y: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """y, with `loss` (a scalar that requires grad) attached for backward; y itself if the loss
    needs no gradient (coefficients 0, or no grad mode)."""
    if not (torch.is_grad_enabled() and loss.requires_grad):
        return y
    return AttachAuxLoss.apply(y, loss)
