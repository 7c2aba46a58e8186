"""Lesson 13: the memory ledger's prediction for a rank, and every named difference from what the
rank measured: parameters, weights, gradients, optimizer states, activations.
"""

from __future__ import annotations

import dataclasses
import math

from tpedu.analysis.dryrun import moe
from tpedu.analysis.dryrun.figures import (
    ADAMW_BYTES,
    VALUE_BYTES,
    Comparison,
    RankFigures,
    Term,
    count_noun,
)
from tpedu.analysis.memory import BytesPerParam, Ledger, activation_bytes_per_layer, ledger
from tpedu.analysis.shape import ModelShape, layer_params
from tpedu.model.config import GPTConfig
from tpedu.parallel.config import ParallelConfig
from tpedu.tp.embedding import padded_vocab


def model_shape(config: GPTConfig, micro_batch: int) -> tuple[ModelShape | None, str]:
    """The ledger's ModelShape, or None and why not."""
    try:
        shape = ModelShape.from_config(config, micro_batch=micro_batch)
    except ValueError as e:
        return None, str(e)
    return shape, ""


def _param_terms(fig: RankFigures, config: GPTConfig, parallel: ParallelConfig) -> list[Term]:
    """Parameters: this rank's composition against the ledger's (stage 0; see `ledger`)."""
    c, tp, pp = config, parallel.tp, parallel.pp
    h = c.hidden
    sharded, replicated = layer_params(h, c.ffn, c.kv_heads * h // c.n_heads, c.bias)
    ledger_block = sharded // tp + replicated
    ledger_blocks = math.ceil(c.n_layers / pp)
    rows = padded_vocab(c.vocab_size, tp) // tp  # the ledger's ceil(V/t)
    table = table_rows(c, tp)
    positions = c.seq_len * h if c.position == "learned" else 0
    final_norm = 2 * h if (c.bias and c.norm == "layernorm") else h
    terms = []
    if fig.blocks != ledger_blocks:
        terms.append(
            Term(
                f"{count_noun(fig.blocks, 'block')} here; the ledger counts ceil(L/pp) = {ledger_blocks}",
                (fig.blocks - ledger_blocks) * ledger_block,
            )
        )
    if not fig.first:
        terms.append(
            Term(
                "no embedding or positions on this stage (the ledger's is stage 0)",
                -(rows * h + positions),
            )
        )
    elif table != rows:
        terms.append(
            Term(f"replicated embedding: {table:,} rows, the ledger's {rows:,}", (table - rows) * h)
        )
    head = 0
    if fig.last and (not c.tie_embeddings or not fig.first):
        head = table * h
    ledger_head = 0 if (pp > 1 or c.tie_embeddings) else rows * h
    if head != ledger_head:
        what = (
            "an untied LM head" if not c.tie_embeddings else "the tied table's copy as the LM head"
        )
        terms.append(Term(f"{what} [{table:,}, {h}] on the last stage", head - ledger_head))
    if fig.last and pp > 1:
        terms.append(Term("the final norm on the last stage", final_norm))
    return terms + moe.param_terms(fig, config, parallel)


def _layer_terms(
    config: GPTConfig, parallel: ParallelConfig, micro: int, dtype: str = "fp32"
) -> list[tuple[str, float]]:
    """tpedu's bytes per block and micro-batch minus Korthikanti et al.'s (16-bit values,
    1-byte masks), by cause, for the GPT-2 block this dry run trains (dropout 0, flash
    attention; fp32, or bf16 autocast: the matmuls' values in 2 bytes as the paper's, the
    residual stream in 4). Sums to (tpedu - paper) per layer; see the module docstring.

    Long because it is one table: a term per cause, each beside the code that makes it."""
    c, t, sp, rc = config, parallel.tp, parallel.sequence_parallel, parallel.recompute
    low = dtype != "fp32"
    s, b, h, a = c.seq_len, micro, c.hidden, c.n_heads
    e = value_bytes(dtype)
    rep = t if sp else 1
    sbh = s * b * h
    paper = activation_bytes_per_layer(s, b, h, a, t, sp, rc)
    if rc == "full":  # the block's input only: the residual stream, fp32 under autocast too
        return [("4-byte values (fp32), the paper's 2", paper)]
    masks = 2 * sbh / rep + (a * s * s * b / t if rc == "none" else 0.0)  # 1-byte masks
    values = paper - masks
    d, nq = h // a, a // t
    nkv = c.kv_heads // t if t <= c.kv_heads else 1
    out = [("no dropout masks (dropout 0)", -masks)]
    if not low:
        out.append(("4-byte values (fp32), the paper's 2", values))
    else:
        out.append(
            (
                "the 2 norms' inputs in fp32, the paper's 2 bytes: autocast leaves the "
                "residual stream fp32",
                2 * sbh / rep * 2,
            )
        )
        if sp:
            out.append(
                (
                    "sequence parallelism: QKV and fc1 keep their input's shard, the norm's "
                    "fp32 output, the paper's 2 bytes",
                    2 * sbh / t * 2,
                )
            )
    # context parallelism: the core is ring attention or Ulysses' (all-to-alls around flash)
    ring = parallel.cp > 1 and parallel.cp_strategy == "ring"
    ulysses = parallel.cp > 1 and not ring
    # flash keeps its logsumexp in fp32; ring attention in the compute dtype
    lse_dtype, lse_bytes = ("bf16", 2) if (ring and low) else ("fp32", 4)
    if rc == "none":
        out.append(
            ("flash attention keeps no [b, a/t, s, s] probabilities", -2 * a * s * s * b / t * e)
        )
        who = "ring attention's" if ring else "flash attention's"
        out.append((f"{who} logsumexp [b, a/t, s] ({lse_dtype})", b * nq * s * lse_bytes))
    out.append(("LayerNorm mean and 1/std (2 norms)", 2 * 2 * b * s / rep * 4))
    if parallel.cp > 1 and rc == "selective":  # recompute_core is the single-rank core's
        who = "ring attention's" if ring else "Ulysses' flash attention's"
        out.append(
            (
                f"CP: the core is not recomputed, {who} logsumexp [b, a/t, s] ({lse_dtype})",
                b * nq * s * lse_bytes,
            )
        )
    if ulysses:
        out.append(
            (
                "Ulysses: the core's output [b, a/(t·cp), s·cp, d] apart from the "
                "out-projection's input, and 2 int64 position orders [s·cp]",
                b * s * nq * d * e + 2 * 8 * s * parallel.cp,
            )
        )
    # GQA: flash attention saves K, V repeated (and the QKV output), ring attention K, V with
    # their KV heads, Ulysses K, V repeated after its all-to-alls (not the QKV output): exact
    if nq != nkv and rc == "none" and not parallel.cp > 1:
        out.append(
            (
                "GQA: K, V repeated to the q heads; the QKV output keeps the originals",
                2 * nkv * d * b * s * e,
            )
        )
    elif nq != nkv and not ulysses:
        out.append(("GQA: K, V saved with their n_kv heads", -2 * (nq - nkv) * d * b * s * e))
    if c.ffn != 4 * h:
        out.append((f"MLP width {c.ffn}, the paper's 4h", 2 * b * s * (c.ffn - 4 * h) / t * e))
    return out


def value_bytes(dtype: str) -> int:
    """Bytes of a value the matmuls make: 2 under bf16 autocast, else fp32's 4."""
    return 2 if dtype != "fp32" else VALUE_BYTES


def table_rows(config: GPTConfig, t: int) -> int:
    """Rows of the embedding table (and of a tied head) on one of t TP ranks."""
    return padded_vocab(config.vocab_size, t) // t if config.vocab_parallel else config.vocab_size


def _embedding_saved(config: GPTConfig, parallel: ParallelConfig, micro: int) -> tuple[str, int]:
    """(what, bytes) the embedding saves for backward per micro-batch (dropout 0): its token
    ids (int64; vocab-parallel: the local ids and the foreign-id mask) and the position ids
    (this rank's s/t with sequence parallelism)."""
    b, s = micro, config.seq_len
    rep = parallel.tp if parallel.sequence_parallel else 1
    total, what = 8 * b * s, ["token ids"]
    if config.vocab_parallel:
        total += b * s
        what.append("foreign-id mask")
    if config.position == "learned":
        total += 8 * s // rep
        what.append("position ids")
    return "embedding: " + ", ".join(what), total


def _head_saved(
    config: GPTConfig, parallel: ParallelConfig, micro: int, dtype: str = "fp32"
) -> tuple[str, int]:
    """(what, bytes) the final norm, the LM head and the loss save per micro-batch: the norm's
    (fp32) input and statistics, the head's input (with sequence parallelism: its fp32 shard,
    gathered again in backward; a replicated head: the gathered input; under bf16 autocast
    the others are the matmul's bf16 copy), then the vocab-parallel loss's fp32 softmax
    [b, s, Vp/t], local targets (int64), two masks and the token count, or F.cross_entropy's
    log-softmax [b·s, V], targets and total weight (fp32 under autocast too)."""
    c, t, sp = config, parallel.tp, parallel.sequence_parallel
    e = value_bytes(dtype)  # the head matmul's input, as autocast casts it
    b, s, h = micro, c.seq_len, c.hidden
    rep = t if sp else 1
    norm = b * s // rep * h * VALUE_BYTES + 2 * b * s // rep * 4
    if c.vocab_parallel:
        head_input = b * s // rep * h * (VALUE_BYTES if sp else e)
        loss = b * s * (padded_vocab(c.vocab_size, t) // t) * 4 + 8 * b * s + 2 * b * s + 8
        return "final norm, LM head, vocab-parallel loss", norm + head_input + loss
    loss = b * s * c.vocab_size * 4 + 8 * b * s + 4
    return "final norm, replicated LM head, cross-entropy", norm + b * s * h * e + loss


def _weight_copies(config: GPTConfig, parallel: ParallelConfig, fig: RankFigures) -> int:
    """Bytes of the bf16 weight copies autocast makes and caches for the step (once, whatever
    the micro-batches) that backward keeps: those of every block matmul that F.linear runs
    (not the recomputed ones, nor sequence parallelism's QKV and fc1, whose all-gather
    function keeps the fp32 weight), and the head's (not under sequence parallelism with a
    vocab-parallel head)."""
    c, t, sp = config, parallel.tp, parallel.sequence_parallel
    h, d = c.hidden, c.hidden // c.n_heads
    nq, nkv = c.n_heads // t, (c.kv_heads // t if t <= c.kv_heads else 1)
    ffn = c.ffn // t
    column = (nq + 2 * nkv) * d * h + (2 if c.activation == "swiglu" else 1) * ffn * h
    row = h * nq * d + h * ffn
    block = 0 if parallel.recompute == "full" else row + (0 if sp else column)
    head = 0
    if fig.last:
        head = 0 if (sp and c.vocab_parallel) else table_rows(c, t) * h
    return 2 * (fig.blocks * block + head)


def local_config(config: GPTConfig, parallel: ParallelConfig) -> GPTConfig:
    """The config at this rank's s/cp positions (context parallelism), for the formulas that
    count per position."""
    if parallel.cp == 1:
        return config
    return dataclasses.replace(config, seq_len=config.seq_len // parallel.cp)


def _activation_comparison(
    fig: RankFigures, config: GPTConfig, parallel: ParallelConfig, predicted: float
) -> Comparison:
    """The ledger's activations (at s/cp positions with context parallelism) against the
    measured peak."""
    c, pp = local_config(config, parallel), parallel.pp
    paper = activation_bytes_per_layer(
        c.seq_len,
        fig.micro_batch,
        c.hidden,
        c.n_heads,
        parallel.tp,
        parallel.sequence_parallel,
        parallel.recompute,
    )
    ledger_forwards = math.ceil(c.n_layers / pp) * pp
    m = fig.layer_forwards
    terms = [
        Term(
            f"block forwards held at the peak: {count_noun(fig.in_flight, 'micro-batch')}, {m} in all; "
            f"the ledger: pp·ceil(L/pp) = {ledger_forwards}",
            paper * (m - ledger_forwards),
        )
    ]
    if c.dropout:  # masks and the explicit attention path: measured, not modelled here
        terms.append(
            Term(
                f"tpedu's saved tensors with dropout {c.dropout:g} (not itemised)",
                fig.activations - predicted - terms[0].value,
            )
        )
        return Comparison("activations (peak)", fig.activations, predicted, "ledger", tuple(terms))
    terms += [
        Term(f"per block: {name}", value * m)
        for name, value in _layer_terms(c, parallel, fig.micro_batch, fig.dtype)
    ]
    terms += [
        Term(f"per MoE block forward × {fig.moe_forwards}: {name}", value * fig.moe_forwards)
        for name, value in moe.activation_terms(fig, config, parallel)
    ]
    for held, (name, value) in (
        (fig.held_embedding, _embedding_saved(c, parallel, fig.micro_batch)),
        (fig.held_head, _head_saved(c, parallel, fig.micro_batch, fig.dtype)),
    ):
        if held:
            terms.append(Term(f"{name} × {held} (the ledger leaves them out)", value * held))
    if fig.dtype != "fp32" and fig.in_flight:
        terms.append(
            Term(
                "autocast's bf16 copies of the matmul weights, cast once and kept for the step",
                _weight_copies(config, parallel, fig),
            )
        )
    ring = parallel.cp_strategy == "ring"
    if parallel.cp > 1 and (ring or parallel.recompute == "full") and fig.in_flight:
        # TPGPT computes them once per forward; every block saves the same tensor
        who = "ring attention" if ring else "each checkpointed block"
        terms.append(
            Term(
                f"CP: the global positions [cp, s/cp] (int64) {who} keeps, once per "
                f"model-chunk forward × {fig.in_flight}",
                8 * config.seq_len * fig.in_flight,
            )
        )
    return Comparison("activations (peak)", fig.activations, predicted, "ledger", tuple(terms))


def padding_term(fig: RankFigures, ranks: int) -> Term | None:
    """ZeRO: the elements each flat buffer adds to reach a multiple of N = `ranks` (the dp·cp
    ranks it shards over; at most N-1 per buffer), as a parameter count; None without flat
    buffers or padding."""
    pad = sum(ranks * n - elements for elements, n, *_ in fig.flat_buffers)
    if not pad:
        return None
    return Term(
        f"flat buffers padded to a multiple of N = {ranks}: {pad:,} elements over "
        f"{count_noun(len(fig.flat_buffers), 'buffer')}",
        pad,
    )


def _gathered_comparison(
    fig: RankFigures, parallel: ParallelConfig, whole: float, terms: list[Term]
) -> Comparison:
    """The most bytes of whole parameters held at once during the step. ZeRO-1/2: all of them,
    always (the ledger's undivided weights, `whole`, plus `terms`: the parameter and padding
    terms). ZeRO-3: the ledger counts none; what is held is each chunk's rest (gathered at
    its first forward, kept until the step) and, of the blocks, the one running and the
    neighbour whose all-gather was started early (prefetch), at most two adjacent ones."""
    what = "whole parameters (peak)"
    if parallel.zero < 3:
        return Comparison(what, fig.peak_gathered, whole, "ledger", tuple(terms))
    e, dp = VALUE_BYTES, parallel.layout.reduce_ranks
    rest = sum(dp * n for _, n, _, block in fig.flat_buffers if block < 0) * e
    blocks: dict[tuple[int, int], int] = {}
    for _, n, chunk, block in fig.flat_buffers:
        if block >= 0:
            blocks[chunk, block] = blocks.get((chunk, block), 0) + dp * n * e
    pairs = [blocks[k] + blocks.get((k[0], k[1] + 1), 0) for k in blocks]
    return Comparison(
        what,
        fig.peak_gathered,
        0.0,
        "ledger",
        (
            Term("ZeRO-3: every chunk's rest (embedding, final norm, head), kept gathered", rest),
            Term(
                "ZeRO-3: the largest two adjacent blocks: one running, the next prefetched",
                max(pairs, default=0),
            ),
        ),
    )


def memory_comparisons(
    fig: RankFigures, config: GPTConfig, parallel: ParallelConfig
) -> list[Comparison]:
    """Each memory figure of the rank (parameters, weights, gradients, optimizer states, the
    whole parameters' peak, activations) beside the ledger's, every difference named.

    Long because it is one table: a row per figure, each with its own terms."""
    shape, why = model_shape(config, fig.micro_batch)
    measured = [
        ("parameters", fig.params),
        ("weights", fig.weights),
        ("gradients", fig.gradients),
        ("optimizer states", fig.optimizer + fig.optimizer_steps),
        ("activations (peak)", fig.activations),
    ]
    if parallel.zero:
        measured.insert(4, ("whole parameters (peak)", fig.peak_gathered))
    if shape is None:
        return [Comparison(w, v, None, "ledger", note=why) for w, v in measured]
    dp, zero = parallel.layout.reduce_ranks, parallel.zero  # ZeRO shards over dp·cp

    def ledger_of(shape: ModelShape) -> Ledger:  # as this rank runs: fp32 states, its layout
        return ledger(
            shape,
            parallel.tp,
            parallel.pp,
            dp,
            parallel.sequence_parallel,
            parallel.recompute,
            zero,
            BytesPerParam(VALUE_BYTES, VALUE_BYTES, ADAMW_BYTES),
        )

    try:
        led = ledger_of(shape)
    except ValueError as e:  # e.g. KV heads replicated (tp > KV heads): the ledger refuses
        return [Comparison(w, v, None, "ledger", note=str(e)) for w, v in measured]
    params = _param_terms(fig, config, parallel)
    pad = padding_term(fig, dp)

    def scaled(per_param: float, divisor: int) -> list[Term]:
        """The parameter terms (and ZeRO's padding) at `per_param` bytes, 1/divisor."""
        terms = params + ([pad] if pad else [])
        return [Term(t.name, t.value * per_param / divisor) for t in terms]

    # ZeRO-1/2 step the shards in place in the whole buffers, and ZeRO-1's gradient buffer
    # holds the shards' means in place: no term beyond the parameters and their padding.
    w_div, g_div, o_div = (dp if zero >= k else 1 for k in (3, 2, 1))
    weights = scaled(VALUE_BYTES, w_div)
    grads = scaled(VALUE_BYTES, g_div)
    out = [
        Comparison("parameters", fig.params, led.params, "ledger", tuple(params)),
        Comparison("weights", fig.weights, led.weights, "ledger", tuple(weights)),
        Comparison("gradients", fig.gradients, led.gradients, "ledger", tuple(grads)),
    ]
    opt = scaled(ADAMW_BYTES, o_div)
    per = "one per flat buffer's shard" if zero else "one per tensor"
    opt.append(
        Term(
            f"AdamW's step counters: {fig.optimizer_tensors} fp32 scalars ({per})",
            4 * fig.optimizer_tensors,
        )
    )
    out.append(
        Comparison(
            "optimizer states",
            fig.optimizer + fig.optimizer_steps,
            led.optimizer,
            "ledger",
            tuple(opt),
        )
    )
    if zero:
        out.append(_gathered_comparison(fig, parallel, led.weights, scaled(VALUE_BYTES, 1)))
    if parallel.cp > 1:  # the activations are those of this rank's s/cp positions
        local = dataclasses.replace(shape, seq_len=config.seq_len // parallel.cp)
        led_act = ledger_of(local).activations
    else:
        led_act = led.activations
    if moe.not_itemised(fig, config):
        what = "activations (peak)"
        out.append(Comparison(what, fig.activations, None, "ledger", note=moe.BF16_NOTE))
    else:
        out.append(_activation_comparison(fig, config, parallel, led_act))
    return moe.unpriced_zero_ep(out, parallel)
