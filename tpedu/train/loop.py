"""Lesson 07: train the tensor-parallel novel GPT, and (lesson 13) in 3D and 4D: one `train`.

`train(config, cfg, ..., parallel=ParallelConfig(...))` runs on every rank (launched by
`tpedu.launch`, the CLI, or torchrun). Every layout, plain tensor parallelism included (a
pipeline of one stage), builds a Mesh and one `TrainStep` (tpedu.train.step) and runs it in
`run_loop`. Every rank builds only its shards of the dense model the seed initialises
(tpedu.model.sharded_init: the same values as building the dense model and sharding it, without
its memory), draws the same batch as the rest of its replica (seeded by the step), and updates
only its own shards. With `out`, rank 0 writes the dense model directory (tpedu.train.export).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import asdict

import torch
import torch._dynamo  # the optimizers import it (≈3-5 s): once here, not per forked rank
import torch.distributed as dist
from tqdm import tqdm

from tpedu.comm import cost_model, recorder
from tpedu.comm.device import device
from tpedu.model.config import GPTConfig
from tpedu.model.dense import DenseGPT
from tpedu.parallel.config import ParallelConfig
from tpedu.parallel.mesh import Mesh
from tpedu.parallel.pipeline.runtime import run_schedule
from tpedu.parallel.pipeline.schedules import stage_layers
from tpedu.train.checkpoints import resume_from, save_if_due, saving_now  # lesson 14
from tpedu.train.config import TrainConfig
from tpedu.train.export import gather_pipeline_state, write_dense
from tpedu.train.precision import autocast
from tpedu.train.preempt import Preempted, agree_to_stop, sigterm_flag  # lesson 14
from tpedu.train.step import TrainStep, build_step, replica_mean, stage_chunks


def count_parameters(config: GPTConfig) -> int:
    """Parameters of the dense model (built on the meta device: no memory, no RNG use)."""
    with torch.device("meta"):
        return sum(p.numel() for p in DenseGPT(config).parameters())


def describe(parallel: ParallelConfig) -> str:
    """'tp=2 cp=2 pp=2 dp=2 ep=2', the axes larger than 1 (tp always): the progress bar's name."""
    layout = parallel.layout
    shown = {k: n for k, n in layout.sizes.items() if n > 1 or k == "tp"}
    return " ".join(f"{k}={n}" for k, n in (shown | layout.carved).items())


@torch.no_grad()
def evaluate(step: TrainStep, ids: torch.Tensor, cfg: TrainConfig) -> float:
    """Mean validation loss over cfg.eval_batches fixed batches (the same on every rank and
    every call): the forward passes of the pipeline, the loss averaged over the replicas."""
    forward_only = [("F", j, c) for c in range(len(step.chunks)) for j in range(step.micro_batches)]
    for chunk in step.chunks:
        chunk.eval()
    losses = []
    for i in range(cfg.eval_batches):
        xs, ys = step.batch(ids, i, cfg.seed + 1)
        with autocast(cfg.dtype, device()):
            res = run_schedule(step.chunks, forward_only, step.pipe, xs, ys, step.shape, step.dtype)
        losses.append(replica_mean(res.loss, step.mesh))
    for chunk in step.chunks:
        chunk.train()
    return sum(losses) / len(losses)


def train(
    config: GPTConfig,
    cfg: TrainConfig,
    train_ids: torch.Tensor,
    val_ids: torch.Tensor,
    out: str | None = None,
    tok: object | None = None,
    parallel: ParallelConfig | None = None,
    trace: bool = False,
) -> dict:
    """Train on every rank of the world as `parallel` says (None: tensor parallelism over the
    whole world); return a summary dict (the same on every rank). The same losses as one
    process, step by step.

    `cfg.batch` is the global batch: each DP replica draws its slice of the same global batch
    (`packed_batch(..., dp_rank, dp)`), splits it into `parallel.micro_batches` for the
    pipeline (`parallel.schedule`: "1f1b", "gpipe", or "interleaved" with `parallel.chunks`
    model chunks per rank), and every TP/CP/PP rank of a replica sees the same data. The
    step's communication is tpedu.train.step's; with ZeRO (`parallel.zero`), reduce-scatters
    replace the DP all-reduces and the parameters are all-gathered (tpedu.parallel.zero).
    Dropout masks depend on a tensor's batch position, so with dropout > 0 micro-batching
    changes them: the step-by-step match with one process holds for dropout = 0.
    With `trace`, every rank records its training steps (tpedu.comm.recorder), and rank 0's
    summary gets "clock": every rank's log and the loopback link fitted here, which
    `tpedu train --trace FILE` writes as a Chrome trace (tpedu.analysis.clock.trace).
    """
    parallel = parallel or ParallelConfig(tp=dist.get_world_size())
    if parallel.world != dist.get_world_size():
        raise ValueError(
            f"tp·cp·pp·dp = {parallel.world} does not match the world size "
            f"{dist.get_world_size()}; launch {parallel.world} ranks"
        )
    parallel.check(config)
    if out is not None:
        parallel.check_dense_export()
    mesh = Mesh(parallel.layout)
    chunks = stage_chunks(config, parallel, mesh, cfg.seed)
    step = build_step(chunks, mesh, parallel, cfg)
    first = resume_from(cfg, chunks, step.opt, step.scaler)  # 0 unless cfg.resume

    rec = recorder.Recorder(recorder.run_id()) if trace else None

    def one_step(k: int) -> tuple[float, float]:
        with rec or contextlib.nullcontext():  # recording: the steps only, not evaluation
            if rec:
                rec.mark(f"step {k}")
            res, norm = step(*step.batch(train_ids, k, cfg.seed), k)
            return replica_mean(res.loss, mesh), norm.item()

    losses, history, seconds = run_loop(
        cfg,
        first,
        f"train {describe(parallel)}",
        one_step,
        evaluate=lambda: evaluate(step, val_ids, cfg),
        save=lambda k: save_if_due(
            cfg, k, chunks, step.opt, parallel=parallel, tok=tok, scaler=step.scaler
        ),
    )
    summary = _summary(config, parallel, cfg, step, losses, history, seconds)
    if rec is not None:
        logs, link = recorder.gather(rec.log), loopback_link()
        if dist.get_rank() == 0:
            summary["clock"] = {"logs": logs, "link": link}
    if out is not None:
        with step.opt.gathered() if parallel.zero else contextlib.nullcontext():
            state = gather_pipeline_state(chunks, mesh, parallel.stage_split)
        write_dense(state, config, cfg, out, tok)
    return summary


def loopback_link() -> cost_model.AlphaBeta:
    """α-β of this machine's link, fitted on every rank as `tpedu commbench` does (all-reduce,
    all-gather, reduce-scatter of 4 KB, 64 KB, 1 MB). Collective."""
    samples = []
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        samples += cost_model.measure(op, [4096, 65536, 1 << 20])
    return cost_model.fit(samples)


def run_loop(
    cfg: TrainConfig,
    first: int,
    desc: str,
    step: Callable[[int], tuple[float, float]],
    evaluate: Callable[[], float],
    save: Callable[[int], object],
) -> tuple[list[float], list[dict], float]:
    """The training loop of every layout: returns (losses, history, seconds).

    Runs optimizer steps first .. cfg.steps-1; `step(k)` runs step k on this rank and returns
    (loss, gradient norm), the same on every rank. After each step `save(k + 1)` (a sharded
    checkpoint when due); every cfg.eval_every steps and at the end, `evaluate()` gives the
    validation loss. The progress bar and the evaluation lines are rank 0's.

    Preemption (lesson 14, tpedu.train.preempt): SIGTERM on any rank stops every rank after the
    same step k: `save(k + 1)` saves whether due or not (cfg.ckpt_dir; without one nothing is
    saved) and `Preempted(k + 1, path)` is raised. One 4-byte all-reduce per step decides it.
    """
    rank0 = dist.get_rank() == 0
    losses: list[float] = []
    history: list[dict] = []
    start = time.perf_counter()
    bar = tqdm(range(first, cfg.steps), disable=not (cfg.progress and rank0), desc=desc)
    with sigterm_flag() as sigterm:
        for k in bar:
            loss, norm = step(k)
            losses.append(loss)
            saved = save(k + 1)
            if agree_to_stop(sigterm):  # after every step, so every rank stops at the same one
                if saved is None:  # not due: save anyway (None again without a ckpt_dir)
                    with saving_now():
                        saved = save(k + 1)
                bar.close()
                raise Preempted(k + 1, saved)
            bar.set_postfix(loss=f"{loss:.3f}")
            if cfg.eval_every and ((k + 1) % cfg.eval_every == 0 or k + 1 == cfg.steps):
                val = evaluate()
                history.append(
                    {"step": k + 1, "train_loss": loss, "val_loss": val, "grad_norm": norm}
                )
                if rank0 and cfg.progress:
                    bar.write(f"step {k + 1:>5}: train loss {loss:.4f}  val loss {val:.4f}")
    return losses, history, time.perf_counter() - start


def _summary(
    config: GPTConfig,
    parallel: ParallelConfig,
    cfg: TrainConfig,
    step: TrainStep,
    losses: list[float],
    history: list[dict],
    seconds: float,
) -> dict:
    """The run's JSON summary: final losses, tokens/s, parameters per rank, layout, settings."""
    stages = stage_layers(config, parallel.pp * parallel.chunks, parallel.stage_split)
    summary = {
        "final_train_loss": losses[-1] if losses else None,
        "final_val_loss": history[-1]["val_loss"] if history else None,
        "tokens_per_second": len(losses) * cfg.batch * config.seq_len / seconds
        if seconds
        else None,
        "parameters_per_rank": sum(
            p.numel() for p in torch.nn.ModuleList(step.chunks).parameters()
        ),
        "parameters_total": count_parameters(config),
        **parallel.layout.sizes,
        "micro_batches": step.micro_batches,
        "zero": parallel.zero,
        "schedule": parallel.schedule,
        "chunks": parallel.chunks,
        "stages": [[r.start, r.stop] for r in stages],
        "losses": losses,
        "history": history,
        "settings": {
            "model": config.to_dict(),
            "parallel": parallel.to_dict(),
            "train": asdict(cfg),
        },
    }
    if step.scaler is not None:
        summary["loss_scale"] = step.scaler.state_dict()
    return summary
