"""Hiding TP's communication on CPU ranks: one forward + backward of the benchmark model per way
of running TP, with the same weights, timed here (wall clock, slowest rank, medians of
alternating runs).

    .venv/bin/python benchmarks/bench_tp_overlap.py [--tp 2] [--reps 7]
    .venv/bin/python benchmarks/bench_tp_overlap.py --priced [--tp 2]

`--priced`: instead, one recorded block step per way (h 128, s 64, b 4) priced as a 7B-like
layer (h 4096, s 4096) on an H100 SXM node with NVLink links (tpedu.analysis.clock.tp_overlap,
lesson 19): not a measurement, a replay of this machine's recording on a modelled device.

The ways: plain TP; Megatron's asynchronous dL/dx all-reduce beside dL/dW (`overlap_comm`);
micro-batch-split blocks (`tp_overlap="chunks"`, 2 and 4 chunks: each chunk's all-reduce runs
while the next chunk computes); sequence parallelism, and SP with collective matmul
(`tp_overlap="ring"`). Every way's loss is the plain one's (printed beside the times).

On 2 CPU cores gloo's communication and the ranks' matmuls share the same cores, so hiding
communication behind compute buys little or nothing here; what each way would hide on a GPU node
is the rank clocks' question (tpedu.analysis.clock, lesson 11).
"""

from __future__ import annotations

import argparse

import torch
from harness import BACKEND, BATCH, CONFIG, batch, interleaved, load

import tpedu
from tpedu.analysis.clock import tp_overlap
from tpedu.model.config import GPTConfig
from tpedu.model.dense import DenseGPT
from tpedu.model.gpt import TPGPT
from tpedu.model.options import RunOptions

WAYS = {
    "tp": RunOptions(),
    "tp, async dL/dx": RunOptions(overlap_comm=True),
    "tp, 2 chunks": RunOptions(tp_overlap="chunks", tp_chunks=2),
    "tp, 4 chunks": RunOptions(tp_overlap="chunks", tp_chunks=4),
    "sp": RunOptions(sequence_parallel=True),
    "sp, ring": RunOptions(sequence_parallel=True, tp_overlap="ring"),
}


def run(config: GPTConfig, reps: int) -> dict[str, tuple[float, float]]:
    """{way: (median seconds of a forward + backward, its loss)} on this rank. Collective."""
    torch.manual_seed(0)
    dense = DenseGPT(config)
    models = {name: TPGPT(dense, options=options) for name, options in WAYS.items()}
    ids, targets = batch(config)
    losses: dict[str, float] = {}

    def step(name: str) -> None:
        models[name].zero_grad(set_to_none=True)
        loss = models[name](ids, targets)
        loss.backward()
        losses[name] = loss.item()

    times = interleaved({name: (lambda n=name: step(n)) for name in models}, reps)
    return {name: (times[name], losses[name]) for name in models}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--priced", action="store_true", help="price a recorded step (H100)")
    args = parser.parse_args()
    if args.priced:
        small = GPTConfig.gpt2_like(64, seq_len=64, n_layers=1, hidden=128, n_heads=8)
        logs = tpedu.launch(tp_overlap.record_block, args.tp, small, 4, backend=BACKEND)[0]
        print(f"tp {args.tp}, a 7B-like layer (h 4096, s 4096, b 1), forward + backward, priced")
        print("(H100 SXM at 70 % of peak, NVLink α-β; ms; recorded here on CPU ranks)")
        print(tp_overlap.table(tp_overlap.priced(logs, small, 4)))
        return
    rows = tpedu.launch(run, args.tp, CONFIG, args.reps, backend=BACKEND, timeout=None)[0]
    print(f"tp {args.tp}, batch {BATCH}, seq {CONFIG.seq_len}, hidden {CONFIG.hidden}; {load()}")
    base_time, base_loss = rows["tp"]
    print(f"{'way':<18} {'ms (wall clock here)':>21} {'vs tp':>7} {'|loss - tp loss|':>17}")
    for name, (seconds, loss) in rows.items():
        print(
            f"{name:<18} {1e3 * seconds:>21.1f} {seconds / base_time:>7.2f} "
            f"{abs(loss - base_loss):>17.1e}"
        )


if __name__ == "__main__":
    main()
