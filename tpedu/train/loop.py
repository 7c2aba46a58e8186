"""Lesson 07: train the tensor-parallel novel GPT, and (lesson 12) in 3D: one `train` for both.

`train(config, cfg, ..., parallel=ParallelConfig(...))` runs on every rank (launched by
`tpedu.launch`, the CLI, or torchrun). Plain tensor parallelism (`parallel.tp_only`) runs a
model of the whole depth on every rank; anything else (pipeline, DP replicas, ZeRO-1,
micro-batches) runs the 3D step, `step_3d`. Both go through the one loop, `run_loop`. Every
rank of a TP group builds the same dense model from the same seed, shards it, draws the same
batch (seeded by the step), and updates only its own shards.

Saved models are a directory: `config.json` (model + training settings), `tokenizer.json`, and
`model.safetensors` with the *dense* state dict (gathered from the shards), written atomically
(temporary directory, then rename). Sharded, reshardable checkpoints are lesson 13.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch._dynamo  # noqa: F401 - the optimizers import it (≈3-5 s): once here, not per forked rank
import torch.distributed as dist
from tqdm import tqdm

from tpedu.checkpoint.convert import write_model_dir
from tpedu.checkpoint.sharded import resume_from, save_if_due  # lesson 13
from tpedu.comm import collectives
from tpedu.launcher import device
from tpedu.model.config import GPTConfig
from tpedu.model.dense import DenseGPT
from tpedu.model.gpt import TPGPT
from tpedu.parallel.config import ParallelConfig
from tpedu.parallel.data_parallel import DataParallel, ZeRO1
from tpedu.parallel.mesh import Mesh
from tpedu.parallel.pipeline.runtime import (
    Pipe,
    StepResult,
    build_stage_chunks,
    run_schedule,
    sync_tied_grads,
)
from tpedu.parallel.pipeline.schedules import schedule as pipeline_schedule
from tpedu.parallel.pipeline.schedules import stage_layers, stage_of
from tpedu.tp.sharding import divisors
from tpedu.train.data.batches import packed_batch


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
    ckpt_dir: str | None = None  # sharded checkpoints (lesson 13) go here ...
    save_every: int = 0  # ... every this many steps (and at the end); 0: only at the end
    resume: str | None = None  # a checkpoint (step dir or its parent) to continue from


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to min_lr (the seed's 'warmup + cosine')."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(frac, 1.0)))


def build_model(
    config: GPTConfig,
    seed: int,
    group: dist.ProcessGroup | None = None,
    parallel: ParallelConfig | None = None,
) -> TPGPT:
    """The same dense initialisation on every rank (same seed), sharded over `group`, run as
    `parallel` says (sequence parallelism, recompute, overlap)."""
    torch.manual_seed(seed)
    options = parallel.model_options() if parallel else {}
    return TPGPT(DenseGPT(config), group, **options).to(device())


def count_parameters(config: GPTConfig) -> int:
    """Parameters of the dense model (built on the meta device: no memory, no RNG use)."""
    with torch.device("meta"):
        return sum(p.numel() for p in DenseGPT(config).parameters())


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not on norms, biases)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": other, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))


@torch.no_grad()
def evaluate(model: TPGPT, ids: torch.Tensor, cfg: TrainConfig, batches: int) -> float:
    """Mean loss over `batches` fixed batches (the same on every rank and every call)."""
    model.eval()
    seq = model.config.seq_len
    losses = []
    for i in range(batches):
        x, y = packed_batch(ids, cfg.batch, seq, step=i, seed=cfg.seed + 1)
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
) -> tuple[float, float]:
    """One optimizer step; returns (loss, gradient norm before clipping)."""
    for g in opt.param_groups:
        g["lr"] = lr_at(step, cfg)
    loss = model(x, y, step=step)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    model.sync_grads()
    norm = model.grad_norm()
    clip_grads(model.parameters(), norm, cfg.grad_clip)
    opt.step()
    return loss.item(), norm.item()


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
    parallel.layout.check_world(dist.get_world_size())
    parallel.check(config)
    if not parallel.tp_only:
        return _train_3d(config, parallel, cfg, train_ids, val_ids, out, tok)
    tp = parallel.tp
    model = build_model(config, cfg.seed, parallel=parallel)
    opt = make_optimizer(model, cfg)
    first = resume_from(cfg, model, opt)  # 0 unless cfg.resume

    def step(k: int) -> tuple[float, float]:
        x, y = packed_batch(train_ids, cfg.batch, config.seq_len, k, cfg.seed)
        return train_step(model, opt, x.to(device()), y.to(device()), k, cfg)

    losses, history, seconds = run_loop(
        cfg,
        first,
        f"train tp={tp}",
        step,
        evaluate=lambda: evaluate(model, val_ids, cfg, cfg.eval_batches),
        save=lambda k: save_if_due(cfg, k, model, opt, parallel=parallel, tok=tok),
    )
    summary = _summary(config, parallel, cfg, losses, history, seconds, model, tp=tp)
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
    """
    rank0 = dist.get_rank() == 0
    losses: list[float] = []
    history: list[dict] = []
    start = time.perf_counter()
    bar = tqdm(range(first, cfg.steps), disable=not (cfg.progress and rank0), desc=desc)
    for k in bar:
        loss, norm = step(k)
        losses.append(loss)
        save(k + 1)
        bar.set_postfix(loss=f"{loss:.3f}")
        if cfg.eval_every and ((k + 1) % cfg.eval_every == 0 or k + 1 == cfg.steps):
            val = evaluate()
            history.append({"step": k + 1, "train_loss": loss, "val_loss": val, "grad_norm": norm})
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


def grad_norm_3d(chunks: Sequence[TPGPT], mesh: Mesh) -> torch.Tensor:
    """L2 norm of the whole model's gradient on every rank of a 3D layout. 2 small all-reduces.

    `chunks`: this rank's TPGPT chunks (one, or several with the interleaved schedule). Within
    a stage, TP copies are counted once (as `TPGPT.grad_norm`); then the stages' sums of squares are added over the
    PP group, leaving out the last stage's copy of a tied embedding (its gradient equals the
    first stage's after `sync_tied_grads`). DP replicas hold identical gradients after the
    all-reduce: no DP reduction.
    """
    sq = torch.zeros((), dtype=torch.float64, device=next(chunks[0].parameters()).device)
    for chunk in chunks:
        tied = chunk.config.tie_embeddings and chunk.lm_head is not None
        sq += chunk.squared_grad_sum(skip=chunk.lm_head.weight if tied else None)
    collectives.all_reduce(sq, mesh.tp_group)
    return collectives.all_reduce(sq, mesh.pp_group).sqrt()


def _replica_mean(value: torch.Tensor | None, mesh: Mesh) -> float:
    """The last stage's loss, averaged over DP replicas, on every rank (1 world all-reduce)."""
    t = torch.zeros((), dtype=torch.float64, device=device())
    if value is not None and mesh.tp_rank == 0:
        t += value.double()
    return collectives.all_reduce(t).item() / mesh.layout.dp


def step_3d(
    chunks: list[TPGPT],
    opt: torch.optim.Optimizer,
    mesh: Mesh,
    pipe: Pipe,
    acts: list,
    xs: list[torch.Tensor],
    ys: list[torch.Tensor],
    shape: tuple,
    dtype: torch.dtype,
    dpar: DataParallel | None,
    max_norm: float,
    step: int = 0,
) -> tuple[StepResult, torch.Tensor]:
    """One training step of this rank's stage; returns (run_schedule's result, gradient norm).

    chunks: this rank's TPGPT chunks (one, or several with the interleaved schedule); xs, ys:
    this replica's micro-batches (the first / last stage use them); acts: the pipeline
    schedule's actions. Communication, in order: the pipeline's sends and receives, DP bucket
    all-reduces during the last micro-batch's backward (`dpar`), the tied-embedding all-reduce
    (first + last stage), the TP gradient fix-ups, 2 all-reduces for the global gradient norm.
    """
    opt.zero_grad(set_to_none=True)
    res = run_schedule(
        chunks, acts, pipe, xs, ys, shape, dtype, step=step, no_sync=dpar.no_sync if dpar else None
    )
    if dpar is not None:
        dpar.finish()
    sync_tied_grads(chunks, mesh.emb_group)
    for chunk in chunks:
        chunk.sync_grads()
    norm = grad_norm_3d(chunks, mesh)
    clip_grads((p for chunk in chunks for p in chunk.parameters()), norm, max_norm)
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
    norm, and with ZeRO-1 one broadcast per DP rank after the optimizer step.
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
    torch.manual_seed(cfg.seed)
    dense = DenseGPT(config)
    split, options = parallel.stage_split, parallel.model_options()
    models = build_stage_chunks(dense, mesh.tp_group, mesh.pp_rank, pp, v, split, **options)
    chunks = [c.to(device()) for c in models]  # this rank's model chunks
    stage = torch.nn.ModuleList(chunks)  # all of this rank's parameters
    dpar = DataParallel(stage, mesh.dp_group) if dp > 1 else None
    if zero:
        groups = make_optimizer(stage, cfg).param_groups
        opt = ZeRO1(
            [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in groups],
            mesh.dp_group,
            lr=cfg.lr,
            betas=(0.9, 0.95),
        )
    else:
        opt = make_optimizer(stage, cfg)
    first = resume_from(cfg, chunks, opt)  # 0 unless cfg.resume
    pipe = Pipe.from_mesh(mesh)
    seq = config.seq_len // (tp if parallel.sequence_parallel else 1)
    shape, dtype = (b // m, seq, config.hidden), next(stage.parameters()).dtype

    def micro(ids: torch.Tensor, step: int, seed: int) -> tuple[list, list]:
        x, y = packed_batch(ids, b, config.seq_len, step, seed, mesh.dp_rank, dp)
        return list(x.to(device()).chunk(m)), list(y.to(device()).chunk(m))

    @torch.no_grad()
    def evaluate_3d() -> float:
        stage.eval()
        losses = []
        for i in range(cfg.eval_batches):
            xs, ys = micro(val_ids, i, cfg.seed + 1)
            res = run_schedule(chunks, forward_only, pipe, xs, ys, shape, dtype)
            losses.append(_replica_mean(res.loss, mesh))
        stage.train()
        return sum(losses) / len(losses)

    def step(k: int) -> tuple[float, float]:
        for g in opt.param_groups:
            g["lr"] = lr_at(k, cfg)
        xs, ys = micro(train_ids, k, cfg.seed)
        res, norm = step_3d(
            chunks, opt, mesh, pipe, acts, xs, ys, shape, dtype, dpar, cfg.grad_clip, k
        )
        return _replica_mean(res.loss, mesh), norm.item()

    losses, history, seconds = run_loop(
        cfg,
        first,
        f"train tp={tp} pp={pp} dp={dp}",
        step,
        evaluate=evaluate_3d,
        save=lambda k: save_if_due(cfg, k, chunks, opt, mesh=mesh, parallel=parallel, tok=tok),
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
        micro_batches=m,
        zero1=bool(zero),
        schedule=kind,
        chunks=v,
        stages=stages,
    )
    if out is not None:
        state = gather_pipeline_state(chunks, mesh, parallel.stage_split)
        _write_dense(state, config, cfg, out, tok)
    return summary


def gather_pipeline_state(
    chunks: Sequence[TPGPT], mesh: Mesh, split: str = "even"
) -> dict[str, torch.Tensor]:
    """The whole dense state dict on global rank 0 (others: their stage's part). Collective.

    `chunks`: this rank's TPGPT chunks, cut with stage split `split`. Each stage gathers its TP shards; then tp_rank 0 of
    replica 0 of every later stage sends its tensors to rank 0 (sorted by name, blocking
    send/recv: only rank 0 receives, so no cycle).
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
