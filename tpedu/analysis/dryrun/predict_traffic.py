"""Lesson 13: the what-if's message volumes for a rank, and every named difference from what the
rank sent, group by group (tp, cp, pp, dp, emb, world).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tpedu.analysis import whatif
from tpedu.analysis.dryrun import moe
from tpedu.analysis.dryrun.figures import (
    STOP_CHECK,
    VALUE_BYTES,
    Comparison,
    RankFigures,
    Term,
    count_noun,
)
from tpedu.analysis.dryrun.predict_memory import (
    local_config,
    model_shape,
    padding_term,
    table_rows,
    value_bytes,
)
from tpedu.analysis.shape import ModelShape
from tpedu.cp.traffic import ring_messages, ulysses_messages
from tpedu.model.config import GPTConfig
from tpedu.parallel.config import ParallelConfig


def _sp_params(config: GPTConfig, fig: RankFigures) -> int:
    """Elements of the parameters sequence parallelism marks (their gradients are all-reduced
    over the TP group after backward): both norms and the row-parallel biases of each block,
    plus the positions (first stage) and the final norm (last stage)."""
    h = config.hidden
    norm = 2 * h if (config.bias and config.norm == "layernorm") else h
    block = 2 * norm + (2 * h if config.bias else 0)
    total = fig.blocks * block
    if fig.first and config.position == "learned":
        total += config.seq_len * h
    if fig.last:
        total += norm
    return total


@dataclass(frozen=True)
class _Volumes:
    """One rank's traffic and the what-if's for its layout: what every group's comparison reads."""

    fig: RankFigures
    config: GPTConfig  # this rank's local view: with CP, s/cp positions per message
    parallel: ParallelConfig
    shape: ModelShape
    vol: whatif.Volumes
    measured: dict[str, int]
    model: GPTConfig  # the whole model's config (all s positions)

    @property
    def msg(self) -> float:  # one [b, s, h] message at 4 bytes per value
        return self.vol.message_bytes

    @property
    def m(self) -> int:
        return self.fig.micro_batches


def traffic_comparisons(
    fig: RankFigures, config: GPTConfig, parallel: ParallelConfig, batch: int
) -> list[Comparison]:
    """Each group's bytes sent (tp, cp, pp, dp, emb, world) beside the what-if's, every
    difference named."""
    pp, v = parallel.pp, parallel.chunks
    shape, why = model_shape(config, fig.micro_batch)
    groups = [*parallel.layout.group_names(), "world"]
    if config.experts and "ep" not in groups:  # ep = 1: the MoE layers' group of one rank
        groups.insert(-1, "ep")
    measured = {g: fig.sent(g) for g in groups}
    if shape is None or config.n_layers % (pp * v):
        note = why or f"the what-if needs L divisible by pp·chunks ({config.n_layers}, {pp}·{v})"
        moe_groups = ("ep", "edp") if config.experts else ()  # priced without the what-if
        unpriced = [
            Comparison(f"{g} traffic", measured[g], None, "what-if", note=note)
            for g in groups
            if measured[g] and g not in moe_groups
        ]
        return moe.unpriced_zero_ep(
            unpriced + _ep_traffic(fig, config, parallel, measured) + _other_reductions(fig),
            parallel,
        )
    par = whatif.Parallel(
        tp=parallel.tp,
        pp=pp,
        dp=parallel.dp,
        batch=batch,
        micro=fig.micro_batch,
        chunks=v,
        recompute=parallel.recompute == "full",
    )
    c = local_config(config, parallel)  # with CP every message holds this rank's s/cp positions
    vol = whatif.volumes(dataclasses.replace(shape, seq_len=c.seq_len), par, VALUE_BYTES)
    x = _Volumes(fig, c, parallel, shape, vol, measured, config)
    terms = _tp_block_terms(x) + moe.tp_terms(fig, config, parallel) + _tp_end_terms(x)
    tp = Comparison(
        "tp traffic", measured["tp"], vol.tp_all_reduces * x.msg, "what-if", tuple(terms)
    )
    if moe.not_itemised(fig, config):
        tp = Comparison("tp traffic", measured["tp"], None, "what-if", note=moe.BF16_NOTE)
    out = [tp]
    if parallel.cp > 1:
        out.append(_cp_comparison(fig, config, parallel, measured["cp"]))
    ep = _ep_traffic(fig, config, parallel, measured)
    out += [_pp_traffic(x), _dp_traffic(x)] + ep + _other_reductions(fig)
    out += _emb_and_world_traffic(x)
    return moe.unpriced_zero_ep(out, parallel)


def _ep_traffic(
    fig: RankFigures, c: GPTConfig, parallel: ParallelConfig, measured: dict[str, int]
) -> list[Comparison]:
    """The MoE layers' groups, which the what-if does not price (nor need: any architecture):
    ep (the all-to-alls and the statistics) and, with ep > 1, edp (the experts' gradients)."""
    if not c.experts:
        return []
    ep = Comparison(
        "ep traffic", measured["ep"], 0.0, "what-if", tuple(moe.ep_terms(fig, c, parallel))
    )
    if moe.not_itemised(fig, c):
        ep = Comparison("ep traffic", measured["ep"], None, "what-if", note=moe.BF16_NOTE)
    return [ep]


def _other_reductions(fig: RankFigures) -> list[Comparison]:
    """The groups beside dp that the parameters' placements reduce gradients over (edp: the
    experts', ep > 1), which the what-if does not know: 1 all-reduce of those parameters
    (DataParallel's buckets of that group; a group of one rank sends nothing)."""
    out = []
    for group, ranks, n in fig.reduced_over:
        if group == "dp":
            continue
        what = f"the gradients of {n:,} parameters: 1 all-reduce, {ranks} ranks"
        terms = (Term(what, n * VALUE_BYTES),) if ranks > 1 else ()
        out.append(Comparison(f"{group} traffic", fig.sent(group), 0.0, "what-if", terms))
    return out


def _tp_block_terms(x: _Volumes) -> list[Term]:
    """TP inside the blocks: the what-if's all-reduces, and how this rank's calls differ."""
    c, pp, sp, m = x.config, x.parallel.pp, x.parallel.sequence_parallel, x.m
    fig, vol, msg, parallel = x.fig, x.vol, x.msg, x.parallel
    # TP: the blocks' all-reduces (or SP's all-gather / reduce-scatter pairs: the same bytes)
    terms = []
    per_stage = c.n_layers // pp
    if fig.blocks != per_stage:  # --stage-split flops
        terms.append(
            Term(
                f"{count_noun(fig.blocks, 'block')} here, the what-if's L/pp = {per_stage}",
                vol.tp_all_reduces * msg * (fig.blocks / per_stage - 1),
            )
        )
    blocks_msgs = m * fig.blocks * msg  # one [b, s, h] message per block and micro-batch
    passes = 6 if parallel.recompute == "full" else 4
    if sp:
        terms.append(
            Term(
                "sequence parallelism: each all-reduce is a reduce-scatter plus an all-gather "
                "(2 calls of [b, s, h], the same bytes on the wire)",
                passes * blocks_msgs,
            )
        )
        terms.append(
            Term(
                "sequence parallelism: QKV and fc1 keep only their input's shard and "
                "all-gather it again in backward (2 per block)",
                2 * blocks_msgs,
            )
        )
    if parallel.recompute == "full":
        op = "reduce-scatter" if sp else "all-reduce"
        terms.append(
            Term(
                f"full recompute: PyTorch's checkpoint stops at the last tensor backward needs, "
                f"so the MLP's output {op} is not rerun (1 per block)",
                -blocks_msgs,
            )
        )
    if fig.dtype != "fp32":  # the row-parallel matmuls' outputs, and their gradients, in bf16
        full = parallel.recompute == "full"
        if sp:
            what = (
                "bf16 autocast: the blocks' reduce-scatters of the row-parallel outputs (2 per "
                "block" + (", 1 more recomputed" if full else "") + "), the all-gathers of "
                "their gradients (2) and the reduce-scatters of QKV's and fc1's input "
                "gradients (2) in 2 bytes, the what-if's 4"
            )
            halved = (6 + full) * blocks_msgs / 2
            if fig.last and c.vocab_parallel:
                what += "; and the LM head's input gradient's (1 per micro-batch)"
                halved += m * msg / 2
        else:
            what = (
                "bf16 autocast: the blocks' all-reduces of the row-parallel outputs (2 per "
                "block" + (", 1 more recomputed" if full else "") + ") in 2 bytes, the "
                "what-if's 4; the backward ones carry fp32 gradients"
            )
            halved = (2 + full) * blocks_msgs / 2
        terms.append(Term(what, -halved))
    return terms


def _tp_end_terms(x: _Volumes) -> list[Term]:
    """TP outside the blocks: embedding, LM head and loss, replicated KV heads' and sequence-
    parallel parameters' gradients."""
    c, tp, sp, e = x.config, x.parallel.tp, x.parallel.sequence_parallel, VALUE_BYTES
    m, fig, msg = x.m, x.fig, x.msg
    terms = []
    vp = c.vocab_parallel
    if fig.first:
        calls = (2 if sp else 1) if vp else (1 if sp else 0)
        if calls:
            how = "vocab-parallel" if vp else "replicated"
            terms.append(Term(f"{how} embedding: {calls} per micro-batch", calls * m * msg))
    if fig.last:
        calls = (3 if sp else 1) if vp else (1 if sp else 0)
        if calls:
            terms.append(Term(f"LM head's input: {calls} per micro-batch", calls * m * msg))
        if vp:
            terms.append(
                Term(
                    "vocab-parallel loss: 3 all-reduces of [b, s] per micro-batch",
                    3 * m * fig.micro_batch * c.seq_len * 4,
                )
            )
    if tp > c.kv_heads:
        d = c.hidden // c.n_heads
        per = c.kv_heads * 2 * d * (c.hidden + (1 if c.bias else 0)) * e
        terms.append(
            Term("replicated KV heads' gradients: 1 all-reduce per block", fig.blocks * per)
        )
    if sp:
        terms.append(
            Term(
                "sequence-parallel parameters' gradients: 1 all-reduce per chunk",
                _sp_params(c, fig) * e,
            )
        )
    return terms


def _pp_traffic(x: _Volumes) -> Comparison:
    tp, pp, v, sp = x.parallel.tp, x.parallel.pp, x.parallel.chunks, x.parallel.sequence_parallel
    m, fig, vol, msg = x.m, x.fig, x.vol, x.msg
    # PP: activations forward, their gradients back; the what-if prices 2 sends per
    # micro-batch and chunk of a [b, s, h] message
    sends = sum(m for cc in range(v) if cc * pp + fig.coords["pp"] != pp * v - 1)  # forward
    sends += sum(m for cc in range(v) if cc * pp + fig.coords["pp"] != 0)  # backward
    pp_terms = []
    if pp > 1:
        if sends != vol.pp_sends:
            pp_terms.append(
                Term(
                    f"{count_noun(sends, 'send')} here, the what-if's {vol.pp_sends}: "
                    + (
                        "the first stage sends no gradient back"
                        if fig.coords["pp"] == 0
                        else "the last stage sends no activation on"
                    ),
                    (sends - vol.pp_sends) * msg,
                )
            )
        if sp:
            pp_terms.append(
                Term(
                    f"sequence parallelism: messages are [b, s/{tp}, h]", sends * msg * (1 / tp - 1)
                )
            )
        pp_terms.append(
            Term(
                "the receives of as many messages (the what-if prices the sends)",
                sends * msg / (tp if sp else 1),
            )
        )
    return Comparison(
        "pp traffic", x.measured["pp"], vol.pp_sends * msg, "what-if", tuple(pp_terms)
    )


def _dp_traffic(x: _Volumes) -> Comparison:
    tp, pp, e, fig = x.parallel.tp, x.parallel.pp, VALUE_BYTES, x.fig
    vol, dp, shape, parallel = x.vol, x.parallel.dp, x.shape, x.parallel
    # DP: one all-reduce of this rank's gradients (buckets) over dp·cp (CP's sum folded in),
    # or ZeRO's reduce-scatters and all-gathers (which run over a group of 1 too, as train
    # runs them)
    dp_terms = []
    predicted = vol.dp_bytes if dp > 1 else 0.0
    folded = f", summed over dp·cp = {dp}·{parallel.cp} ranks" if parallel.cp > 1 else ""
    if parallel.layout.reduce_ranks > 1 or parallel.zero:
        dp_terms.append(
            Term(
                f"this rank's {fig.params:,} parameters{folded}, not the what-if's "
                + (
                    f"N/(tp·pp) = {shape.matmul_params / (tp * pp):,.0f} (matmul weights, "
                    "averaged over stages)"
                    if dp > 1
                    else "0 (no replicas)"
                ),
                fig.params * e - predicted,
            )
        )
    if dp_terms:  # parameters whose placements reduce them over another group
        dp_terms += [
            Term(f"{n:,} parameters reduced over {group}, as their placements say, not dp", -n * e)
            for group, _, n in fig.reduced_over
            if group != "dp"
        ]
    if parallel.zero:
        dp_terms += _sharded_traffic_terms(fig, parallel)
    return Comparison("dp traffic", x.measured["dp"], predicted, "what-if", tuple(dp_terms))


def _emb_and_world_traffic(x: _Volumes) -> list[Comparison]:
    c, tp, pp, e = x.config, x.parallel.tp, x.parallel.pp, VALUE_BYTES
    fig = x.fig
    emb_terms = []
    if pp > 1 and c.tie_embeddings and (fig.first or fig.last):
        emb_terms.append(
            Term(
                "tied embedding: the two copies' gradients summed",
                table_rows(c, tp) * c.hidden * e,
            )
        )
    return [
        Comparison("emb traffic", x.measured["emb"], 0.0, "what-if", tuple(emb_terms)),
        Comparison(
            "world traffic",
            x.measured["world"],
            0.0,
            "what-if",
            (
                Term("the gradient norm: 1 float64 all-reduce", 8),
                Term("the loop's loss average over replicas (1 float64)", 8),
                STOP_CHECK,
            ),
        ),
    ]


def _sharded_traffic_terms(fig: RankFigures, parallel: ParallelConfig) -> list[Term]:
    """ZeRO's calls beyond one all-reduce of this rank's parameters (which the reduce-scatter
    of the gradients replaces, the same bytes in): the padding, the parameters' all-gathers.
    Its N is the dp·cp ranks its group holds."""
    dp, m, e = parallel.layout.reduce_ranks, fig.micro_batches, VALUE_BYTES
    terms = []
    pad = padding_term(fig, dp)
    if pad:
        terms.append(Term(pad.name + " (in the reduce-scatter)", pad.value * e))
    padded = sum(dp * n for _, n, *_ in fig.flat_buffers)
    if parallel.zero < 3:
        terms.append(
            Term(
                f"ZeRO-{parallel.zero}: every buffer all-gathered from the new shards after the "
                "step",
                padded * e,
            )
        )
    else:
        blocks = sum(dp * n for _, n, _, block in fig.flat_buffers if block >= 0)
        terms += [
            Term(
                f"ZeRO-3: every block's buffers all-gathered before its forward "
                f"({m} per block: one per micro-batch)",
                m * blocks * e,
            ),
            Term(
                f"ZeRO-3: ... and again before each backward ({m} per block, what plain DP "
                "does not send: (N-1)/N·Ψ_blocks per micro-batch on the wire)",
                m * blocks * e,
            ),
            Term(
                "ZeRO-3: the chunks' rest (embedding, final norm, head) all-gathered once, at "
                "the first forward, and kept until the step",
                (padded - blocks) * e,
            ),
        ]
    return terms


def _cp_comparison(
    fig: RankFigures, config: GPTConfig, parallel: ParallelConfig, measured: int
) -> Comparison:
    """CP traffic against tpedu.cp.traffic's formulas for every block forward and backward of
    the step (ring: the K/V blocks' sends; Ulysses: its all-to-alls), plus what else the CP
    group carries: the loss's mean over the whole sequence. Under bf16
    autocast the K/V blocks (Ulysses: q, k, v and the output) are the QKV matmul's bf16."""
    c, t, cp, m = config, parallel.tp, parallel.cp, fig.micro_batches
    e = value_bytes(fig.dtype)  # the attention core's values
    d = c.hidden // c.n_heads
    nkv = c.kv_heads // t if t <= c.kv_heads else 1
    layers = m * fig.blocks  # block forwards (and backwards) in the step
    full = parallel.recompute == "full"
    terms = []
    if parallel.cp_strategy == "ring":
        msgs = ring_messages(fig.micro_batch, nkv, c.seq_len, cp, d, e, layers, full)
        predicted = msgs["forward"][1] + msgs["backward"][1]
        sends = msgs["forward"][0] + msgs["backward"][0]
        terms.append(
            Term(
                f"the receives of the ring's {count_noun(sends, 'send')} of [b, kv_heads/tp, s/cp, d] "
                f"({2 * (cp - 1)} per block forward, {4 * cp - 2} backward"
                + (f", {2 * (cp - 1)} more recomputing" if full else "")
                + "; tpedu.cp.traffic counts the sends)",
                predicted,
            )
        )
    else:
        msgs = ulysses_messages(fig.micro_batch, c.n_heads // t, nkv, c.seq_len, cp, d, e, layers)
        predicted = msgs["forward"][1] + msgs["backward"][1]
        if full:
            terms.append(
                Term(
                    "full recompute: the forward's all-to-alls run again in backward",
                    msgs["forward"][1],
                )
            )
    if fig.last:
        terms.append(
            Term(
                "the loss's mean over the whole sequence: the token count (int64) and the loss "
                "(fp32), 1 all-reduce each per micro-batch",
                12 * m,
            )
        )
    # the gradients' sum over CP is not here: it is folded into DP's reduction over dp·cp
    return Comparison("cp traffic", measured, predicted, "what-if", tuple(terms))
