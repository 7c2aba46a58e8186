"""Peak resident memory per rank while building the model: dense-then-shard vs per-shard init.

    .venv/bin/python benchmarks/bench_init_memory.py [--tp 4] [--layers 18] [--hidden 1536]

Each rank builds its TPGPT both ways (in separate launches): `TPGPT(DenseGPT(config))` (the
whole dense fp32 model on every rank, then 1/tp of it kept) and
`tpedu.model.sharded_init.build_sharded` (meta structure, then each shard initialised from one
dense module at a time; the same values bit for bit). Measured: the growth of the rank's peak
resident set (VmHWM) over its resident set before the build, after a warm-up build of a tiny
model (the first use of the meta device imports ≈ 50 MB of code). Printed beside it: the dense
fp32 bytes and 1/tp of them, the ideal of the per-shard build (plus the largest module and the
allocator's slack). Default: a GPT-2-style model of 0.59 B parameters (2.3 GB in fp32); larger
models need tp × (dense + shard) bytes of RAM for the dense-then-shard run.
"""

from __future__ import annotations

import argparse

import torch

import tpedu
from tpedu.analysis.memory import peak_rss_growth
from tpedu.model import TPGPT, DenseGPT, GPTConfig
from tpedu.model.sharded_init import build_sharded

GB = 1e9


def peak_growth(config: GPTConfig, sharded: bool) -> tuple[int, int]:
    """(bytes the build added to this rank's peak resident set, its parameters). On a rank."""
    build_sharded(GPTConfig.gpt2_like(37, seq_len=8, n_layers=1, hidden=16, n_heads=4))

    def build() -> int:
        if sharded:
            model = build_sharded(config, seed=0)[0]
        else:
            torch.manual_seed(0)
            model = TPGPT(DenseGPT(config))
        return sum(p.numel() for p in model.parameters())

    return peak_rss_growth(build)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--layers", type=int, default=18)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--vocab", type=int, default=50257)
    a = ap.parse_args()
    config = GPTConfig.gpt2_like(
        a.vocab, seq_len=1024, n_layers=a.layers, hidden=a.hidden, n_heads=a.hidden // 64
    )
    with torch.device("meta"):
        n = sum(p.numel() for p in DenseGPT(config).parameters())
    dense = 4 * n
    print(f"{n / 1e9:.2f} B parameters, {dense / GB:.2f} GB dense fp32, tp {a.tp}")
    print(f"{'build':<26} {'peak per rank GB':>17} {'/ dense':>8} {'shard GB':>9}")
    for name, sharded in (("dense, then shard", False), ("per-shard (meta + init)", True)):
        rows = tpedu.launch(peak_growth, a.tp, config, sharded, backend="gloo")
        peak, shard = max(r[0] for r in rows), max(r[1] for r in rows) * 4
        print(f"{name:<26} {peak / GB:>17.2f} {peak / dense:>8.2f} {shard / GB:>9.2f}")
    print(f"ideal: 1/tp = {1 / a.tp:.2f} of the dense bytes at tp {a.tp}, plus a small constant")


if __name__ == "__main__":
    main()
