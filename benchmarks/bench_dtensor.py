"""tpedu's tensor-parallel GPT vs PyTorch's native TP (DTensor), same model, same machine.

    .venv/bin/python benchmarks/bench_dtensor.py [--tp 1 2 4] [--reps 7] [--sp] [--explicit]
                                                 [--overlap]

For each tp: tp ranks (1 thread each) build both models from the same dense weights, check that
they compute the same loss, then time full training steps (forward, backward, AdamW), alternating
tpedu / DTensor so machine noise hits both; medians of the slowest rank. Also prints the time
tpedu's ranks spend inside collectives (waiting included) and a single process using 2 threads
(the most a 2-core machine offers without any communication). Both models run the same
attention core: flash attention (F.scaled_dot_product_attention) by default, the explicit
softmax(q·kᵀ/√d)·v with --explicit (DenseGPT's and dtensor_gpt.GPT's fused_attention=False).
--overlap runs tpedu's TPGPT with overlap_comm=True; --sp runs both with sequence parallelism
(TPGPT's sequence_parallel=True, DTensor's SequenceParallel).

"no-comm" is tpedu's step with every collective skipped (wrong numbers, right compute; on a
separate copy of the model): the time no overlap or faster network could beat, so no-comm /
DTensor is the lowest ratio this machine allows for the same arithmetic.

"kernel" is the system CPU time per step of rank 0's process and its minor page faults: the
kernel mapping and zeroing fresh pages for large temporaries (glibc returns big freed buffers
to the kernel), plus gloo's socket calls.
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import statistics
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from dtensor_gpt import GPT, parallelize
from harness import BACKEND, BATCH, CONFIG, batch, interleaved, load, timed_communication
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel

import tpedu
from tpedu.comm.collectives import CompletedWork
from tpedu.model.config import GPTConfig
from tpedu.model.dense import DenseGPT
from tpedu.model.gpt import TPGPT
from tpedu.model.options import RunOptions


def copy_dense(gpt: GPT, dense: DenseGPT) -> None:
    """DenseGPT's weights into the DTensor-friendly GPT (fused qkv -> separate q, k, v)."""
    h = dense.config.hidden
    with torch.no_grad():
        gpt.tok_emb.weight.copy_(dense.tok_emb.weight)
        gpt.pos_emb.weight.copy_(dense.pos_emb.weight)
        gpt.lm_head.weight.copy_(dense.lm_head.weight)
        gpt.norm_f.load_state_dict(dense.norm_f.state_dict())
        for mine, ref in zip(gpt.blocks, dense.blocks, strict=True):
            mine.norm1.load_state_dict(ref.norm1.state_dict())
            mine.norm2.load_state_dict(ref.norm2.state_dict())
            for i, w in enumerate((mine.attn.wq, mine.attn.wk, mine.attn.wv)):
                w.weight.copy_(ref.attn.qkv.weight[i * h : (i + 1) * h])
                w.bias.copy_(ref.attn.qkv.bias[i * h : (i + 1) * h])
            mine.attn.wo.load_state_dict(ref.attn.out.state_dict())
            mine.mlp.fc1.load_state_dict(ref.mlp.fc1.state_dict())
            mine.mlp.fc2.load_state_dict(ref.mlp.fc2.state_dict())


@contextlib.contextmanager
def no_communication() -> Iterator[None]:
    """Every torch.distributed collective returns at once without moving data."""
    names = ["all_reduce", "all_gather_single", "reduce_scatter_single", "broadcast"]
    originals = {n: getattr(dist, n) for n in names}
    for n in names:
        setattr(dist, n, lambda *a, async_op=False, **k: CompletedWork() if async_op else None)
    try:
        yield
    finally:
        for n, fn in originals.items():
            setattr(dist, n, fn)


def kernel_time(step: Callable[[], None], steps: int = 3) -> tuple[float, float]:
    """System CPU seconds and minor page faults per call of `step`, this process (all threads)."""
    before = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(steps):
        step()
    after = resource.getrusage(resource.RUSAGE_SELF)
    return (after.ru_stime - before.ru_stime) / steps, (after.ru_minflt - before.ru_minflt) / steps


def worker(
    reps: int, sp: bool, config: GPTConfig, fused: bool = True, overlap: bool = False
) -> dict:
    """One rank: both models (sequence parallel with `sp`, attention fused or explicit, tpedu's
    f overlapped with `overlap`), their first losses, interleaved step times, comm, kernel time."""
    tp = dist.get_world_size()
    mesh = init_device_mesh("cpu", (tp,))
    torch.manual_seed(0)
    dense = DenseGPT(config, fused_attention=fused)
    options = RunOptions(sequence_parallel=sp, overlap_comm=overlap)
    ours, floor = TPGPT(dense, None, options=options), TPGPT(dense, None, options=options)
    theirs = GPT(config, fused_attention=fused)
    copy_dense(theirs, dense)
    parallelize(theirs, mesh, sequence_parallel=sp)
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-4)
    opt_floor = torch.optim.AdamW(floor.parameters(), lr=1e-4)
    opt_theirs = torch.optim.AdamW(theirs.parameters(), lr=1e-4)
    ids, tgt = batch(config)
    losses = {}

    def step_ours() -> None:
        opt_ours.zero_grad(set_to_none=True)
        loss = ours(ids, tgt)
        loss.backward()
        ours.sync_grads()
        opt_ours.step()
        losses["tpedu"] = loss.item()

    def step_floor() -> None:
        with no_communication():
            opt_floor.zero_grad(set_to_none=True)
            floor(ids, tgt).backward()
            floor.sync_grads()
            opt_floor.step()

    def step_theirs() -> None:
        opt_theirs.zero_grad(set_to_none=True)
        with loss_parallel():
            loss = F.cross_entropy(theirs(ids).flatten(0, 1), tgt.flatten())
            loss.backward()
        if sp:  # learned positions saw only this rank's rows
            dist.all_reduce(theirs.pos_emb.weight.grad)
        opt_theirs.step()
        losses["dtensor"] = (
            loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item()
        )

    step_ours()
    step_theirs()
    first = dict(losses)
    times = interleaved({"tpedu": step_ours, "dtensor": step_theirs, "floor": step_floor}, reps)
    comm = []
    for _ in range(3):
        with timed_communication() as acc:
            dist.barrier()
            step_ours()
        comm.append(acc["collective"])
    kernel = {"tpedu": kernel_time(step_ours), "dtensor": kernel_time(step_theirs)}
    return {"first_loss": first, "times": times, "comm": statistics.median(comm), "kernel": kernel}


def single(reps: int, config: GPTConfig, fused: bool = True) -> float:
    torch.manual_seed(0)
    dense = DenseGPT(config, fused_attention=fused)
    opt = torch.optim.AdamW(dense.parameters(), lr=1e-4)
    ids, tgt = batch(config)
    times = []
    for i in range(reps + 2):
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        dense(ids, tgt).backward()
        opt.step()
        if i >= 2:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--sp", action="store_true", help="sequence parallelism in both models")
    ap.add_argument("--explicit", action="store_true", help="explicit attention in both models")
    ap.add_argument("--overlap", action="store_true", help="tpedu with overlap_comm=True")
    args = ap.parse_args()
    c, fused = CONFIG, not args.explicit
    print(
        f"model: {c.n_layers} layers, d {c.hidden}, {c.n_heads} heads, vocab {c.vocab_size}, "
        f"seq {c.seq_len}, batch {BATCH}, fp32, AdamW; torch {torch.__version__}, gloo"
    )
    print(
        f"DTensor plan: Colwise/Rowwise, vocab-parallel embedding + head, loss_parallel"
        f"{', SequenceParallel norms (tpedu: sequence_parallel)' if args.sp else ''}; "
        f"attention: {'explicit' if args.explicit else 'fused (SDPA)'} in both"
        f"{'; tpedu overlap_comm' if args.overlap else ''}"
    )
    print(load())
    print(
        f"{'tp':>3} {'tpedu ms':>9} {'DTensor ms':>10} {'ratio':>6} {'comm ms':>8} "
        f"{'no-comm ms':>10} {'floor':>6} {'loss tpedu':>10} {'loss DTensor':>12}"
    )
    kernels = []
    for tp in args.tp:
        r = tpedu.launch(
            worker, tp, args.reps, args.sp, c, fused, args.overlap, timeout=1800, backend=BACKEND
        )[0]
        loss_t, loss_d = r["first_loss"]["tpedu"], r["first_loss"]["dtensor"]
        if abs(loss_t - loss_d) > 1e-5 * abs(loss_d):  # fp32, same sums reordered: ~1e-7
            raise SystemExit(
                f"tp {tp}: tpedu's loss {loss_t} != DTensor's {loss_d}; "
                "the two models do not compute the same thing"
            )
        t, d, f = (r["times"][k] for k in ("tpedu", "dtensor", "floor"))
        print(
            f"{tp:>3} {1e3 * t:>9.1f} {1e3 * d:>10.1f} {t / d:>6.2f} {1e3 * r['comm']:>8.1f} "
            f"{1e3 * f:>10.1f} {f / d:>6.2f} "
            f"{loss_t:>10.6f} {loss_d:>12.6f}"
        )
        kernels.append(
            f"tp {tp}: "
            + ", ".join(
                f"{label} {1e3 * sys_s:.0f} ms ({faults * resource.getpagesize() / 2**20:.0f} MB faulted in)"
                for label, (sys_s, faults) in zip(
                    ("tpedu", "DTensor"), r["kernel"].values(), strict=True
                )
            )
        )
    print(
        "ratio = tpedu / DTensor; comm = tpedu's time inside collectives (waits included); "
        "floor = no-comm / DTensor"
    )
    print("kernel time per step, rank 0 (page faults of fresh buffers, socket calls):")
    print("\n".join(kernels))
    one = tpedu.launch(single, 1, args.reps, c, fused, threads=2, backend=BACKEND)[0]
    print(f"single process, 2 threads, dense model: {1e3 * one:.1f} ms per step")
    print(load())


if __name__ == "__main__":
    main()
