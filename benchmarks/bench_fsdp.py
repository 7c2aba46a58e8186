"""tpedu's ZeRO-3 side by side with PyTorch's FSDP2 (`fully_shard`): same GPT, data, seed, AdamW.

    .venv/bin/python benchmarks/bench_fsdp.py [--dp 2 4] [--steps 5] [--reps 5] [--no-float64]

For each dp: dp gloo CPU ranks (1 thread each) build (a) tpedu's TPGPT at tp 1 sharded by
`ShardedDataParallel(level=3)` (`make_sharded`, what `train(..., ParallelConfig(dp=N, zero=3))`
uses), and (b) tpedu's plain DenseGPT with `fully_shard` applied to every block and then to the
root, over `init_device_mesh("cpu", (N,))`. Both start from the same weights (the seed's dense
model, checked element by element), see the same rows of the same batches, and run the same
optimizer step: AdamW (betas 0.9, 0.95, weight decay on matrices only), gradients clipped to a
global norm of 1. The script prints every step's loss for both and their largest relative
difference, then times more steps alternating the two (medians of the slowest rank, as
bench_dtensor.py) with the time each spends inside collectives and the elements it moves.

fp32 tolerances: losses 1e-5, gradient norms 1e-4 relative. The forward and backward are the
same arithmetic on the same rows; what differs is the order of some sums: TPGPT's loss is the
vocab-parallel cross-entropy (its own max, exp, sum), DenseGPT's F.cross_entropy; gloo's sum of a
gradient element depends on where the element falls in the buffer, and the two buffers are laid
out differently. Each is a rounding of ≈1e-7 relative, and the losses stay within ≈1e-7 over the
steps. The gradient norms differ more because clip_grad_norm_ sums the squares in float32 (tpedu
in float64): on this model's first gradients torch's float32 total norm is 1.9e-5 away from the
float64 one (one process, the same gradients). In float64 (run after the fp32 losses;
--no-float64 skips it) every one of these costs ≈1e-16, so 1e-12 is the check there.

What differs, and why it does not change the numbers:
- Layout. FSDP2 turns every parameter into a DTensor sharded on dim 0 (`Shard(0)`): rank r
  holds rows [r·⌈d0/N⌉, ...) of each parameter, padded per parameter to a multiple of N rows;
  an all-gather copies the parameters' shards into one flat buffer, gathers, and copies out per
  parameter. tpedu lays a unit's parameters (one block, or the rest: embeddings, final norm,
  head) end to end in one flat buffer, pads the buffer once to a multiple of N elements and
  gives rank r one contiguous slice; the parameters are views into the buffer, so a gather needs
  no copy in or out. AdamW updates elementwise, so either cut gives the same update.
- Root. FSDP2's root module (here embeddings, final norm, head) is not resharded after forward
  (reshard_after_forward=None means False for the root): its backward comes right after its
  forward. tpedu's rest-unit does the same and stays whole until the step. The blocks reshard
  after forward and are gathered again in backward in both.
- Prefetching. FSDP2 overlaps the next all-gather with compute through CUDA streams; on a CPU
  there are none, so its all-gathers and reduce-scatters run blocking where they are issued
  (`unshard_async_op` is False by default). tpedu starts the next block's all-gather (forward)
  or the previous block's (backward) as an async gloo work and reduce-scatters asynchronously,
  so some communication runs on gloo's thread while the rank computes.
- gloo's reduce-scatter (ProcessGroupGloo::reduce_scatter_tensor_coalesced) clones the input
  and all-reduces the whole of it, then keeps this rank's chunk: it moves an all-reduce's bytes,
  not half of them, and allocates a copy. Both sides use it; on NCCL it is a real reduce-scatter.
- The gradient mean. FSDP2 reduce-scatters with ReduceOp.AVG in fp32 (gloo supports it in
  torch 2.13) and, in float64, sums and then divides its shard by N (its overflow guard for
  dtypes other than fp32/bf16); tpedu sums and divides its shard by N.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import statistics
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from harness import BACKEND, BATCH, CONFIG, TINY, batch, interleaved, load, patched_communication
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

import tpedu
from tpedu.model.config import GPTConfig
from tpedu.model.dense import DenseGPT
from tpedu.model.gpt import grad_norm
from tpedu.model.sharded_init import build_sharded
from tpedu.parallel.mesh import Layout, Mesh
from tpedu.train.config import TrainConfig
from tpedu.train.optim import decayed, make_sharded
from tpedu.train.step import clip_grads

# Benchmark settings: a constant learning rate (the schedule is not what is compared).
SETTINGS = TrainConfig(lr=1e-3, weight_decay=0.1, grad_clip=1.0, progress=False)
Step = Callable[[torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, float]]


def tpedu_zero3(config: GPTConfig, cfg: TrainConfig, mesh: Mesh) -> tuple[Step, dict]:
    """tpedu's ZeRO-3 over mesh's DP group: step(x, y, lr) -> (this rank's loss, grad norm).
    Also returns the dense state dict it starts from."""
    model = build_sharded(config, mesh.tp_group, seed=cfg.seed)[0]
    start = model.gather_state_dict()
    sdp = make_sharded([model], cfg, 3, mesh)

    def step(x: torch.Tensor, y: torch.Tensor, lr: float) -> tuple[torch.Tensor, float]:
        for g in sdp.param_groups:
            g["lr"] = lr
        sdp.zero_grad()
        loss = model(x, y)
        loss.backward()
        sdp.finish()
        norm = grad_norm(sdp.weighted_grads())  # 1 world all-reduce
        clip_grads(sdp.shards(), norm, cfg.grad_clip)
        sdp.step()
        return loss.detach(), float(norm)

    return step, start


def fsdp2(config: GPTConfig, cfg: TrainConfig, mesh: DeviceMesh) -> tuple[Step, dict, nn.Module]:
    """DenseGPT of the seed under FSDP2 (every block, then the root), torch's AdamW with the
    same groups: step(x, y, lr) -> (this rank's loss, grad norm). Also returns the dense state
    dict it starts from and the model."""
    torch.manual_seed(cfg.seed)
    model = DenseGPT(config)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in params if decayed(p)], "weight_decay": cfg.weight_decay},
            {"params": [p for p in params if not decayed(p)], "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )

    def step(x: torch.Tensor, y: torch.Tensor, lr: float) -> tuple[torch.Tensor, float]:
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)  # a DTensor
        opt.step()
        return loss.detach(), float(norm.full_tensor())

    return step, start, model


def mean_over_ranks(loss: torch.Tensor) -> float:
    """The global batch's loss: the mean of the ranks' (equal-sized) batch means."""
    t = loss.double().reshape(1)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def same_start(a: dict, b: dict) -> None:
    if a.keys() != b.keys() or any(not torch.equal(a[k], b[k]) for k in a):
        raise SystemExit("tpedu's and FSDP2's models do not start from the same weights")


def build(config: GPTConfig, cfg: TrainConfig) -> tuple[Step, Step, nn.Module]:
    """Both models on this rank (collective): (tpedu's step, FSDP2's step, FSDP2's model)."""
    dp = dist.get_world_size()
    ours, start = tpedu_zero3(config, cfg, Mesh(Layout(1, 1, dp)))
    theirs, dense_start, model = fsdp2(config, cfg, init_device_mesh("cpu", (dp,)))
    same_start(start, dense_start)
    return ours, theirs, model


def train_both(
    config: GPTConfig,
    cfg: TrainConfig,
    batches: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    lr: Callable[[int], float],
    steps: int,
    built: tuple[Step, Step, nn.Module] | None = None,
) -> dict:
    """`steps` steps of each model on this rank's batches(step) at lr(step): every step's
    global loss and gradient norm for "tpedu" and "fsdp2". Collective."""
    ours, theirs, _ = built or build(config, cfg)
    out = {k: {"losses": [], "norms": []} for k in ("tpedu", "fsdp2")}
    for s in range(steps):
        x, y = batches(s)
        for name, step in (("tpedu", ours), ("fsdp2", theirs)):
            loss, norm = step(x, y, lr(s))
            out[name]["losses"].append(mean_over_ranks(loss))
            out[name]["norms"].append(norm)
    return out


# The collectives both sides call: FSDP2 the *_single names, tpedu's ZeRO their older aliases
# (which call distributed_c10d's own functions, so patching one name does not catch the other).
KINDS = {
    "all_gather_single": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_reduce": "all_reduce",
}


@contextlib.contextmanager
def communication() -> Iterator[dict[str, float]]:
    """Wall seconds inside collectives ("time": calls and waits on their work handles, as
    harness.timed_communication) and elements all-gathered (output size), reduce-scattered
    (input size) and all-reduced by this rank."""
    acc = {"time": 0.0, "all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}

    def count(name: str, bound: inspect.BoundArguments) -> None:
        kind = KINDS[name]
        args = list(bound.arguments.values())  # (output, input, ...)
        acc[kind] += args[1 if kind == "reduce_scatter" else 0].numel()

    with patched_communication(dict.fromkeys(KINDS, "collective"), count) as timed:
        try:
            yield acc
        finally:
            acc["time"] = timed["collective"]


def rows(config: GPTConfig, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the step's global batch [BATCH, seq]."""
    x, y = batch(config, BATCH, seed=step)
    n, r = dist.get_world_size(), dist.get_rank()
    b = BATCH // n
    return x[r * b : (r + 1) * b], y[r * b : (r + 1) * b]


def worker(config: GPTConfig, steps: int, reps: int, dtype: torch.dtype) -> dict:
    """One rank: both models' losses over `steps` steps, then (reps > 0) interleaved step
    times, time inside collectives and elements moved per step."""
    torch.set_default_dtype(dtype)
    built = build(config, SETTINGS)
    res = train_both(
        config, SETTINGS, lambda s: rows(config, s), lambda s: SETTINGS.lr, steps, built
    )
    if reps == 0:
        return res
    x, y = rows(config, steps)
    ours, theirs, _ = built
    fns = {"tpedu": lambda: ours(x, y, SETTINGS.lr), "fsdp2": lambda: theirs(x, y, SETTINGS.lr)}
    res["times"] = interleaved(fns, reps)
    res["comm"], res["elements"] = {}, {}
    for name, fn in fns.items():
        comm = []
        for _ in range(3):
            with communication() as acc:
                dist.barrier()
                fn()
            comm.append(acc.pop("time"))
        res["comm"][name], res["elements"][name] = statistics.median(comm), acc
    return res


def max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=5, help="training steps whose losses are compared")
    ap.add_argument("--reps", type=int, default=5, help="timed steps of each, alternating")
    ap.add_argument("--no-float64", action="store_true", help="skip the float64 check")
    ap.add_argument("--tiny", action="store_true", help="a tiny model (checks the code path)")
    args = ap.parse_args()
    c = TINY if args.tiny else CONFIG
    print(
        f"model: {c.n_layers} layers, d {c.hidden}, {c.n_heads} heads, vocab {c.vocab_size}, "
        f"seq {c.seq_len}, global batch {BATCH}, AdamW lr {SETTINGS.lr} wd {SETTINGS.weight_decay}"
        f" clip {SETTINGS.grad_clip}; torch {torch.__version__}, gloo, 1 thread per rank"
    )
    print(
        "tpedu: TPGPT (tp 1) + ShardedDataParallel(level=3); FSDP2: fully_shard(each block), "
        "fully_shard(DenseGPT)"
    )
    print(load())
    rows_out = []
    for dp in args.dp:
        r = tpedu.launch(
            worker, dp, c, args.steps, args.reps, torch.float32, timeout=1800, backend=BACKEND
        )[0]
        ours, theirs = r["tpedu"], r["fsdp2"]
        print(f"\ndp {dp}, fp32: step, loss tpedu, loss FSDP2, grad norm tpedu, grad norm FSDP2")
        for s, vals in enumerate(
            zip(ours["losses"], theirs["losses"], ours["norms"], theirs["norms"], strict=True)
        ):
            print(f"  {s:>3} {vals[0]:>12.8f} {vals[1]:>12.8f} {vals[2]:>12.8f} {vals[3]:>12.8f}")
        dl, dn = max_rel(ours["losses"], theirs["losses"]), max_rel(ours["norms"], theirs["norms"])
        verdict = "ok" if dl <= 1e-5 and dn <= 1e-4 else "OVER"
        print(
            f"  max relative difference: losses {dl:.1e}, grad norms {dn:.1e} (fp32, sums "
            f"reordered; tolerance 1e-5 and 1e-4: {verdict})"
        )
        if not args.no_float64:
            f = tpedu.launch(worker, dp, c, 3, 0, torch.float64, timeout=1800, backend=BACKEND)[0]
            dl = max_rel(f["tpedu"]["losses"], f["fsdp2"]["losses"])
            dn = max_rel(f["tpedu"]["norms"], f["fsdp2"]["norms"])
            verdict = "ok" if max(dl, dn) <= 1e-12 else "OVER 1e-12"
            print(
                f"  float64, 3 steps: max relative difference losses {dl:.1e}, grad norms "
                f"{dn:.1e} (tolerance 1e-12, {verdict})"
            )
        rows_out.append((dp, r))
    if not args.reps:
        return
    print(
        f"\n{'dp':>3} {'tpedu ms':>9} {'FSDP2 ms':>9} {'ratio':>6} {'comm tpedu':>10} "
        f"{'comm FSDP2':>10} {'AG tpedu':>9} {'AG FSDP2':>9} {'RS tpedu':>9} {'RS FSDP2':>9}"
    )
    for dp, r in rows_out:
        t, f = r["times"]["tpedu"], r["times"]["fsdp2"]
        e = r["elements"]
        print(
            f"{dp:>3} {1e3 * t:>9.1f} {1e3 * f:>9.1f} {t / f:>6.2f} "
            f"{1e3 * r['comm']['tpedu']:>10.1f} {1e3 * r['comm']['fsdp2']:>10.1f} "
            f"{e['tpedu']['all_gather'] / 1e6:>9.3f} {e['fsdp2']['all_gather'] / 1e6:>9.3f} "
            f"{e['tpedu']['reduce_scatter'] / 1e6:>9.3f} "
            f"{e['fsdp2']['reduce_scatter'] / 1e6:>9.3f}"
        )
    print(
        "ratio = tpedu / FSDP2 (medians, slowest rank); comm = time inside collectives, waits "
        "included; AG / RS = million elements all-gathered (output) / reduce-scattered (input) "
        "per step by one rank"
    )
    print(load())


if __name__ == "__main__":
    main()
