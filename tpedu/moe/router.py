"""Lesson 18: the router of a mixture of experts: which experts each token goes to, with which
weight, how many fit, and the two auxiliary losses that keep the router healthy.

    x [T, H] ─gate (H -> E, no bias)─► logits [T, E] ─softmax─► probs [T, E] ─top-k─► experts [T, k]
                                                                                      weights [T, k]

Combine weights: `renormalize=True` (Mixtral) divides the k chosen probabilities by their sum;
`renormalize=False` (Switch, DeepSeek) keeps the raw softmax probabilities. Top-1 renormalised
gives every token weight 1: the router then learns from the auxiliary losses only.

Capacity (GShard, Switch): an expert takes at most C = ceil(capacity_factor · T · k / E) of the
T·k assignments of a group of T tokens; the rest are dropped and contribute nothing. Who is
dropped is decided by one fixed priority, GShard's: every token's first choice comes before any
second choice, and within a choice, earlier tokens come first. capacity_factor None: dropless.

Auxiliary losses, returned for the caller to weigh with its own coefficients:

    load balancing (Switch / GShard)  aux = E · Σ_e f_e · P_e
        f_e = count_e / (T·k), the fraction of the top-k assignments routed to e (before any
              dropping; no gradient: a count)
        P_e = mean over the tokens of probs[:, e] (the gradient flows through it)
        aux = 1 when the load is uniform (f_e = P_e = 1/E), up to E when it all goes to one.
    router z-loss (ST-MoE)            z = mean over the tokens of logsumexp(logits)²
        keeps the logits small, so the softmax stays in a range where rounding does not bite.

No communication here: tpedu.moe.expert_parallel sums the same statistics over the EP group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

TOP_K = (1, 2)


def check_top_k(top_k: int, experts: int) -> None:
    """Raise a one-line ValueError unless top_k is 1 or 2 and at most `experts`."""
    if top_k not in TOP_K:
        raise ValueError(
            f"top_k = {top_k} is not supported; choose top_k = 1 (Switch) or 2 (GShard, Mixtral)"
        )
    if top_k > experts:
        raise ValueError(
            f"top_k = {top_k} is more than experts = {experts}; choose top_k <= experts"
        )


def check_capacity_factor(capacity_factor: float | None) -> None:
    """Raise a one-line ValueError unless capacity_factor is None (dropless) or a number > 0."""
    if capacity_factor is None:
        return
    ok = isinstance(capacity_factor, int | float) and not isinstance(capacity_factor, bool)
    if not ok or not math.isfinite(capacity_factor) or capacity_factor <= 0:
        raise ValueError(
            f"capacity_factor = {capacity_factor!r} is not a positive number; use e.g. 1.25, "
            "or None for no dropping (dropless)"
        )


def capacity(tokens: int, experts: int, top_k: int, capacity_factor: float | None) -> int:
    """Assignments one expert takes from a group of `tokens` tokens: ceil(cf · tokens · k / E);
    with capacity_factor None (dropless), all tokens · k of them."""
    if capacity_factor is None:
        return tokens * top_k
    return math.ceil(capacity_factor * tokens * top_k / experts)


def capacity_mask(experts: torch.Tensor, n_experts: int, capacity: int) -> torch.Tensor:
    """experts [T, k] (long) -> keep [T, k] (bool): assignment (t, j) is kept if fewer than
    `capacity` assignments to its expert come before it in GShard's priority: all first choices
    (j = 0, in token order), then all second choices (j = 1, in token order)."""
    order = experts.t().reshape(-1)  # priority order: choice-major, then token
    one_hot = nn.functional.one_hot(order, n_experts)  # [k·T, E]
    seen_before = (one_hot.cumsum(0) - one_hot).gather(1, order[:, None])[:, 0]
    return (seen_before < capacity).reshape(experts.shape[1], -1).t()


def keep_mask(
    experts: torch.Tensor, n_experts: int, capacity_factor: float | None, groups: int = 1
) -> torch.Tensor:
    """experts [T, k] -> keep [T, k] (bool): capacity applied to each of `groups` equal,
    consecutive groups of tokens on its own (GShard's groups; an EP rank's tokens are one)."""
    tokens, top_k = experts.shape
    if tokens % groups:
        raise ValueError(
            f"{tokens} tokens do not split into groups = {groups} equal groups; "
            "use a token count divisible by groups"
        )
    c = capacity(tokens // groups, n_experts, top_k, capacity_factor)
    return torch.cat([capacity_mask(g, n_experts, c) for g in experts.chunk(groups)])


@dataclass
class Routing:
    """The router's decision for T tokens: logits and probs [T, E]; experts [T, k] (long, the
    most probable first) and their combine weights [T, k]."""

    logits: torch.Tensor
    probs: torch.Tensor
    experts: torch.Tensor
    weights: torch.Tensor


class Router(nn.Module):
    """gate: nn.Linear(H, E, bias=False); x [T, H] -> Routing. Softmax and top-k run in the
    input's dtype (float64 in the tests)."""

    def __init__(
        self,
        hidden: int,
        experts: int,
        top_k: int = 2,
        renormalize: bool = True,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_top_k(top_k, experts)
        self.experts, self.top_k, self.renormalize = experts, top_k, renormalize
        self.gate = nn.Linear(hidden, experts, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> Routing:
        """x [T, H] -> Routing (logits, probs [T, E]; experts, weights [T, k])."""
        logits = self.gate(x)
        probs = logits.softmax(dim=-1)
        top, experts = probs.topk(self.top_k, dim=-1)  # sorted: first choice first
        weights = top / top.sum(dim=-1, keepdim=True) if self.renormalize else top
        return Routing(logits, probs, experts, weights)

    def extra_repr(self) -> str:
        return f"experts={self.experts}, top_k={self.top_k}, renormalize={self.renormalize}"


def load_balancing_loss(
    routed: torch.Tensor, prob_sums: torch.Tensor, tokens: int | torch.Tensor, top_k: int
) -> torch.Tensor:
    """aux = E · Σ_e f_e · P_e from sums over `tokens` tokens: routed [E] (top-k assignments per
    expert, before dropping), prob_sums [E] (Σ_t probs[t, e]). Sums, not means, so that expert
    parallelism can add them over its ranks first."""
    f = routed.to(prob_sums.dtype) / (tokens * top_k)
    return routed.numel() * (f * prob_sums / tokens).sum()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """Router z-loss: mean over the tokens of logsumexp(logits)²; logits [T, E] -> scalar."""
    return logits.logsumexp(dim=-1).square().mean()
