"""Lesson 07: train the tensor-parallel novel GPT, and (lesson 13) in 3D: one `train` for both.

`train(config, cfg, ..., parallel=ParallelConfig(...))` runs on every rank (launched by
`tpedu.launch`, the CLI, or torchrun). Plain tensor parallelism (`parallel.tp_only`) runs a
model of the whole depth on every rank; anything else (pipeline, DP replicas, ZeRO,
micro-batches) runs the 3D step, `step_3d`. Both go through the one loop, `run_loop`. Every
rank builds only its shards of the dense model the seed initialises (tpedu.model.sharded_init:
the same values as building the dense model and sharding it, without its memory), draws the
same batch as the rest of its TP group (seeded by the step), and updates only its own shards.

Saved models are a directory: `config.json` (model + training settings), `tokenizer.json`, and
`model.safetensors` with the *dense* state dict (gathered from the shards), written atomically
(temporary directory, then rename). Sharded, reshardable checkpoints are lesson 14.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch._dynamo  # the optimizers import it (≈3-5 s): once here, not per forked rank
import torch.distributed as dist
from tqdm import tqdm

from tpedu.checkpoint.convert import write_model_dir
from tpedu.checkpoint.sharded import resume_from, save_if_due, saving_now  # lesson 14
from tpedu.comm import collectives
from tpedu.launcher import device
from tpedu.model.config import GPTConfig
from tpedu.model.dense import DenseGPT
from tpedu.model.gpt import TPGPT
from tpedu.model.sharded_init import build_sharded
from tpedu.parallel.config import ParallelConfig
from tpedu.parallel.data_parallel import DataParallel
from tpedu.parallel.mesh import Mesh
from tpedu.parallel.pipeline.runtime import (
    Pipe,
    StepResult,
    run_schedule,
    sync_tied_grads,
    tied_params,
)
from tpedu.parallel.pipeline.schedules import schedule as pipeline_schedule
from tpedu.parallel.pipeline.schedules import stage_layers, stage_of
from tpedu.parallel.zero import ShardedDataParallel
from tpedu.tp.sharding import divisors
from tpedu.train.data.batches import packed_batch
from tpedu.train.precision import DTYPES, LossScaler, autocast, make_scaler
from tpedu.train.preempt import Preempted, agree_to_stop, sigterm_flag  # lesson 14


@dataclass
class TrainConfig:
    steps: int = 200
    batch: int = 8
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 50
    eval_batches: int = 4
    seed: int = 0
    progress: bool = True
    ckpt_dir: str | None = None  # sharded checkpoints (lesson 14) go here ...
    save_every: int = 0  # ... every this many steps (and at the end); 0: only at the end
    resume: str | None = None  # a checkpoint (step dir or its parent) to continue from
    dtype: str = "fp32"  # "bf16" / "fp16": autocast compute, fp32 master weights (precision.py)
    grad_reduce: str = "fp32"  # DP all-reduce of the gradients: "fp32", or "low" (= dtype)
    param_gather: str = "fp32"  # ZeRO-2/3's parameter all-gathers: "fp32", or "low" (= dtype)
    loss_scale: float = 2.0**16  # fp16: the initial loss scale ...
    loss_scale_window: int = 1000  # ... doubled after this many steps without an overflow

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        for name in ("grad_reduce", "param_gather"):
            if getattr(self, name) not in ("fp32", "low"):
                raise ValueError(f"{name} must be 'fp32' or 'low', got {getattr(self, name)!r}")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to min_lr (the seed's 'warmup + cosine')."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(frac, 1.0)))


def context_parallel_groups(
    parallel: ParallelConfig,
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """(this rank's TP group, its CP group) for tp·cp ranks, the mesh's order (tp fastest), so
    a TP group is consecutive ranks (one node) and a CP group strides over them. (None, None)
    without context parallelism: TP over the whole world. Collective."""
    if parallel.cp == 1:
        return None, None
    rank, mine = dist.get_rank(), []
    for name, groups in (("tp", parallel.layout.tp_groups()), ("cp", parallel.layout.cp_groups())):
        for ranks in groups:
            g = dist.new_group(ranks)  # collective: every rank creates every group
            if rank in ranks:
                mine.append(collectives.name_group(g, name))
    return mine[0], mine[1]


def build_model(
    config: GPTConfig,
    seed: int,
    group: dist.ProcessGroup | None = None,
    parallel: ParallelConfig | None = None,
    cp_group: dist.ProcessGroup | None = None,
) -> TPGPT:
    """This rank's shards of the dense model that `seed` initialises (the same on every rank),
    built without materialising the dense model (tpedu.model.sharded_init), run as `parallel`
    says (sequence parallelism, recompute, overlap)."""
    options = parallel.model_options() if parallel else {}
    if cp_group is not None:
        options["cp_group"] = cp_group
    return build_sharded(config, group, seed=seed, **options)[0].to(device())


def count_parameters(config: GPTConfig) -> int:
    """Parameters of the dense model (built on the meta device: no memory, no RNG use)."""
    with torch.device("meta"):
        return sum(p.numel() for p in DenseGPT(config).parameters())


def decayed(p: torch.nn.Parameter) -> bool:
    """Whether AdamW decays p: matrices yes; norms and biases no."""
    return p.dim() >= 2


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not on norms, biases)."""
    decay = [p for p in model.parameters() if decayed(p)]
    other = [p for p in model.parameters() if not decayed(p)]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": other, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))


def make_sharded(
    chunks: Sequence[TPGPT], cfg: TrainConfig, level: int, mesh: Mesh
) -> ShardedDataParallel:
    """ZeRO-1/2/3 over the DP group for this rank's chunks: AdamW as make_optimizer's; the
    gradients TP and the tied embedding fix up are reduce-scattered after the fix-ups; the
    gradient norm weighs each element as TPGPT.squared_grad_sum does (a tied head's second copy
    left out, as grad_norm_3d leaves it)."""

    def weight_of(chunk: TPGPT, name: str) -> float | torch.Tensor:
        if chunk.get_parameter(name) is tied_head_copy(chunk):
            return 0.0
        return 1.0 / chunk.copies_of(name)

    defer = [p for c in chunks for p in c.grad_sync_params()] + tied_params(chunks)
    return ShardedDataParallel(
        chunks,
        mesh.dp_group,
        level,
        decay=decayed,
        weight_of=weight_of,
        defer=defer,
        reduce_dtype=DTYPES[cfg.dtype] if cfg.grad_reduce == "low" else None,
        gather_dtype=DTYPES[cfg.dtype] if cfg.param_gather == "low" else None,
        lr=cfg.lr,
        betas=(0.9, 0.95),
        weight_decay=cfg.weight_decay,
    )


def make_data_parallel(
    chunks: Sequence[TPGPT], cfg: TrainConfig, zero: int, mesh: Mesh
) -> tuple[DataParallel | ShardedDataParallel | None, torch.optim.Optimizer | ShardedDataParallel]:
    """A 3D rank's gradient reducer over its DP group and its optimizer: with ZeRO (zero ≥ 1)
    one ShardedDataParallel is both; without, DataParallel's bucketed all-reduce (None at
    dp 1) and make_optimizer's AdamW over all of this rank's chunks."""
    if zero:
        sharded = make_sharded(chunks, cfg, zero, mesh)
        return sharded, sharded
    stage = torch.nn.ModuleList(chunks)
    low = DTYPES[cfg.dtype] if cfg.grad_reduce == "low" else None
    dpar = DataParallel(stage, mesh.dp_group, reduce_dtype=low) if mesh.layout.dp > 1 else None
    return dpar, make_optimizer(stage, cfg)


@torch.no_grad()
def evaluate(model: TPGPT, ids: torch.Tensor, cfg: TrainConfig, batches: int) -> float:
    """Mean loss over `batches` fixed batches (the same on every rank and every call)."""
    model.eval()
    seq = model.config.seq_len
    losses = []
    for i in range(batches):
        x, y = (model.local_sequence(t) for t in packed_batch(ids, cfg.batch, seq, i, cfg.seed + 1))
        with autocast(cfg.dtype, device()):
            losses.append(model(x.to(device()), y.to(device())).item())
    model.train()
    return sum(losses) / len(losses)


def clip_grads(params: Iterable[torch.nn.Parameter], norm: torch.Tensor, max_norm: float) -> None:
    """Scale gradients so their global norm (computed across ranks by the caller) is <= max_norm."""
    if max_norm <= 0:
        return
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(scale.to(p.grad.dtype))


def train_step(
    model: TPGPT,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    step: int,
    cfg: TrainConfig,
    scaler: LossScaler | None = None,
) -> tuple[float, float]:
    """One optimizer step; returns (loss, gradient norm before clipping). With a LossScaler
    (fp16) the backward runs on the scaled loss; a step whose gradients overflow on any rank is
    skipped (weights and AdamW states untouched) and its norm reported as inf."""
    for g in opt.param_groups:
        g["lr"] = lr_at(step, cfg)
    with autocast(cfg.dtype, x.device):
        loss = model(x, y, step=step)
    opt.zero_grad(set_to_none=True)
    (loss * scaler.scale if scaler else loss).backward()
    model.sync_grads()
    if finish_scaled(scaler, model.parameters()):
        return loss.item(), math.inf
    norm = model.grad_norm()
    clip_grads(model.parameters(), norm, cfg.grad_clip)
    opt.step()
    return loss.item(), norm.item()


def finish_scaled(scaler: LossScaler | None, params: Iterable[torch.nn.Parameter]) -> bool:
    """Unscale the gradients and update the scale; True if this step must be skipped."""
    if scaler is None:
        return False
    overflow = scaler.unscale_and_check(params)
    scaler.update(overflow)
    return overflow


def train(
    config: GPTConfig,
    cfg: TrainConfig,
    train_ids: torch.Tensor,
    val_ids: torch.Tensor,
    out: str | None = None,
    tok: object | None = None,
    parallel: ParallelConfig | None = None,
) -> dict:
    """Train on every rank of the world as `parallel` says (None: tensor parallelism over the
    whole world); return a summary dict (the same on every rank)."""
    parallel = parallel or ParallelConfig(tp=dist.get_world_size())
    if parallel.world != dist.get_world_size():
        raise ValueError(
            f"tp·cp·pp·dp = {parallel.world} does not match the world size "
            f"{dist.get_world_size()}; launch {parallel.world} ranks"
        )
    parallel.check(config)
    if not parallel.tp_only:
        return _train_3d(config, parallel, cfg, train_ids, val_ids, out, tok)
    tp = parallel.tp
    tp_group, cp_group = context_parallel_groups(parallel)
    model = build_model(config, cfg.seed, tp_group, parallel, cp_group)
    opt = make_optimizer(model, cfg)
    scaler = make_scaler(cfg.dtype, cfg.loss_scale, cfg.loss_scale_window)
    first = resume_from(cfg, model, opt, scaler)  # 0 unless cfg.resume

    def step(k: int) -> tuple[float, float]:
        x, y = (
            model.local_sequence(t)
            for t in packed_batch(train_ids, cfg.batch, config.seq_len, k, cfg.seed)
        )
        return train_step(model, opt, x.to(device()), y.to(device()), k, cfg, scaler)

    losses, history, seconds = run_loop(
        cfg,
        first,
        f"train tp={tp}" + (f" cp={parallel.cp}" if parallel.cp > 1 else ""),
        step,
        evaluate=lambda: evaluate(model, val_ids, cfg, cfg.eval_batches),
        save=lambda k: save_if_due(cfg, k, model, opt, parallel=parallel, tok=tok, scaler=scaler),
    )
    cp = {"cp": parallel.cp} if parallel.cp > 1 else {}
    summary = _summary(config, parallel, cfg, losses, history, seconds, model, tp=tp, **cp)
    if scaler is not None:
        summary["loss_scale"] = scaler.state_dict()
    if out is not None:
        _write_dense(model.gather_state_dict(), config, cfg, out, tok)
    return summary


def run_loop(
    cfg: TrainConfig,
    first: int,
    desc: str,
    step: Callable[[int], tuple[float, float]],
    evaluate: Callable[[], float],
    save: Callable[[int], object],
) -> tuple[list[float], list[dict], float]:
    """The one training loop of every layout (TP only, 3D): returns (losses, history, seconds).

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


def _write_dense(
    state: dict[str, torch.Tensor],
    config: GPTConfig,
    cfg: TrainConfig,
    out: str | Path,
    tok: object | None,
) -> None:
    """Rank 0 writes the gathered dense state as a model directory (`train --out`)."""
    if dist.get_rank() == 0:
        write_model_dir(out, config, state, asdict(cfg), tok)


def _summary(
    config: GPTConfig,
    parallel: ParallelConfig,
    cfg: TrainConfig,
    losses: list[float],
    history: list[dict],
    seconds: float,
    model: torch.nn.Module,
    **layout: object,
) -> dict:
    """The run's JSON summary: final losses, tokens/s, parameters per rank, layout, settings."""
    return {
        "final_train_loss": losses[-1] if losses else None,
        "final_val_loss": history[-1]["val_loss"] if history else None,
        "tokens_per_second": len(losses) * cfg.batch * config.seq_len / seconds
        if seconds
        else None,
        "parameters_per_rank": sum(p.numel() for p in model.parameters()),
        "parameters_total": count_parameters(config),
        **layout,
        "losses": losses,
        "history": history,
        "settings": {
            "model": config.to_dict(),
            "parallel": parallel.to_dict(),
            "train": asdict(cfg),
        },
    }


def default_micro_batches(per_rank_batch: int, pp: int) -> int:
    """The largest m ≤ 2·pp dividing the per-DP-rank batch (1 without pipelining)."""
    if pp == 1:
        return 1
    return max(m for m in divisors(per_rank_batch) if m <= 2 * pp)


def tied_head_copy(chunk: TPGPT) -> torch.nn.Parameter | None:
    """The last stage's own copy of a tied embedding (its head), which the gradient norm leaves
    out: after `sync_tied_grads` its gradient equals the first stage's table's. None if untied
    or if this chunk has no separate head."""
    tied = chunk.config.tie_embeddings and chunk.lm_head is not None
    return chunk.lm_head.weight if tied else None


def grad_norm_3d(chunks: Sequence[TPGPT], mesh: Mesh) -> torch.Tensor:
    """L2 norm of the whole model's gradient on every rank of a 3D layout. 2 small all-reduces.

    `chunks`: this rank's TPGPT chunks (one, or several with the interleaved schedule). Within
    a stage, TP copies are counted once (as `TPGPT.grad_norm`); then the stages' sums of
    squares are added over the PP group, leaving out the last stage's copy of a tied embedding
    (its gradient equals the first stage's after `sync_tied_grads`). DP replicas hold
    identical gradients after the all-reduce: no DP reduction.
    """
    sq = torch.zeros((), dtype=torch.float64, device=next(chunks[0].parameters()).device)
    for chunk in chunks:
        sq += chunk.squared_grad_sum(skip=tied_head_copy(chunk))
    collectives.all_reduce(sq, mesh.tp_group)
    return collectives.all_reduce(sq, mesh.pp_group).sqrt()


def grad_norm_sharded(sharded: ShardedDataParallel, mesh: Mesh) -> torch.Tensor:
    """grad_norm_3d's norm from ZeRO-2/3's gradient shards: each DP rank holds 1/N of every
    element, so the DP group sums too. 3 small all-reduces (DP, TP, PP)."""
    sq = sharded.squared_grad_sum()
    for group in (mesh.dp_group, mesh.tp_group, mesh.pp_group):
        collectives.all_reduce(sq, group)
    return sq.sqrt()


def replica_mean(value: torch.Tensor | None, mesh: Mesh) -> float:
    """The last stage's loss, averaged over DP replicas, on every rank (1 world all-reduce).
    TP and CP ranks of a stage hold the same loss (CP's is already the whole sequence's mean):
    only the first of each adds it."""
    t = torch.zeros((), dtype=torch.float64, device=device())
    if value is not None and mesh.tp_rank == 0 and mesh.cp_rank == 0:
        t += value.double()
    return collectives.all_reduce(t).item() / mesh.layout.dp


def step_3d(
    chunks: list[TPGPT],
    opt: torch.optim.Optimizer | ShardedDataParallel,
    mesh: Mesh,
    pipe: Pipe,
    acts: list,
    xs: list[torch.Tensor],
    ys: list[torch.Tensor],
    shape: tuple,
    dtype: torch.dtype,
    dpar: DataParallel | ShardedDataParallel | None,
    max_norm: float,
    step: int = 0,
    precision: str = "fp32",
    scaler: LossScaler | None = None,
) -> tuple[StepResult, torch.Tensor]:
    """One training step of this rank's stage; returns (run_schedule's result, gradient norm).

    chunks: this rank's TPGPT chunks (one, or several with the interleaved schedule); xs, ys:
    this replica's micro-batches (the first / last stage use them); acts: the pipeline
    schedule's actions. Communication, in order: the pipeline's sends and receives, DP bucket
    all-reduces during the last micro-batch's backward (`dpar`; with ZeRO reduce-scatters, the
    fix-ups' after them), the tied-embedding all-reduce (first + last stage), the TP gradient
    fix-ups, 2 all-reduces for the global gradient norm (3 with ZeRO).
    `precision` / `scaler`: as train_step's (an fp16 overflow skips the step: norm = inf).
    """
    opt.zero_grad(set_to_none=True)
    no_sync = dpar.no_sync if dpar else None
    scale = scaler.scale if scaler else 1.0
    with autocast(precision, next(chunks[0].parameters()).device):
        res = run_schedule(
            chunks, acts, pipe, xs, ys, shape, dtype, step=step, no_sync=no_sync, loss_scale=scale
        )
    sharded = isinstance(dpar, ShardedDataParallel)
    if dpar is not None and not sharded:
        dpar.finish()
    sync_tied_grads(chunks, mesh.emb_group)
    for chunk in chunks:
        chunk.sync_grads()
    if sharded:  # ZeRO reduce-scatters what the fix-ups have summed: they come first
        dpar.finish()
        grads = dpar.shards()
    else:
        grads = [p for chunk in chunks for p in chunk.parameters()]
    if finish_scaled(scaler, grads):
        return res, torch.tensor(math.inf)
    norm = grad_norm_sharded(dpar, mesh) if sharded else grad_norm_3d(chunks, mesh)
    clip_grads(grads, norm, max_norm)
    opt.step()
    return res, norm


def _train_3d(
    config: GPTConfig,
    parallel: ParallelConfig,
    cfg: TrainConfig,
    train_ids: torch.Tensor,
    val_ids: torch.Tensor,
    out: str | None = None,
    tok: object | None = None,
) -> dict:
    """Train with tp·pp·dp ranks (the world); the same losses as one process, step by step.

    `cfg.batch` is the global batch: each DP replica draws its slice of the same global batch
    (`packed_batch(..., dp_rank, dp)`), splits it into `parallel.micro_batches` for the
    pipeline (`parallel.schedule`: "1f1b", "gpipe", or "interleaved" with `parallel.chunks`
    model chunks per rank), and every TP/PP rank of a replica sees the same data. Per step: the
    pipeline's point-to-point sends, bucketed DP all-reduces during the last micro-batch's
    backward, the tied-embedding all-reduce (first + last stage), 2 all-reduces for the gradient
    norm; with ZeRO (`parallel.zero`), reduce-scatters in their place and all-gathers of the
    parameters (tpedu.parallel.zero).
    Dropout masks depend on a tensor's batch position, so with dropout > 0 micro-batching
    changes them: the step-by-step match with one process holds for dropout = 0.
    """
    tp, pp, dp, kind, zero = parallel.tp, parallel.pp, parallel.dp, parallel.schedule, parallel.zero
    mesh = Mesh(parallel.layout)
    if cfg.batch % dp:
        raise ValueError(
            f"the global batch {cfg.batch} is not divisible by dp={dp}; "
            f"use a batch that is a multiple of {dp}"
        )
    b = cfg.batch // dp
    m = parallel.micro_batches or default_micro_batches(b, pp)
    if b % m:
        raise ValueError(
            f"the per-replica batch {b} (= batch / dp) is not divisible by "
            f"{m} micro-batches; choose a divisor of {b}"
        )
    v = parallel.chunks
    acts = pipeline_schedule(kind, m, pp, mesh.pp_rank, v)  # raises before any model exists
    forward_only = [("F", j, c) for c in range(v) for j in range(m)]
    parts = stage_layers(config, pp * v, parallel.stage_split)
    mine = [parts[c * pp + mesh.pp_rank] for c in range(v)]  # virtual stage c·pp + pp_rank
    options = parallel.model_options() | ({"cp_group": mesh.cp_group} if parallel.cp > 1 else {})
    models = build_sharded(config, mesh.tp_group, mine, cfg.seed, **options)
    chunks = [c.to(device()) for c in models]  # this rank's model chunks
    stage = torch.nn.ModuleList(chunks)  # all of this rank's parameters
    scaler = make_scaler(cfg.dtype, cfg.loss_scale, cfg.loss_scale_window)
    dpar, opt = make_data_parallel(chunks, cfg, zero, mesh)
    first = resume_from(cfg, chunks, opt, scaler)  # 0 unless cfg.resume
    pipe = Pipe.from_mesh(mesh)
    seq = config.seq_len // (tp if parallel.sequence_parallel else parallel.cp)
    shape, dtype = (b // m, seq, config.hidden), next(stage.parameters()).dtype

    def micro(ids: torch.Tensor, step: int, seed: int) -> tuple[list, list]:
        x, y = packed_batch(ids, b, config.seq_len, step, seed, mesh.dp_rank, dp)
        x, y = chunks[0].local_sequence(x), chunks[0].local_sequence(y)  # CP: this rank's part
        return list(x.to(device()).chunk(m)), list(y.to(device()).chunk(m))

    @torch.no_grad()
    def evaluate_3d() -> float:
        stage.eval()
        losses = []
        for i in range(cfg.eval_batches):
            xs, ys = micro(val_ids, i, cfg.seed + 1)
            with autocast(cfg.dtype, device()):
                res = run_schedule(chunks, forward_only, pipe, xs, ys, shape, dtype)
            losses.append(replica_mean(res.loss, mesh))
        stage.train()
        return sum(losses) / len(losses)

    def step(k: int) -> tuple[float, float]:
        for g in opt.param_groups:
            g["lr"] = lr_at(k, cfg)
        xs, ys = micro(train_ids, k, cfg.seed)
        res, norm = step_3d(
            chunks,
            opt,
            mesh,
            pipe,
            acts,
            xs,
            ys,
            shape,
            dtype,
            dpar,
            cfg.grad_clip,
            k,
            cfg.dtype,
            scaler,
        )
        return replica_mean(res.loss, mesh), norm.item()

    losses, history, seconds = run_loop(
        cfg,
        first,
        f"train tp={tp} pp={pp} dp={dp}" + (f" cp={parallel.cp}" if parallel.cp > 1 else ""),
        step,
        evaluate=evaluate_3d,
        save=lambda k: save_if_due(
            cfg, k, chunks, opt, mesh=mesh, parallel=parallel, tok=tok, scaler=scaler
        ),
    )
    stages = [[r.start, r.stop] for r in stage_layers(config, pp * v, parallel.stage_split)]
    summary = _summary(
        config,
        parallel,
        cfg,
        losses,
        history,
        seconds,
        stage,
        tp=tp,
        pp=pp,
        dp=dp,
        cp=parallel.cp,
        micro_batches=m,
        zero=zero,
        schedule=kind,
        chunks=v,
        stages=stages,
    )
    if scaler is not None:
        summary["loss_scale"] = scaler.state_dict()
    if out is not None:
        with opt.gathered() if zero else contextlib.nullcontext():
            state = gather_pipeline_state(chunks, mesh, parallel.stage_split)
        _write_dense(state, config, cfg, out, tok)
    return summary


def gather_pipeline_state(
    chunks: Sequence[TPGPT], mesh: Mesh, split: str = "even"
) -> dict[str, torch.Tensor]:
    """The whole dense state dict on global rank 0 (others: their stage's part). Collective.

    `chunks`: this rank's TPGPT chunks, cut with stage split `split`. Each stage gathers its TP
    shards; then tp_rank 0 of replica 0 of every later stage sends its tensors to rank 0
    (sorted by name, blocking send/recv: only rank 0 receives, so no cycle).
    """
    state = {k: v for chunk in chunks for k, v in chunk.gather_state_dict().items()}
    if mesh.tp_rank or mesh.dp_rank or mesh.layout.pp == 1:
        return state
    if mesh.pp_rank > 0:
        for name in sorted(state):
            collectives.send(state[name].contiguous(), 0, mesh.pp_group)
        return state
    config, pp = chunks[0].config, mesh.layout.pp
    stages = stage_layers(config, pp * len(chunks), split)
    with torch.device("meta"):
        shapes = DenseGPT(config).state_dict()
    for s in range(1, pp):
        src = mesh.members["pp"][s]
        for name in sorted(n for n in shapes if stage_of(n, stages, pp) == s):
            buf = torch.empty(
                shapes[name].shape, dtype=state["tok_emb.weight"].dtype, device=device()
            )
            state[name] = collectives.recv(buf, src, mesh.pp_group)
    return state
