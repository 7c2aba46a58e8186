"""Lesson 18: expert parallelism: the experts split over the EP ranks, each token sent to the
rank of its expert and back (GShard, Switch; Megatron-core, torchtitan).

EP is carved from the data-parallel ranks: every EP rank holds DIFFERENT tokens, the router
(and the shared expert) replicated, and E/ep experts: rank r holds experts [r·E/ep, (r+1)·E/ep).

    x [T, H] ─► router (local) ─► capacity among this rank's T tokens ─► sort assignments by expert
      ─► all-to-all of the counts [E] ─► all-to-all of the tokens [A, H] ─► rows from every rank
      ─► local expert j on its contiguous slice ─► all-to-all back [A, H] ─► weight, sum per token
      ─► (+ shared expert) ─► y [T, H]

This equals DenseMoE(groups=ep) fed the ranks' tokens concatenated in rank order: capacity is
applied per rank (as per group), and the statistics of the auxiliary losses (routed counts,
probability sums, z-loss sum, token count) are summed over the group, so aux_loss and z_loss
are the dense values over all the group's tokens, on every rank.

Communication per forward, on rank r (A_r: assignments it keeps and sends, R_r: assignments it
receives, N_rr of each staying on r; H: hidden; elements, times the dtype's size for bytes):
    all_reduce  3E + 2        the statistics (float: in float32 at least, so counts stay exact)
    all_to_all  E             the counts per expert (int64)
    all_to_all  A_r·H         dispatch: (A_r - N_rr)·H leave the rank
    all_to_all  R_r·H         combine:  (R_r - N_rr)·H leave the rank
Backward, in reverse: combine's all_to_all of A_r·H (the gradients of what came back go to the
expert ranks) and dispatch's of R_r·H (the gradients of the tokens go home); plus one
all_reduce of 3E + 2 when aux_loss or z_loss is in the loss (use them on every rank or on
none: it is a collective). Dropless and balanced, A_r = R_r = T·k, and (ep - 1)/ep of it
leaves each rank.

Gradient semantics. The dense reference's loss J is a mean over all the group's N = ep·T tokens
(plus c·aux + c'·z); each EP rank's loss L_r is the mean over its own T tokens (plus the same
c·aux + c'·z), so J = (1/ep)·Σ_r L_r. Backward on the EP ranks computes gradients of Σ_r L_r =
ep·J:
    replicated parameters (router, shared expert): each rank holds its tokens' part (the aux
        and z parts already summed over ranks by all_reduce_sum's backward): sum over the group
        and divide by ep, the DP mean that DataParallel takes.
    expert parameters: NOT replicated: the all-to-all backward already brought every rank's
        tokens' gradient to the expert's one copy. Divide by ep, no communication. (Megatron-core
        scales expert gradients by 1/(full DP size) and sums them over the expert-data-parallel
        group only: here that group is one rank.) Averaging them over the EP group instead mixes
        different experts' gradients (expert j on rank r with expert j on rank r'): wrong.
    the input: dL_r/dx = ep · dJ/dx for this rank's tokens (as in data parallelism).
`reduce_gradients()` does exactly this; `expert_parameters()` and `replicated_parameters()` name
the two sets. The module declares the experts' placement, Shard(0) over "ep" (its
`placements`; tpedu.comm.placement), and DataParallel's and ZeRO's groups, the gradient norm and
the checkpoint writer read it there: they reduce the expert ones over the expert-data-parallel
group only.

On the meta device (lesson 13's dry run) the router still runs (shapes), but which experts it
chooses cannot be computed: the forward then assumes balanced routing (`balanced_routing`:
T·k/E assignments per expert, the same from every rank) for the counts and index sizes, and
runs the same operators on tensors of those sizes, so it saves and sends what a real run
routed so would.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from tpedu.comm import collectives
from tpedu.comm.placement import Shard, declared, sharded_on
from tpedu.moe.dense import DenseMoE, MoEOutput
from tpedu.moe.dispatch import all_reduce_sum, all_to_all_tokens, exchange_counts, expert_major
from tpedu.moe.router import capacity, keep_mask, load_balancing_loss
from tpedu.tp.mlp import ParallelMLP
from tpedu.tp.sharding import divisors


def check_experts_divide(experts: int, ep: int) -> None:
    """Raise a one-line ValueError unless ep divides the number of experts."""
    if ep < 1 or experts % ep:
        valid = ", ".join(str(d) for d in divisors(experts))
        raise ValueError(
            f"experts = {experts} is not divisible by ep = {ep}; choose ep among {valid} "
            "(or a number of experts that ep divides)"
        )


@dataclass(frozen=True)
class BalancedRouting:
    """Assignments per expert of one rank's T tokens under `balanced_routing`: routed [E] (the
    router's choices, before capacity) and kept [E] (after it); each sums over the experts."""

    routed: list[int]
    kept: list[int]


def balanced_routing(
    tokens: int, experts: int, top_k: int, capacity_factor: float | None
) -> BalancedRouting:
    """The dry run's routing rule (meta tensors have no values, so the router's choices cannot
    be computed): *balanced routing*, the load that the load-balancing loss aims for. Each of
    the T = `tokens` tokens sends k assignments, spread evenly over the E experts: expert e
    gets floor(T·k/E), and the first (T·k mod E) experts one more, so the counts are integers
    and sum to T·k (a fixed rule: the dry run of a layout is the same every time). With a
    capacity factor each expert keeps min(that, C), C = ceil(cf·T·k/E) (tpedu.moe.router.
    capacity): balanced, nothing is dropped unless cf < 1. Every EP rank routes its T tokens
    alike, so it sends rank d the kept assignments of d's experts, the same number from every
    rank, and receives ep times its own experts' counts. Where T·k/E is an integer (the usual
    case) every expert, and so every EP rank, gets the same; the dry run measures one EP rank
    per count where it is not (tpedu.analysis.dryrun's rank_class)."""
    per, extra = divmod(tokens * top_k, experts)
    routed = [per + (e < extra) for e in range(experts)]
    cap = capacity(tokens, experts, top_k, capacity_factor)
    return BalancedRouting(routed, [min(c, cap) for c in routed])


@dataclass(frozen=True)
class MetaRouting:
    """What ExpertParallelMoE's forward reads off the routing's values, on the meta device:
    counts per expert [E] and the index tensors (meta, long) with the sizes balanced routing
    gives them (order [A]: this rank's kept assignments; by_expert [R]: the rows received),
    the all-to-alls' counts per rank, the local experts' rows and the group's dropped count."""

    routed: torch.Tensor
    kept: torch.Tensor
    order: torch.Tensor
    send: list[int]
    recv: list[int]
    by_expert: torch.Tensor
    sizes: list[int]
    dropped: int


class ExpertParallelMoE(nn.Module):
    """DenseMoE with its experts split over the EP `group`, built from the dense module (the
    same on every rank): x [..., H] (this rank's tokens) -> MoEOutput (y [..., H]).

    router, shared: copies of the dense ones (replicated); experts: nn.ModuleDict of this rank's
    E/ep experts keyed by their global index (so parameter names are DenseMoE's: experts.5.fc1.
    weight on the rank holding expert 5). Capacity: this rank's tokens form one group
    (dense.groups is ignored; compare with DenseMoE(groups=ep)).
    `tp_group` (a GPT's TP group; x is then the same on all its ranks, so all route alike): the
    experts and the shared expert become ParallelMLPs, fc1 column- and fc2 row-split, one
    all-reduce over TP per expert forward and backward. Splitting each expert keeps TP's memory
    saving for the experts too, and the EP all-to-all then carries each TP rank's tokens once
    (among the ranks of its own tp index), as Megatron-core's expert-tensor-parallel = tp.
    Forward: 1 all-reduce, 3 all-to-alls; backward: 2 all-to-alls (+1 all-reduce if aux_loss or
    z_loss is in the loss); sizes in the module docstring. `last_send_counts`: the assignments
    the last forward sent to each rank.
    """

    def __init__(
        self,
        dense: DenseMoE,
        group: dist.ProcessGroup | None = None,
        tp_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.group = group
        self.ep, self.rank = dist.get_world_size(group), dist.get_rank(group)
        check_experts_divide(dense.n_experts, self.ep)
        self.hidden, self.n_experts, self.top_k = dense.hidden, dense.n_experts, dense.top_k
        self.capacity_factor = dense.capacity_factor
        self.local_experts = dense.n_experts // self.ep
        self.first_expert = self.rank * self.local_experts
        self.router = copy.deepcopy(dense.router)

        def local(mlp: nn.Module) -> nn.Module:
            return copy.deepcopy(mlp) if tp_group is None else ParallelMLP.from_dense(mlp, tp_group)

        self.shared = None if dense.shared is None else local(dense.shared)
        mine = range(self.first_expert, self.first_expert + self.local_experts)
        self.experts = nn.ModuleDict({str(i): local(dense.experts[i]) for i in mine})
        self.last_send_counts: list[int] = []

    # Over ep, this rank holds E/ep of the experts (stacked along a new dim 0, slice
    # first_expert ..): their gradients are its own, never summed with another EP rank's.
    placements = {"experts.": {"ep": Shard(0)}}

    @classmethod
    def from_dense(
        cls,
        dense: DenseMoE,
        group: dist.ProcessGroup | None = None,
        tp_group: dist.ProcessGroup | None = None,
    ) -> ExpertParallelMoE:
        """Split a DenseMoE (same weights on every rank) over the EP group (and each expert
        over `tp_group`)."""
        return cls(dense, group, tp_group)

    def forward(self, x: torch.Tensor) -> MoEOutput:
        """x [..., H] (this rank's tokens) -> MoEOutput: y [..., H], logits [T, E] of these
        tokens; aux_loss, z_loss, tokens_per_expert, dropped over all the group's tokens.
        On the meta device (a dry run) the routing is assumed balanced: `balanced_routing`."""
        x2 = x.reshape(-1, self.hidden)
        e, k = self.n_experts, self.top_k
        r = self.router(x2)
        meta = self._meta_routing(x2) if x2.device.type == "meta" else None
        if meta is None:
            keep = keep_mask(r.experts, e, self.capacity_factor).reshape(-1)
            expert = r.experts.reshape(-1)  # assignment a = t·k + j: token t's j-th choice
            routed = torch.bincount(expert, minlength=e)
            kept = torch.bincount(expert[keep], minlength=e)
        else:
            routed, kept = meta.routed, meta.kept

        # One all-reduce for every statistic; float32 at least, so the counts add exactly.
        dtype = torch.promote_types(r.probs.dtype, torch.float32)
        local = [routed, kept, r.probs.sum(dim=0), r.logits.logsumexp(dim=-1).square().sum()[None]]
        local.append(torch.tensor([x2.shape[0]], device=x.device))
        stats = all_reduce_sum(torch.cat([s.to(dtype) for s in local]), self.group)
        routed_all, kept_all, prob_sums, z_sum, tokens = stats.split([e, e, e, 1, 1])
        routed_all, kept_all, tokens = routed_all.detach(), kept_all.detach(), tokens[0].detach()

        # Sorted by expert, the rows for rank d's experts are one contiguous chunk; the stable
        # sort keeps token order inside each expert, as DenseMoE's loop does.
        received = exchange_counts(kept, self.group)  # [ep, E/ep]
        if meta is None:
            kept_at = keep.nonzero()[:, 0]
            order = kept_at[torch.argsort(expert[kept_at], stable=True)]
            send = kept.reshape(self.ep, -1).sum(dim=1).tolist()
            recv = received.sum(dim=1).tolist()
            by_expert = expert_major(received)
            sizes = received.sum(dim=0).tolist()
        else:
            order, by_expert = meta.order, meta.by_expert
            send, recv, sizes = meta.send, meta.recv, meta.sizes
        self.last_send_counts = send
        got = all_to_all_tokens(x2[order // k], send, recv, self.group)  # source-major
        slices = got[by_expert].split(sizes)
        out = torch.cat([mlp(s) for mlp, s in zip(self.experts.values(), slices, strict=True)])
        back = all_to_all_tokens(out[torch.argsort(by_expert)], recv, send, self.group)

        weights = r.weights.reshape(-1)[order, None]
        y = x2.new_zeros(x2.shape).index_add(0, order // k, back * weights)
        if self.shared is not None:
            y = y + self.shared(x2)
        dropped = int((routed_all.sum() - kept_all.sum()).item()) if meta is None else meta.dropped
        return MoEOutput(
            y.reshape(x.shape),
            r.logits,
            load_balancing_loss(routed_all, prob_sums, tokens, k),
            z_sum[0] / tokens,
            kept_all.round().long(),
            dropped,
        )

    # --- the dry run's path (meta tensors: shapes only) ----------------------------------------

    def _meta_routing(self, x2: torch.Tensor) -> MetaRouting:
        """What the real path reads off the routing's values, for x2 on the meta device:
        `balanced_routing`'s counts, and meta index tensors of the sizes they give."""
        b = balanced_routing(x2.shape[0], self.n_experts, self.top_k, self.capacity_factor)
        n = self.local_experts
        send = [sum(b.kept[d * n : (d + 1) * n]) for d in range(self.ep)]  # to d's experts
        local = b.kept[self.first_expert : self.first_expert + n]
        recv = [sum(local)] * self.ep  # every EP rank routes its T tokens alike

        def index(size: int) -> torch.Tensor:  # shapes only: no value is ever read
            return torch.empty(size, dtype=torch.long, device=x2.device)

        return MetaRouting(
            routed=index(self.n_experts),
            kept=index(self.n_experts),
            order=index(sum(send)),
            send=send,
            recv=recv,
            by_expert=index(sum(recv)),
            sizes=[self.ep * c for c in local],
            dropped=self.ep * (sum(b.routed) - sum(b.kept)),
        )

    def expert_parameters(self) -> list[nn.Parameter]:
        """This rank's experts' parameters: not replicated over the EP group."""
        return list(self.experts.parameters())

    def replicated_parameters(self) -> list[nn.Parameter]:
        """The router's and the shared expert's parameters: the same on every EP rank."""
        placed = declared(self)
        return [p for n, p in self.named_parameters() if not sharded_on(placed[n], "ep")]

    def reduce_gradients(self) -> None:
        """After backward, the DP step of a group that is all EP (see the module docstring):
        replicated .grad -> mean over the group (1 all-reduce of their elements); expert .grad
        -> divided by ep (no communication). Then .grad is dJ/dθ of the dense mean loss."""
        reps = [p for p in self.replicated_parameters() if p.grad is not None]
        if reps:
            flat = torch.cat([p.grad.reshape(-1) for p in reps])
            collectives.all_reduce(flat, self.group)
            offset = 0
            for p in reps:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p) / self.ep)
                offset += p.numel()
        for p in self.expert_parameters():
            if p.grad is not None:
                p.grad /= self.ep

    def extra_repr(self) -> str:
        last = self.first_expert + self.local_experts - 1
        return (
            f"experts={self.n_experts}, ep={self.ep}, rank {self.rank}: {self.first_expert}..{last}"
        )
