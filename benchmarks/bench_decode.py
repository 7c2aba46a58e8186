"""Decoding with the KV cache vs recomputing the window, measured on CPU ranks, and what the same
decode would cost on a GPU node, where it is bound by reading the weights.

    .venv/bin/python benchmarks/bench_decode.py [--tp 1 2] [--new 256] [--reps 3]

Part 1, measured (this machine's CPU ranks, one thread each, gloo): the benchmark model
(harness.CONFIG, with a context of 512 so that 256 new tokens fit) continues a 16-token prompt
by `--new` greedy tokens, with the cache (tpedu.serve: one token per forward) and without it
(the whole text through the model for every token), alternating the two, medians of the
slowest rank. Both give the same tokens (checked). Then the latency of a prefill of a
256-token prompt beside one decode step (a one-token forward against that cache), and at
tp > 1 what the α-β model (fitted to all-reduces timed on these ranks just before) gives the
step's 2·layers + 1 all-reduces of b·H values: the part of a step that is communication.

Part 2, predicted: one decode step of a batch of b sequences on a GPU, per TP rank, reads its
share of the weights (bf16: 2·N/tp bytes) and of the KV cache, and runs 2·layers + 1
all-reduces of b·h values (tpedu.analysis.whatif.decode_prediction: each at the cheaper of
lesson 15's α-β ring and NCCL's own estimate for its low-latency protocol, as NCCL picks its
protocol by size); the matmuls are b·2N/tp FLOPs, far below what the reads take at small b:

    step = 2·N/tp / (HBM · efficiency) + KV bytes / tp / (HBM · efficiency) + (2L+1)·AR(b·h·2)

HBM bandwidths are the datasheets' (H100 SXM 3.35 TB/s, A100 SXM 80 GB 2.0 TB/s), reached at
`--hbm-efficiency` (0.8). A few-KB all-reduce costs NCCL's latency, not bandwidth: 6.6 µs per
call plus 0.6 µs per ring step on NVLink (its tuning model), where the α-β ring's 5 µs per
step would charge 2(t-1) whole calls. Inference engines cut it further with one-shot
all-reduces over NVLink, which this model does not include.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch
from harness import BACKEND, CONFIG, TINY, interleaved, load, slowest

import tpedu
from tpedu.analysis.shape import ModelShape
from tpedu.analysis.whatif import HARDWARE, HBM_BANDWIDTH, decode_prediction
from tpedu.comm import cost_model
from tpedu.model import GPTConfig
from tpedu.model.dense import DenseGPT
from tpedu.model.gpt import TPGPT
from tpedu.serve.generate import Sampling, decode_step, generate_batch, pick, prefill
from tpedu.tp.kv_cache import KVCache

PROMPT = 16
HBM = HBM_BANDWIDTH  # datasheet bytes/s


def worker(config: GPTConfig, new: int, reps: int, prefill_len: int) -> dict[str, object]:
    """Seconds (slowest rank, medians) of `new` greedy tokens with and without the cache, of a
    prefill of `prefill_len` tokens and of one decode step after it. Collective."""
    torch.manual_seed(0)
    model = TPGPT(DenseGPT(config)).eval()
    g = torch.Generator().manual_seed(1)
    prompt = [torch.randint(0, config.vocab_size, (PROMPT,), generator=g).tolist()]
    runs = {}

    def run(use_cache: bool) -> None:
        runs[use_cache] = generate_batch(
            model, prompt, new, Sampling(greedy=True), use_cache=use_cache
        )

    t = interleaved({"cache": lambda: run(True), "recompute": lambda: run(False)}, reps, 1)
    long = [torch.randint(0, config.vocab_size, (prefill_len,), generator=g).tolist()]
    pre, step = [], []
    for _ in range(reps + 1):
        cache = KVCache.for_model(model, 1)
        t0 = time.perf_counter()
        logits = prefill(model, cache, long)
        pre.append(slowest(time.perf_counter() - t0))
        tok = pick(model, logits, g, 0.0)
        for _ in range(8):
            t0 = time.perf_counter()
            logits = decode_step(model, cache, tok)
            step.append(slowest(time.perf_counter() - t0))
            tok = pick(model, logits, g, 0.0)
    return {
        "cache": t["cache"],
        "recompute": t["recompute"],
        "same": runs[True] == runs[False],
        "prefill": sorted(pre[1:])[len(pre[1:]) // 2],
        "step": sorted(step[8:])[len(step[8:]) // 2],
        "comm": decode_all_reduces(config),
    }


def decode_all_reduces(config: GPTConfig) -> float:
    """Seconds the α-β model gives one decode step's 2·layers + 1 all-reduces of b·H fp32
    values (b = 1), with α and β fitted to all-reduces timed here just now. Collective."""
    t = torch.distributed.get_world_size()
    if t == 1:
        return 0.0
    message = 4 * config.hidden
    ab = cost_model.fit(cost_model.measure("all_reduce", [message, 16 * message, 256 * message]))
    return (2 * config.n_layers + 1) * ab.predict("all_reduce", message, t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--new", type=int, default=256, help="tokens to generate")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--hbm-efficiency", type=float, default=0.8)
    ap.add_argument("--tiny", action="store_true", help="a tiny model: checks the code path")
    a = ap.parse_args()
    base = TINY if a.tiny else CONFIG
    config = dataclasses.replace(base, seq_len=max(base.seq_len, PROMPT + a.new, 256))
    prefill_len = min(256, config.seq_len - 16)
    print(
        f"measured on 2 CPU cores (one thread per rank, gloo); model: {config.n_layers} layers, "
        f"d {config.hidden}, {config.n_heads} heads, vocab {config.vocab_size}, fp32, batch 1; "
        f"{a.new} greedy tokens after a {PROMPT}-token prompt"
    )
    print(load())
    print(
        f"{'tp':>3} {'cache tok/s':>12} {'recompute tok/s':>16} {'ratio':>6} "
        f"{f'prefill {prefill_len} ms':>16} {'per-token ms':>13} {'(2L+1) AR α-β ms':>17} "
        f"{'same tokens':>12}"
    )
    for tp in a.tp:
        r = tpedu.launch(worker, tp, config, a.new, a.reps, prefill_len, backend=BACKEND)[0]
        print(
            f"{tp:>3} {a.new / r['cache']:>12.1f} {a.new / r['recompute']:>16.1f} "
            f"{r['recompute'] / r['cache']:>6.1f} {1e3 * r['prefill']:>16.2f} "
            f"{1e3 * r['step']:>13.2f} {1e3 * r['comm']:>17.2f} "
            f"{'✓' if r['same'] else '✗':>12}"
        )
    print(load())
    shape = ModelShape()  # 6.6B: h 4096, 32 layers and heads, vocab 50,000
    print(
        f"\npredicted decode step, {shape.n_params / 1e9:.1f}B GPT (h {shape.hidden}, "
        f"{shape.n_layers} layers), bf16, context 2048, HBM at {a.hbm_efficiency:.0%} of peak"
    )
    print(
        f"{'GPU':<9} {'tp':>3} {'batch':>5} {'weights ms':>11} {'KV ms':>6} {'comm ms':>8} "
        f"{'step ms':>8} {'tok/s/seq':>9} {'GB/token':>9}"
    )
    for name, hbm in HBM.items():
        for batch in (1, 32):
            for tp in (1, 2, 4, 8):
                p = decode_prediction(shape, HARDWARE[name], hbm, tp, batch, 2048, a.hbm_efficiency)
                print(
                    f"{name:<9} {tp:>3} {batch:>5} {1e3 * p['weights']:>11.2f} "
                    f"{1e3 * p['kv']:>6.2f} {1e3 * p['comm']:>8.2f} {1e3 * p['total']:>8.2f} "
                    f"{1 / p['total']:>9.0f} {p['bytes_per_token'] / 1e9:>9.3f}"
                )


if __name__ == "__main__":
    main()
