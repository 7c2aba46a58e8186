"""Long sequences on a fixed number of ranks: tensor parallelism alone, with sequence
parallelism, and context parallelism (ring attention), step time and memory per rank.

    .venv/bin/python benchmarks/bench_context.py [--world 2 4] [--seq 256 512 1024 2048]
                                                 [--reps 5] [--tiny]

For each world size and sequence length: the ranks build every variant from the same dense
weights (fp32, dropout 0), check that all of them compute the same loss, then time full
training steps (forward, backward, gradient fix-ups, AdamW), alternating the variants so machine
noise hits all; medians of the slowest rank. Variants on `world` ranks:

    TP          tp = world                     every rank holds every position
    TP expl     the same, attention computed explicitly (the [s, s] scores written out)
    TP+SP       tp = world, sequence parallel  norms and dropout sites on s/tp positions
    CP zigzag   tp = world/cp, cp = 2 (cp = world on 2 ranks), ring attention, zig-zag layout
    CP contig   the same, contiguous layout    the last CP rank does the most attention

Before them, causal attention alone (forward + backward of [1, 8, s, 64]) on 2 and 4 ranks: the
heads split (fused SDPA, what TP runs) beside ring attention with each block through the flash
kernel (tpedu.cp.blocks: only the part of a block its queries see) and written out, zig-zag
and contiguous.

Memory per rank: "act" is what autograd saves for backward during one forward (the largest over
the ranks; tpedu.analysis.activation_memory.SavedTensorCounter), "peak" the growth of the
process's peak resident set over one step (tpedu.analysis.memory.peak_rss_growth: saved
tensors, temporaries such as the [s/cp, s/cp] score blocks, gradients; the largest rank's).

Then the what-if (tpedu.analysis.whatif.long_context) for a long-context job on one 8-GPU H100
node: an 8B-like model at s = 32k, TP 8 (with and without SP) vs TP 4 × CP 2 vs TP 2 × CP 4.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import BACKEND, interleaved, load

import tpedu
from tpedu.analysis.activation_memory import SavedTensorCounter
from tpedu.analysis.memory import peak_rss_growth
from tpedu.analysis.shape import ModelShape
from tpedu.analysis.whatif import H100_SXM, long_context
from tpedu.cp.context import ContextParallel
from tpedu.cp.gradients import sum_over_cp
from tpedu.cp.ring import LAYOUTS, chunk_positions, ring_attention, split_sequence
from tpedu.model.config import GPTConfig
from tpedu.model.dense import DenseGPT
from tpedu.model.gpt import TPGPT
from tpedu.model.options import RunOptions

# Small enough that s = 2048 steps in about a second on one core; the sequence is what grows.
CONFIG = GPTConfig(512, seq_len=256, n_layers=2, hidden=64, n_heads=4, tie_embeddings=False)
TINY = GPTConfig(128, seq_len=32, n_layers=1, hidden=16, n_heads=4, tie_embeddings=False)
BATCH = 1
VARIANTS = ("TP", "TP expl", "TP+SP", "CP zigzag", "CP contig")
# The what-if's long-context job: Llama-3-8B's shape (GQA 32/8 heads, SwiGLU width), s = 32k.
LLAMA8B_32K = ModelShape(
    n_layers=32,
    hidden=4096,
    n_heads=32,
    n_kv_heads=8,
    vocab_size=128256,
    seq_len=32768,
    ffn_hidden=14336,
    micro_batch=1,
)


def groups(tp: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's TP and CP groups, rank = tp_rank + tp·cp_rank (the mesh's order).
    Collective: every rank creates every group."""
    world, rank = dist.get_world_size(), dist.get_rank()
    tps = [dist.new_group(list(range(c * tp, (c + 1) * tp))) for c in range(world // tp)]
    cps = [dist.new_group(list(range(t, world, tp))) for t in range(tp)]
    return tps[rank // tp], cps[rank % tp]


def trim() -> None:
    """Give the heap's free pages back to the kernel (glibc), so that the next peak-RSS growth
    is what that step needs, not what an earlier variant left free."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def make_step(
    model: TPGPT,
    opt: torch.optim.Optimizer,
    ids: torch.Tensor,
    tgt: torch.Tensor,
    losses: dict[str, float],
    name: str,
) -> Callable[[], None]:
    """One training step of `model` on its positions of ids/targets [b, s]; the first step's
    loss (the same weights in every variant) goes into losses[name]."""
    mine_ids, mine_tgt = model.local_sequence(ids), model.local_sequence(tgt)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = model(mine_ids, mine_tgt)
        loss.backward()
        model.sync_grads()
        if model.context is not None:  # each CP rank's gradients cover its positions only
            sum_over_cp(model.parameters(), model.context.group)
        opt.step()
        losses.setdefault(name, loss.item())

    return step


def worker(seqs: list[int], reps: int, base: GPTConfig) -> list[dict]:
    """One rank: for each s, every variant's first loss, step time and memory."""
    world = dist.get_world_size()
    cp = 2 if world > 2 else world
    full_tp, _ = groups(world)
    tp_group, cp_group = groups(world // cp)
    rows = []
    for s in seqs:
        config = dataclasses.replace(base, seq_len=s)
        torch.manual_seed(0)
        dense = DenseGPT(config)
        torch.manual_seed(0)  # the same weights, explicit attention
        models = {
            "TP": TPGPT(dense, full_tp),
            "TP expl": TPGPT(DenseGPT(config, fused_attention=False), full_tp),
            "TP+SP": TPGPT(dense, full_tp, options=RunOptions(sequence_parallel=True)),
            "CP zigzag": TPGPT(
                dense,
                tp_group,
                options=RunOptions(context=ContextParallel(cp_group, layout="zigzag")),
            ),
            "CP contig": TPGPT(
                dense,
                tp_group,
                options=RunOptions(context=ContextParallel(cp_group, layout="contiguous")),
            ),
        }
        opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, config.vocab_size, (BATCH, s), generator=g)
        tgt = torch.randint(0, config.vocab_size, (BATCH, s), generator=g)
        losses: dict[str, float] = {}
        steps = {k: make_step(models[k], opts[k], ids, tgt, losses, k) for k in models}
        act, peak = {}, {}
        for name, model in models.items():
            steps[name]()
            with SavedTensorCounter(model) as counter:
                model(model.local_sequence(ids), model.local_sequence(tgt)).backward()
            act[name] = counter.total
            model.zero_grad(set_to_none=True)
            trim()
            peak[name] = peak_rss_growth(steps[name])[0]
        times = interleaved(steps, reps, warmup=1)
        mem = torch.tensor([[act[k], peak[k]] for k in VARIANTS], dtype=torch.float64)
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)
        rows.append(
            {
                "s": s,
                "loss": losses,
                "ms": {k: 1e3 * times[k] for k in VARIANTS},
                "act": {k: mem[i, 0].item() for i, k in enumerate(VARIANTS)},
                "peak": {k: mem[i, 1].item() for i, k in enumerate(VARIANTS)},
            }
        )
    return rows


def attention_worker(s: int, heads: int, d: int, reps: int) -> dict[str, tuple[float, float]]:
    """Causal attention alone, forward + backward of [1, heads, s, d] on this world's ranks:
    the heads split over them (fused SDPA, what TP runs), and ring attention with the sequence
    split, its blocks fused or written out, zig-zag and contiguous. Per variant (ms, medians):
    the slowest rank's wall time, and the busiest rank's CPU time (what the step would take if
    each rank had a core of its own: more ranks than cores hide an imbalance in wall time).
    Collective."""
    world, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, s, d, generator=g) for _ in range(3))
    positions = {lay: torch.stack([chunk_positions(s, world, r, lay) for r in range(world)])
                 for lay in LAYOUTS}  # fmt: skip

    def tp_step() -> None:
        mine = [t[:, rank * heads // world : (rank + 1) * heads // world].requires_grad_()
                for t in (q, k, v)]  # fmt: skip
        F.scaled_dot_product_attention(*mine, is_causal=True).sum().backward()

    def ring_step(layout: str, fused: bool) -> Callable[[], None]:
        mine = [split_sequence(t, world, rank, layout) for t in (q, k, v)]

        def step() -> None:
            x = [t.detach().requires_grad_() for t in mine]
            ring_attention(*x, positions[layout], fused=fused).sum().backward()

        return step

    steps = {"TP (SDPA)": tp_step}
    for layout in LAYOUTS:
        steps[f"ring fused {layout}"] = ring_step(layout, True)
        steps[f"ring explicit {layout}"] = ring_step(layout, False)
    cpu: dict[str, list[float]] = {k: [] for k in steps}

    def timed(name: str) -> Callable[[], None]:
        def run() -> None:
            t = time.process_time()
            steps[name]()
            cpu[name].append(time.process_time() - t)

        return run

    wall = interleaved({k: timed(k) for k in steps}, reps, warmup=1)
    busiest = torch.tensor([statistics.median(cpu[k][1:]) for k in steps], dtype=torch.float64)
    dist.all_reduce(busiest, op=dist.ReduceOp.MAX)
    return {k: (1e3 * wall[k], 1e3 * busiest[i].item()) for i, k in enumerate(steps)}


def print_attention(s: int, heads: int, d: int, reps: int) -> None:
    print(
        f"\ncausal attention alone, forward + backward, [1, {heads}, {s}, {d}] fp32, "
        "slowest rank, medians (ms)"
    )
    print(
        f"{'ranks':>5} {'variant':<26} {'wall ms':>9} {'/ TP':>6} {'busiest CPU ms':>15} {'/ TP':>6}"
    )
    for world in (2, 4):
        t = tpedu.launch(attention_worker, world, s, heads, d, reps, backend=BACKEND)[0]
        tp = t["TP (SDPA)"]
        for name, (ms, cpu) in t.items():
            print(
                f"{world:>5} {name:<26} {ms:>9.1f} {ms / tp[0]:>6.2f} {cpu:>15.1f} "
                f"{cpu / tp[1]:>6.2f}"
            )
        zz, cont = t["ring fused zigzag"], t["ring fused contiguous"]
        print(
            f"{'':>5} contiguous / zig-zag, fused: wall {cont[0] / zz[0]:.2f}, "
            f"busiest CPU {cont[1] / zz[1]:.2f}"
        )


def check_losses(world: int, row: dict) -> None:
    ref = row["loss"]["TP"]
    for name, loss in row["loss"].items():
        if abs(loss - ref) > 1e-5 * abs(ref):  # fp32, the same sums reordered: ~1e-7
            raise SystemExit(
                f"world {world}, s {row['s']}: {name}'s loss {loss} != TP's {ref}; "
                "the variants do not compute the same thing"
            )


def print_rows(world: int, rows: list[dict]) -> None:
    cp = 2 if world > 2 else world
    print(f"\n{world} ranks: TP, TP+SP at tp {world}; CP at tp {world // cp} x cp {cp} (ring)")
    print(
        f"{'s':>5} {'variant':<10} {'step ms':>8} {'act MB':>8} {'peak MB':>8} "
        f"{'step/TP':>8} {'act/TP':>7} {'peak/TP':>8}"
    )
    for r in rows:
        check_losses(world, r)
        for k in VARIANTS:
            ms, act, peak = r["ms"][k], r["act"][k], r["peak"][k]
            print(
                f"{r['s']:>5} {k:<10} {ms:>8.1f} {act / 2**20:>8.2f} {peak / 2**20:>8.1f} "
                f"{ms / r['ms']['TP']:>8.2f} {act / r['act']['TP']:>7.2f} "
                + (f"{peak / r['peak']['TP']:>8.2f}" if r["peak"]["TP"] >= 2**20 else f"{'-':>8}")
            )


def what_if() -> None:
    m = LLAMA8B_32K
    print(
        f"\nwhat-if, {H100_SXM.name}, one node: 8B-like model (L {m.n_layers}, h {m.hidden}, "
        f"{m.n_heads}/{m.n_kv_heads} heads), s {m.seq_len}, micro-batch 1, bf16, flash attention"
    )
    print(
        f"{'layout':<14} {'act GB/GPU':>10} {'compute ms':>10} {'TP comm ms':>10} "
        f"{'CP comm ms':>10} {'CP sends':>8} {'KV block MB':>11}"
    )
    for label, tp, cp, sp in (
        ("TP 8", 8, 1, False),
        ("TP 8 + SP", 8, 1, True),
        ("TP 4 x CP 2", 4, 2, False),
        ("TP 2 x CP 4", 2, 4, False),
    ):
        p = long_context(m, tp, cp, H100_SXM, sp=sp)
        print(
            f"{label:<14} {p['activations'] / 1e9:>10.1f} {1e3 * p['compute']:>10.0f} "
            f"{1e3 * p['tp_comm']:>10.0f} {1e3 * p['cp_comm']:>10.1f} {p['cp_sends']:>8.0f} "
            f"{p['kv_block_bytes'] / 2**20:>11.1f}"
        )
    print(
        "act: Korthikanti's per-layer bytes at s/cp (GPT-2-style block formula, no s² terms); "
        "comm: α-β, not overlapped (the ring can hide its sends behind each block's attention)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--seq", type=int, nargs="+", default=[256, 512, 1024, 2048])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="a tiny model: checks the code path only")
    ap.add_argument(
        "--attention-seq", type=int, default=2048, help="s of the attention-only part (0: skip)"
    )
    args = ap.parse_args()
    c = TINY if args.tiny else CONFIG
    for world in args.world:
        if world not in (2, 4):
            raise SystemExit(f"--world {world}: use 2 or 4 (CP needs 2 ranks; TP x CP 2 x 2 on 4)")
    print(
        f"model: {c.n_layers} layers, d {c.hidden}, {c.n_heads} heads, vocab {c.vocab_size}, "
        f"batch {BATCH}, fp32, AdamW; torch {torch.__version__}, gloo, CPU ranks of 1 thread"
    )
    print(load())
    if args.attention_seq:
        s = 64 if args.tiny else args.attention_seq
        print_attention(s, 8, 64, args.reps)
    for world in args.world:
        rows = tpedu.launch(worker, world, args.seq, args.reps, c, timeout=1800, backend=BACKEND)[0]
        print_rows(world, rows)
    what_if()
    print(load())


if __name__ == "__main__":
    main()
