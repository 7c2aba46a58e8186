"""What bf16 and fp16 cost on this machine, and how far their training drifts from fp32.

    .venv/bin/python benchmarks/bench_precision.py [--tp 1 2] [--reps 5] [--steps 200]

Part 1, speed: one training step (forward, backward, AdamW) of the benchmark model
(harness.CONFIG) at each tp, in fp32, bf16 and fp16 (tpedu.train.precision: autocast compute,
fp32 master weights), alternating the variants, medians of the slowest rank. The CPU's vector
capability is printed beside the table: it decides what a bf16 matmul costs here (oneDNN's
kernels with AVX-512 move half the bytes of fp32 and convert in registers; without AVX-512 they
convert to fp32 and back), and fp16 matmuls have no fast CPU kernels at all. A GPU's tensor
cores run bf16 and fp16 several times faster than fp32; nothing in this table says how much.

Part 2, accuracy: the second seed says mixed precision "usually loses less than 0.1 %". The
novel GPT (2 layers, hidden 64, character tokens) trains `--steps` steps at tp 1 in each dtype
from the same initialisation and batches; printed: the largest relative gap of the training
loss to fp32's over all steps, the final validation losses and their gap, and for fp16 the
steps the loss scaler skipped. A step is skipped where the scaled gradients overflow fp16's
65504, i.e. where the gradients spike: the step after a skipped one starts from weights one
update behind, so a single skip at a loss spike shows as a large gap at one step and none after.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from harness import BACKEND, BATCH, CONFIG, TINY, batch, interleaved, load

import tpedu
from tpedu.data.corpus import novel_data
from tpedu.model import GPTConfig
from tpedu.train.config import TrainConfig
from tpedu.train.loop import train
from tpedu.train.optim import make_optimizer
from tpedu.train.step import build_model, train_step

DTYPES = ("fp32", "bf16", "fp16")


def worker(reps: int, config: GPTConfig) -> dict[str, float]:
    """Median step seconds per dtype at tp = world size. Collective."""
    model = build_model(config, seed=0)
    opt = make_optimizer(model, TrainConfig())
    x, y = batch(config, BATCH)
    cfgs = {d: TrainConfig(dtype=d, warmup=1) for d in DTYPES}
    steps = {d: (lambda d=d: train_step(model, opt, x, y, 0, cfgs[d])) for d in DTYPES}
    return interleaved(steps, reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=200, help="training steps of part 2")
    ap.add_argument("--tiny", action="store_true", help="a tiny model: checks the code path")
    a = ap.parse_args()
    config = TINY if a.tiny else CONFIG
    print(f"CPU capability: {torch.backends.cpu.get_cpu_capability()}; {load()}")
    print(
        f"{'tp':>3} {'fp32 ms':>9} {'bf16 ms':>9} {'fp16 ms':>9} {'bf16/fp32':>10} {'fp16/fp32':>10}"
    )
    for tp in a.tp:
        t = tpedu.launch(worker, tp, a.reps, config, backend=BACKEND)[0]
        ms = {d: 1e3 * t[d] for d in DTYPES}
        print(
            f"{tp:>3} {ms['fp32']:>9.1f} {ms['bf16']:>9.1f} {ms['fp16']:>9.1f} "
            f"{ms['bf16'] / ms['fp32']:>10.2f} {ms['fp16'] / ms['fp32']:>10.2f}"
        )
    tok, train_ids, val_ids = novel_data("char")
    model = GPTConfig.gpt2_like(tok.vocab_size, seq_len=64, n_layers=2, hidden=64, n_heads=4)
    base = TrainConfig(steps=a.steps, batch=8, eval_every=a.steps, progress=False)
    runs = {
        d: tpedu.launch(train, 1, model, dataclasses.replace(base, dtype=d), train_ids, val_ids)[0]
        for d in DTYPES
    }
    ref = runs["fp32"]
    print(f"\n{a.steps} steps of the novel GPT at tp 1 (loss gap to fp32, relative):")
    for d in DTYPES[1:]:
        r = runs[d]
        gap = max(abs(x - y) / y for x, y in zip(r["losses"], ref["losses"], strict=True))
        val = abs(r["final_val_loss"] - ref["final_val_loss"]) / ref["final_val_loss"]
        skipped = r.get("loss_scale", {}).get("skipped", 0)
        print(
            f"  {d}: largest train-loss gap {100 * gap:.3f} %; final val loss "
            f"{r['final_val_loss']:.4f} vs {ref['final_val_loss']:.4f} ({100 * val:.3f} %)"
            + (f"; {skipped} steps skipped by the loss scaler" if d == "fp16" else "")
        )


if __name__ == "__main__":
    main()
