"""Lesson 18: DenseMoE, the single-process mixture of experts that expert parallelism is held
against: every expert on this process, no communication.

    x [..., H] ─► router ─► top-k experts and weights per token ─► capacity (drop the overflow)
               └─► expert e (a DenseMLP) on its kept tokens, × weight, summed per token ─► y [..., H]
               └─► shared expert (DeepSeek) on every token, added ───────────────────────┘

y[t] = Σ_{kept (t, j)} weights[t, j] · expert_{experts[t, j]}(x[t])  (+ shared(x[t])).
A dropped assignment contributes nothing (the caller's residual carries the token on); its
weight is not handed to the other choice.

Capacity applies per group: the N tokens are cut into `groups` equal, consecutive groups and
each expert takes at most C = ceil(capacity_factor · N/groups · k / E) from each (priority:
tpedu.moe.router.capacity_mask). With groups = ep, this is exactly what ExpertParallelMoE does
when rank r holds group r, each rank dropping among its own tokens before dispatch (as
Megatron-core and torchtitan do). The auxiliary losses are over all N tokens, every group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tpedu.moe.router import (
    Router,
    check_capacity_factor,
    keep_mask,
    load_balancing_loss,
    z_loss,
)
from tpedu.tp.dense import DenseMLP, check_activation


@dataclass
class MoEOutput:
    """What a mixture-of-experts layer returns.

    y [..., H]; logits [T, E] (this process's T tokens); aux_loss, z_loss: scalars over all the
    tokens (expert parallelism: every rank of the group); tokens_per_expert [E] (long): kept
    assignments per expert, all tokens; dropped: assignments dropped by capacity, all tokens.
    """

    y: torch.Tensor
    logits: torch.Tensor
    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    tokens_per_expert: torch.Tensor
    dropped: int


def check_moe_activation(activation: str) -> None:
    """Raise a one-line ValueError unless the experts' activation is one DenseMLP offers."""
    check_activation(activation)


class DenseMoE(nn.Module):
    """A mixture-of-experts layer on one process: x [..., H] -> MoEOutput (y [..., H]).

    router: Router (gate H -> E, no bias); experts: nn.ModuleList of E DenseMLP(H, F,
    activation, bias), no dropout; shared: one more DenseMLP every token goes through, or None.
    capacity_factor None is dropless; groups: how many equal groups capacity is applied in.

    Many parameters because they are the layer's hyperparameters, as DenseAttention's are.
    """

    def __init__(
        self,
        hidden: int,
        ffn_hidden: int,
        experts: int,
        top_k: int = 2,
        activation: str = "gelu",
        bias: bool = True,
        renormalize: bool = True,
        shared_expert: bool = False,
        capacity_factor: float | None = None,
        groups: int = 1,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_moe_activation(activation)
        check_capacity_factor(capacity_factor)
        if groups < 1:
            raise ValueError(f"groups = {groups}: use groups >= 1 (1: capacity over all tokens)")
        self.hidden, self.ffn_hidden, self.n_experts, self.top_k = (
            hidden,
            ffn_hidden,
            experts,
            top_k,
        )
        self.activation, self.capacity_factor, self.groups = activation, capacity_factor, groups
        self.router = Router(hidden, experts, top_k, renormalize, dtype)
        mlp = lambda: DenseMLP(hidden, ffn_hidden, activation, bias, dtype=dtype)
        self.experts = nn.ModuleList(mlp() for _ in range(experts))
        self.shared = mlp() if shared_expert else None

    def forward(self, x: torch.Tensor) -> MoEOutput:
        """x [..., H] -> MoEOutput; the tokens are x's rows in order, cut into `groups`."""
        x2 = x.reshape(-1, self.hidden)
        n, e = x2.shape[0], self.n_experts
        r = self.router(x2)
        keep = keep_mask(r.experts, e, self.capacity_factor, self.groups)
        routed = torch.bincount(r.experts.reshape(-1), minlength=e)
        kept = torch.bincount(r.experts[keep], minlength=e)
        y = x2.new_zeros(x2.shape)
        for i, expert in enumerate(self.experts):
            # every expert runs, on no tokens too, so that each has a gradient (zero) as in EP
            token, choice = torch.nonzero((r.experts == i) & keep, as_tuple=True)
            y = y.index_add(0, token, r.weights[token, choice, None] * expert(x2[token]))
        if self.shared is not None:
            y = y + self.shared(x2)
        return MoEOutput(
            y.reshape(x.shape),
            r.logits,
            load_balancing_loss(routed, r.probs.sum(dim=0), n, self.top_k),
            z_loss(r.logits),
            kept,
            int(routed.sum() - kept.sum()),
        )

    def extra_repr(self) -> str:
        return (
            f"hidden={self.hidden}, ffn_hidden={self.ffn_hidden}, experts={self.n_experts}, "
            f"top_k={self.top_k}, capacity_factor={self.capacity_factor}, groups={self.groups}"
        )
