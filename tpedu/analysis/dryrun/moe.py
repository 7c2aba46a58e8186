"""Lessons 13–18: a dry run's mixture-of-experts layers (tpedu.moe) beside the ledger and the
what-if, which count dense MLPs: every difference an MoE layer makes, as named terms.

Routing is assumed balanced (`tpedu.moe.expert_parallel.balanced_routing`: meta tensors have
no values to route by): each EP rank's T = b·s/cp tokens per micro-batch send A = Σ_e kept_e
assignments (T·k dropless), spread evenly over the E experts, every EP rank alike, so a rank
receives R = ep · Σ_{its experts} kept_e rows (A = R = T·k when E divides T·k and nothing is
dropped). Sizes are those of the code (tpedu.moe.expert_parallel, tpedu.tp.mlp) in fp32:

    parameters      per MoE layer: the router [E, H] (replicated), E/ep experts and the shared
                    expert, each fc1 (and SwiGLU's up) column- and fc2 row-split over tp,
                    instead of the ledger's dense MLP
    activations     per MoE block forward held: router logits and probabilities [T, E], top-k
                    indices, the statistics; 5 index vectors (3 of A, 2 of R, int64); the
                    experts' input [R, H] and hidden [R, F_e/tp]; the returned rows [A, H],
                    their weights and the weighted rows [A, H]; the shared expert's hidden [T, F_e/tp]; instead of the
                    dense MLP's hidden [T, F/tp]
    ep traffic      per MoE layer and micro-batch: the statistics' all-reduce (3E + 2 fp32), the
                    counts' all-to-all (E int64), dispatch [A, H] and combine [R, H] forward,
                    their gradients backward (the all-to-alls' backward), the statistics'
                    all-reduce again in backward; full recompute reruns the forward's
    tp traffic      each expert's and the shared expert's all-reduces (R and T rows) instead
                    of the dense MLP's [b, s, H]

bf16 autocast is not itemised for MoE layers (the activations, TP and EP messages of a rank with
MoE layers are shown measured only: `not_itemised`), nor are ZeRO's flat buffers with ep > 1
(`unpriced_zero_ep`).
"""

from __future__ import annotations

from dataclasses import dataclass

from tpedu.analysis.dryrun.figures import VALUE_BYTES, Comparison, RankFigures, Term, count_noun
from tpedu.model.config import GPTConfig
from tpedu.moe.expert_parallel import balanced_routing
from tpedu.parallel.config import ParallelConfig

INDEX_BYTES = 8  # int64 indices and counts

ROUTING_NOTE = (
    "routing assumed balanced (meta tensors have no values to route by): each rank's T tokens "
    "send k assignments, T·k/E to each expert, every EP rank alike"
)
BF16_NOTE = (
    "bf16 autocast in the MoE layers is not itemised (each expert casts its own rows and "
    "weights); the measured figure equals a CPU autocast run's (tests/test_dryrun.py)"
)
ZERO_EP_NOTE = (
    "ZeRO with ep > 1 (the experts' flat buffers over edp) is not itemised: measured only"
)
ZERO_EP_FIGURES = (
    "weights",
    "gradients",
    "optimizer states",
    "whole parameters (peak)",
    "dp traffic",
    "ep traffic",
    "edp traffic",
)


def unpriced_zero_ep(comps: list[Comparison], parallel: ParallelConfig) -> list[Comparison]:
    """`comps`, the figures that ZeRO with ep > 1 changes (`ZERO_EP_FIGURES`) left without a
    prediction: the experts' own flat buffers (over edp) are not modelled here."""
    if not (parallel.zero and parallel.ep > 1):
        return comps
    return [
        Comparison(c.what, c.measured, None, c.source, note=ZERO_EP_NOTE)
        if c.what in ZERO_EP_FIGURES
        else c
        for c in comps
    ]


def not_itemised(fig: RankFigures, config: GPTConfig) -> bool:
    """Whether the activations, TP and EP messages of a rank with MoE layers go unpredicted:
    under bf16 autocast (the experts' rows and the combine's dtype then depend on each cast)."""
    return bool(config.experts) and fig.dtype != "fp32" and moe_blocks(config, fig) > 0


def mlp_params(config: GPTConfig, ffn: int, tp: int) -> int:
    """Parameters of one (Parallel)MLP of width `ffn` on one of tp ranks: fc1 (and SwiGLU's
    up) [ffn/tp, H] with their biases, fc2 [H, ffn/tp] and its replicated bias [H]."""
    h, f = config.hidden, ffn // tp
    columns = 2 if config.activation == "swiglu" else 1
    return columns * (h * f + (f if config.bias else 0)) + f * h + (h if config.bias else 0)


def moe_blocks(config: GPTConfig, fig: RankFigures) -> int:
    """MoE blocks (layers) this rank holds, over all its model chunks."""
    return sum(config.is_moe_layer(i) for a, b in fig.chunks for i in range(a, b))


@dataclass(frozen=True)
class MoELayer:
    """One MoE layer on this rank, one micro-batch, under balanced routing."""

    tokens: int  # T: this rank's tokens (b·s/cp; the same on every TP rank)
    sent: int  # A: kept assignments this rank dispatches
    received: int  # R: rows its experts receive from the EP group
    local: int  # E/ep experts here
    expert_params: int  # one expert's parameters on this TP rank


def moe_layer(config: GPTConfig, parallel: ParallelConfig, fig: RankFigures) -> MoELayer:
    """`MoELayer` of this rank from balanced routing (the dry run's rule)."""
    c, ep = config, parallel.ep
    tokens = fig.micro_batch * c.seq_len // parallel.cp
    kept = balanced_routing(tokens, c.experts, c.top_k, c.capacity_factor).kept
    local = c.experts // ep
    first = parallel.layout.expert_coords(fig.rank)["ep"] * local
    received = ep * sum(kept[first : first + local])
    return MoELayer(tokens, sum(kept), received, local, mlp_params(c, c.expert_ffn, parallel.tp))


def param_terms(fig: RankFigures, config: GPTConfig, parallel: ParallelConfig) -> list[Term]:
    """Parameters of this rank's MoE layers against the ledger's dense MLPs (as parameter
    counts; the memory comparisons scale them to bytes like every parameter term)."""
    n = moe_blocks(config, fig)
    if not n:
        return []
    c, t = config, parallel.tp
    layer = moe_layer(config, parallel, fig)
    what = f"{count_noun(n, 'MoE layer')}"
    terms = [
        Term(f"{what}: no dense MLP (width {c.ffn}, the ledger's)", -n * mlp_params(c, c.ffn, t)),
        Term(f"{what}: the router [E = {c.experts}, H], replicated", n * c.experts * c.hidden),
        Term(
            f"{what}: {layer.local} of the {c.experts} experts each (ep = {parallel.ep}), "
            f"width {c.expert_ffn} split over tp",
            n * layer.local * layer.expert_params,
        ),
    ]
    if c.shared_expert:
        terms.append(Term(f"{what}: the shared expert, split over tp", n * layer.expert_params))
    return terms


def activation_terms(
    fig: RankFigures, config: GPTConfig, parallel: ParallelConfig
) -> list[tuple[str, float]]:
    """(what, bytes) one MoE block forward saves beyond the dense block's, fp32, dropout 0:
    the router's, the statistics', the dispatch's index vectors, the experts', the combine's
    and the shared expert's, less the dense MLP's hidden. Full recompute: none (the block
    keeps its input only, as a dense one does)."""
    if parallel.recompute == "full" or not fig.moe_forwards:
        return []
    c, t, e, i = config, parallel.tp, VALUE_BYTES, INDEX_BYTES
    x = moe_layer(config, parallel, fig)
    T, A, R, E, k, h = x.tokens, x.sent, x.received, c.experts, c.top_k, c.hidden
    per_row = (4 if c.activation == "swiglu" else 2) * c.expert_ffn // t  # hidden values saved
    dense = (4 if c.activation == "swiglu" else 2) * c.ffn // t
    router = (2 * T * E + T) * e + T * k * i + (T * k + T) * e * c.router_renormalize
    out = [
        (f"no dense MLP hidden [T, {dense}] (fp32)", -T * dense * e),
        (
            "router: logits and probabilities [T, E], logsumexp [T], top-k indices [T, k]"
            + (
                ", the k probabilities and their sum (renormalised)" if c.router_renormalize else ""
            ),
            router,
        ),
        (
            "statistics [3E + 2] and f_e [E] (load-balancing loss), the attached loss (1 fp32)",
            (4 * E + 2 + 1) * e,
        ),
        ("dispatch: 3 index vectors [A], 2 [R] (int64)", (3 * A + 2 * R) * i),
        (f"experts: input [R, H] and hidden [R, {per_row}]", R * (h + per_row) * e),
        (
            "combine: the returned rows [A, H], their weights [A, 1] and the weighted rows "
            "[A, H] (index_add keeps its source)",
            A * (2 * h + 1) * e,
        ),
    ]
    if c.shared_expert:
        out.append((f"shared expert: hidden [T, {per_row}]", T * per_row * e))
    return out


def tp_terms(fig: RankFigures, config: GPTConfig, parallel: ParallelConfig) -> list[Term]:
    """TP inside this rank's MoE blocks: each expert's (and the shared expert's) all-reduce of
    its rows forward and of their input gradient backward (and again when full recompute
    reruns the block: the MoE layer's last saved tensor comes after them), instead of the
    dense MLP's 2 all-reduces of [b, s, H]."""
    n = moe_blocks(config, fig)
    if not n:
        return []
    x = moe_layer(config, parallel, fig)
    rows = x.received + (x.tokens if config.shared_expert else 0)
    passes = 3 if parallel.recompute == "full" else 2
    per = passes * rows * config.hidden * VALUE_BYTES - 2 * x.tokens * config.hidden * VALUE_BYTES
    return [
        Term(
            f"MoE blocks ({n} × {count_noun(fig.micro_batches, 'micro-batch')}): the experts' "
            f"{passes} all-reduces of their R = {x.received:,} rows"
            + (" and the shared expert's of T" if config.shared_expert else "")
            + ", not the dense MLP's 2 of [b, s, H]",
            n * fig.micro_batches * per,
        )
    ]


def ep_terms(fig: RankFigures, config: GPTConfig, parallel: ParallelConfig) -> list[Term]:
    """The EP group's calls (the lesson-18 formulas of tpedu.moe.expert_parallel), per MoE
    layer and micro-batch."""
    c, e = config, VALUE_BYTES
    n = moe_blocks(config, fig) * fig.micro_batches
    if not n:  # a stage without MoE layers (moe_every > 1)
        return []
    x = moe_layer(config, parallel, fig)
    stats = (3 * c.experts + 2) * e
    full = parallel.recompute == "full"
    each = f" ({n} = MoE layers × micro-batches)"
    terms = [
        Term(f"statistics' all-reduce, 3E + 2 fp32, forward{each}", n * stats),
        Term(f"counts' all-to-all, E int64, forward{each}", n * c.experts * INDEX_BYTES),
        Term(f"dispatch all-to-all [A = {x.sent:,}, H], forward", n * x.sent * c.hidden * e),
        Term(f"combine all-to-all [R = {x.received:,}, H], forward", n * x.received * c.hidden * e),
        Term(
            "backward: combine's gradient [A, H] and dispatch's [R, H] all-to-all'ed back",
            n * (x.sent + x.received) * c.hidden * e,
        ),
    ]
    if c.aux_loss_coef or c.z_loss_coef:  # the attached losses' gradient flows back through it
        terms.append(Term("backward: the statistics' all-reduce (the auxiliary losses)", n * stats))
    if full:
        forward = sum(t.value for t in terms[:4])
        terms.append(Term("full recompute: the forward's 4 calls rerun in backward", forward))
    return terms
