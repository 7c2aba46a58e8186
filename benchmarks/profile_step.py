"""Where a training step's time goes: torch.profiler on tpedu's TPGPT and the DTensor model.

    .venv/bin/python benchmarks/profile_step.py [--tp 2] [--rows 25]

One warm-up step, then one profiled step of each model on rank 0 (the same weights and batch as
bench_dtensor.py); prints the ops sorted by self CPU time and writes Chrome traces
(/tmp/tpedu_step_rank0.json, /tmp/dtensor_step_rank0.json) for chrome://tracing or Perfetto.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_dtensor import copy_dense
from dtensor_gpt import GPT, parallelize
from harness import BACKEND, CONFIG, batch, load
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel
from torch.profiler import ProfilerActivity, profile

import tpedu
from tpedu.model.dense import DenseGPT
from tpedu.model.gpt import TPGPT


def worker(rows: int) -> dict[str, str]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    dense = DenseGPT(CONFIG)
    ours, theirs = TPGPT(dense, None), GPT(CONFIG)
    copy_dense(theirs, dense)
    parallelize(theirs, mesh)
    opt_ours = torch.optim.AdamW(ours.parameters())
    opt_theirs = torch.optim.AdamW(theirs.parameters())
    ids, tgt = batch()

    def step_ours() -> None:
        opt_ours.zero_grad()
        ours(ids, tgt).backward()
        ours.sync_grads()
        opt_ours.step()

    def step_theirs() -> None:
        opt_theirs.zero_grad()
        with loss_parallel():
            F.cross_entropy(theirs(ids).flatten(0, 1), tgt.flatten()).backward()
        opt_theirs.step()

    out = {}
    for name, fn in (("tpedu", step_ours), ("dtensor", step_theirs)):
        fn()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        prof.export_chrome_trace(f"/tmp/{name}_step_rank{dist.get_rank()}.json")
        out[name] = prof.key_averages().table(
            sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=40
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--rows", type=int, default=25)
    a = ap.parse_args()
    print(load())
    r = tpedu.launch(worker, a.tp, a.rows, timeout=1800, backend=BACKEND)[0]
    for name in ("tpedu", "dtensor"):
        print(f"\n{name}, tp {a.tp}, rank 0, one training step\n{r[name]}")
    print(load())


if __name__ == "__main__":
    main()
