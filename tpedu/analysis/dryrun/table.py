"""Lesson 13: a dry run as a table, and many ranks as a summary, for the CLI and the lessons."""

from __future__ import annotations

from collections.abc import Sequence

from tpedu.analysis.dryrun import moe
from tpedu.analysis.dryrun.figures import Comparison, DryRun, count_noun
from tpedu.analysis.dryrun.measure import rank_class
from tpedu.analysis.dryrun.predict_memory import model_shape
from tpedu.analysis.memory import GB
from tpedu.parallel.mesh import describe_coords


def _fmt(x: float) -> str:
    return f"{x:,.0f}"


def format_table(run: DryRun) -> str:
    """The dry run of one rank as fixed-width text (deterministic: no timings)."""
    f, c, par = run.figures, run.config, run.parallel
    blocks = ", ".join(f"{a}-{b - 1}" if b - a > 1 else f"{a}" for a, b in f.chunks)
    holds = (
        [f"block{'s' if f.blocks > 1 else ''} {blocks}"]
        + (["embedding"] if f.first else [])
        + (["final norm, head, loss"] if f.last else [])
    )
    shape, _ = model_shape(c, f.micro_batch)
    arch = "llama" if c.activation == "swiglu" else "gpt2"
    n = shape.n_params if shape else 0
    size = f", {n / 1e9:.2f}B parameters" if n >= 1e8 else f", {n:,} parameters" if n else ""
    lines = [
        f"dry run: rank {f.rank} of {f.world} ({describe_coords(par.layout, f.rank)}); "
        f"holds {'; '.join(holds)}",
        f"model: {arch}, {c.n_layers} layers, hidden {c.hidden}, {c.n_heads} heads"
        + (f" ({c.kv_heads} KV)" if c.kv_heads != c.n_heads else "")
        + f", vocab {c.vocab_size:,}, seq {c.seq_len}{size}",
        f"step: batch {run.batch}, {count_noun(f.micro_batches, 'micro-batch')} of "
        f"{count_noun(f.micro_batch, 'sequence')} per replica"
        + (
            f", {par.schedule}" + (f" x{par.chunks} chunks" if par.chunks > 1 else "")
            if par.pp > 1
            else ""
        )
        + (", sequence parallel" if par.sequence_parallel else "")
        + (
            f", context parallel ({par.cp_strategy}, {par.cp_layout}): s/cp = "
            f"{c.seq_len // par.cp} positions per rank"
            if par.cp > 1
            else ""
        )
        + (f", recompute {par.recompute}" if par.recompute != "none" else "")
        + (f", ZeRO-{par.zero}" if par.zero else "")
        + ("; bf16 autocast" if f.dtype != "fp32" else "")
        + "; fp32 weights, AdamW, dropout "
        + f"{c.dropout:g}",
        *_moe_lines(run),
        "",
        f"{'memory on this rank':<28}{'measured':>18}{'ledger':>18}{'measured GB':>13}",
        "-" * 77,
    ]
    memory = [comp for comp in run.comparisons if comp.source == "ledger"]
    traffic = [comp for comp in run.comparisons if comp.source == "what-if"]
    for comp in memory:
        pred = _fmt(comp.predicted) if comp.predicted is not None else "n/a"
        gb = f"{comp.measured / GB:>13.3f}" if comp.what != "parameters" else f"{'':>13}"
        lines.append(f"{comp.what:<28}{_fmt(comp.measured):>18}{pred:>18}{gb}")
    lines.append("")
    lines += _differences(memory)
    lines += [
        "",
        f"{'communication, one step':<24}{'phase':<10}{'calls':>7}{'elements':>17}{'bytes':>18}",
        "-" * 76,
    ]
    for tr in f.traffic:
        lines.append(
            f"{tr.group + ' ' + tr.op:<24}{tr.phase:<10}{tr.calls:>7}{tr.elements:>17,}{tr.bytes:>18,}"
        )
    if not f.traffic:
        lines.append("(no collectives)")
    if traffic:
        lines += ["", f"{'bytes per group':<28}{'measured':>18}{'what-if':>18}", "-" * 64]
        for comp in traffic:
            pred = _fmt(comp.predicted) if comp.predicted is not None else "n/a"
            lines.append(f"{comp.what:<28}{_fmt(comp.measured):>18}{pred:>18}")
        lines.append("")
        lines += _differences(traffic)
    return "\n".join(line.rstrip() for line in lines)


def _moe_lines(run: DryRun) -> list[str]:
    """The mixture of experts and the routing the dry run assumed (none without experts)."""
    c, par, f = run.config, run.parallel, run.figures
    if not c.experts:
        return []
    x = moe.moe_layer(c, par, f)
    every = "every layer" if c.moe_every == 1 else f"every {c.moe_every} layers"
    cap = "dropless" if c.capacity_factor is None else f"capacity factor {c.capacity_factor:g}"
    return [
        f"experts: {c.experts} of width {c.expert_ffn}, top-{c.top_k}, {every}, {cap}"
        + (", a shared expert" if c.shared_expert else "")
        + f"; ep {par.ep}: {count_noun(x.local, 'expert')} per rank",
        f"{moe.ROUTING_NOTE}: per MoE layer and micro-batch T = {x.tokens:,} tokens, "
        f"A = {x.sent:,} assignments sent, R = {x.received:,} rows received",
    ]


def _differences(comps: Sequence[Comparison]) -> list[str]:
    lines = []
    missing = [comp for comp in comps if comp.predicted is None]
    for note in dict.fromkeys(comp.note for comp in missing):  # each reason once
        whats = ", ".join(comp.what for comp in missing if comp.note == note)
        lines.append(f"no {missing[0].source} figure for {whats}: {note}")
    for comp in comps:
        if comp.predicted is None:
            continue
        lines.append(f"{comp.what}: {comp.source} {_fmt(comp.predicted)}")
        for term in comp.terms:
            lines.append(
                f"  {'+' if term.value >= 0 else '-'} {_fmt(abs(term.value)):>16}  {term.name}"
            )
        rest = comp.unexplained
        if abs(rest) >= 0.5:
            lines.append(f"  {'+' if rest >= 0 else '-'} {_fmt(abs(rest)):>16}  UNEXPLAINED")
        lines.append(f"  = {_fmt(comp.measured):>16}  measured")
    return lines


def format_summary(runs: Sequence[DryRun]) -> str:
    """One line per rank (for --rank all): bytes held and sent, and the unexplained remainders."""
    cp = any(run.parallel.cp > 1 for run in runs)  # a cp column only for CP layouts
    experts = any(run.config.experts for run in runs)  # ep (and edp) columns only with MoE
    edp = any(run.parallel.ep > 1 for run in runs)
    extra = ["cp"] * cp + ["ep"] * experts + ["edp"] * edp
    head = (
        f"{'rank':>5} {'tp':>3} {'pp':>3} {'dp':>3} {'params':>14} {'weights+grads+opt GB':>21} "
        f"{'acts GB':>8} {'sent MB tp':>11} {'pp':>9} {'dp':>9}"
        + "".join(f" {g:>9}" for g in extra)
        + f" {'unexpl.':>8}"
    )
    lines = [head, "-" * len(head)]
    for run in runs:
        f = run.figures
        state = (f.weights + f.gradients + f.optimizer + f.optimizer_steps) / GB
        rest = sum(abs(c.unexplained) for c in run.comparisons)
        lines.append(
            f"{f.rank:>5} {f.coords['tp']:>3} {f.coords['pp']:>3} {f.coords['dp']:>3} {f.params:>14,} "
            f"{state:>21.3f} {f.activations / GB:>8.3f} {f.sent('tp') / 1e6:>11.1f} "
            f"{f.sent('pp') / 1e6:>9.1f} {f.sent('dp') / 1e6:>9.1f}"
            + "".join(f" {f.sent(g) / 1e6:>9.1f}" for g in extra)
            + f" {rest:>8,.0f}"
        )
    measured = [run.figures.rank for run in runs if run.measured_on is None]
    if len(measured) < len(runs):
        run = runs[0]
        by = (
            "pp, cp, ep"
            if len(rank_class(run.parallel, 0, run.config, run.batch)) > 2
            else "pp, cp"
        )
        lines.append(
            f"measured {count_noun(len(measured), 'rank')} ({', '.join(map(str, measured))}), "
            f"one per ({by}) class; every other rank has its class's figures (rank_class)"
        )
    if experts:
        lines.append(moe.ROUTING_NOTE)
    return "\n".join(lines)
