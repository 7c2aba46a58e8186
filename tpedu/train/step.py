"""Lessons 07–13: one rank's training step, for every layout: TP alone, 3D and 4D.

Every run has a Mesh. Plain TP is a pipeline of one stage, one micro-batch and one DP replica,
so `TrainStep` runs it with the same code as tp·cp·pp·dp; `tpedu.analysis.dryrun` drives the
same `TrainStep` on meta tensors. Per step, in order:

1. the pipeline schedule: forward and backward of every micro-batch (point-to-point sends
   between stages; none with one stage);
2. DP: bucketed all-reduces during the last micro-batch's backward (with ZeRO: reduce-scatters,
   after the fix-ups of 3-4, since those must be summed first);
3. the tied embedding's all-reduce (first + last stage, when they are different ranks);
4. the TP fix-ups (`TPGPT.sync_grads`: replicated KV heads, sequence parallelism, CP);
5. the global gradient norm (1 float64 all-reduce over the world), clipping, AdamW.

`train_step` is lesson 07's step of one model: this `TrainStep` at one stage, one micro-batch
and one replica (steps 1, 4 and 5).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from tpedu.comm import collectives
from tpedu.comm.device import device
from tpedu.data.batches import packed_batch
from tpedu.model.config import GPTConfig
from tpedu.model.gpt import TPGPT, grad_norm, weighted_grads
from tpedu.model.sharded_init import build_sharded
from tpedu.moe.aux_loss import aux_loss_scale
from tpedu.parallel.config import ParallelConfig
from tpedu.parallel.data_parallel import DataParallel
from tpedu.parallel.mesh import Mesh
from tpedu.parallel.pipeline.runtime import (
    Pipe,
    StepOptions,
    StepResult,
    run_schedule,
    sync_tied_grads,
)
from tpedu.parallel.pipeline.schedules import schedule as pipeline_schedule
from tpedu.parallel.pipeline.schedules import stage_layers
from tpedu.parallel.zero import ShardedDataParallel
from tpedu.tp.sharding import divisors
from tpedu.train.config import TrainConfig, lr_at
from tpedu.train.optim import make_data_parallel
from tpedu.train.precision import LossScaler, autocast, make_scaler


def default_micro_batches(per_rank_batch: int, pp: int) -> int:
    """The largest m ≤ 2·pp dividing the per-DP-rank batch (1 without pipelining)."""
    if pp == 1:
        return 1
    return max(m for m in divisors(per_rank_batch) if m <= 2 * pp)


def split_batch(batch: int, parallel: ParallelConfig) -> tuple[int, int]:
    """(sequences per DP replica, micro-batches per step) of a global batch; a ValueError
    naming the fix if the batch does not split so."""
    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch}")
    dp = parallel.dp
    if batch % dp:
        raise ValueError(
            f"the global batch {batch} is not divisible by dp={dp}; "
            f"use a batch that is a multiple of {dp}"
        )
    b = batch // dp
    m = parallel.micro_batches or default_micro_batches(b, parallel.pp)
    if b % m:
        raise ValueError(
            f"the per-replica batch {b} (= batch / dp) is not divisible by "
            f"{m} micro-batches; choose a divisor of {b}"
        )
    if parallel.tp_overlap == "chunks" and (b // m) % parallel.tp_chunks:
        raise ValueError(
            f"tp_chunks {parallel.tp_chunks} does not divide the micro-batch of {b // m} "
            f"sequences (batch / dp / micro-batches); choose a divisor of {b // m}"
        )
    return b, m


def check_setup(config: GPTConfig, parallel: ParallelConfig, batch: int) -> int:
    """Raise a ValueError naming the problem if one training step of `batch` sequences cannot
    run so (as train would, before anything is built); returns the micro-batches per step."""
    parallel.check(config)
    _, m = split_batch(batch, parallel)
    pipeline_schedule(parallel.schedule, m, parallel.pp, 0, parallel.chunks)
    return m


def stage_chunks(config: GPTConfig, parallel: ParallelConfig, mesh: Mesh, seed: int) -> list[TPGPT]:
    """This rank's model chunks on the device: its shards of the dense model that `seed`
    initialises, built without materialising it (tpedu.model.sharded_init). Chunk c holds the
    layers of virtual stage c·pp + pp_rank; one chunk of every layer at pp 1."""
    pp, v = parallel.pp, parallel.chunks
    parts = stage_layers(config, pp * v, parallel.stage_split)
    mine = [parts[c * pp + mesh.pp_rank] for c in range(v)]
    options = parallel.model_options(mesh)
    return [
        c.to(device()) for c in build_sharded(config, mesh.tp_group, mine, seed, options=options)
    ]


def clip_grads(params: Iterable[torch.nn.Parameter], norm: torch.Tensor, max_norm: float) -> None:
    """Scale gradients so their global norm (computed across ranks by the caller) is <= max_norm."""
    if max_norm <= 0:
        return
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(scale.to(p.grad.dtype))


def finish_scaled(scaler: LossScaler | None, params: Iterable[torch.nn.Parameter]) -> bool:
    """Unscale the gradients and update the scale; True if this step must be skipped."""
    if scaler is None:
        return False
    overflow = scaler.unscale_and_check(params)
    scaler.update(overflow)
    return overflow


def replica_mean(value: torch.Tensor | None, mesh: Mesh) -> float:
    """The last stage's loss, averaged over DP replicas, on every rank (1 world all-reduce).
    The ranks that run one stage of one replica together (TP, CP) hold the same loss (CP's is
    already the whole sequence's mean): only the first of them adds it."""
    t = torch.zeros((), dtype=torch.float64, device=device())
    if value is not None and mesh.first_of_stage:
        t += value.double()
    return collectives.all_reduce(t).item() / mesh.layout.dp


@dataclass
class TrainStep:
    """One rank's training step, built once by `build_step`; `step(xs, ys, k)` runs step k."""

    chunks: list[TPGPT]  # this rank's model chunks (several with the interleaved schedule)
    opt: torch.optim.Optimizer | ShardedDataParallel
    dpar: DataParallel | ShardedDataParallel | None  # the DP reducer (None at dp 1)
    mesh: Mesh | None  # None: one model alone, its TP group the job (lesson 07's train_step)
    pipe: Pipe
    actions: list  # this stage's pipeline schedule
    per_replica: int  # sequences per DP replica per step
    micro_batches: int
    shape: tuple[int, int, int]  # one micro-batch's activations between stages [b/m, s, H]
    dtype: torch.dtype  # ... and their dtype
    cfg: TrainConfig
    scaler: LossScaler | None = None  # fp16's loss scaler

    def batch(
        self, ids: torch.Tensor, k: int, seed: int
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """This replica's micro-batches of step k's batch: ids and targets, each
        micro_batches × [b/m, s/cp] on the device (CP: this rank's positions)."""
        dp, first = self.mesh.layout.dp, self.chunks[0]
        seq = first.config.seq_len
        x, y = packed_batch(ids, self.per_replica, seq, k, seed, self.mesh.dp_rank, dp)
        x, y = first.local_sequence(x), first.local_sequence(y)
        m = self.micro_batches
        return list(x.to(device()).chunk(m)), list(y.to(device()).chunk(m))

    def __call__(
        self, xs: list[torch.Tensor], ys: list[torch.Tensor], k: int
    ) -> tuple[StepResult, torch.Tensor]:
        """Step k on micro-batches xs, ys (the first / last stage use them); returns
        (run_schedule's result, the gradient norm before clipping; inf for a skipped fp16
        step). Its communication, in order, is the module docstring's."""
        chunks, dpar, mesh, scaler = self.chunks, self.dpar, self.mesh, self.scaler
        for g in self.opt.param_groups:
            g["lr"] = lr_at(k, self.cfg)
        self.opt.zero_grad(set_to_none=True)
        no_sync = dpar.no_sync if dpar else None
        scale = scaler.scale if scaler else 1.0
        # each micro-batch's MoE auxiliary losses weigh as its loss: (1/m) · fp16's scale
        with (
            autocast(self.cfg.dtype, next(chunks[0].parameters()).device),
            aux_loss_scale(scale / len(xs)),
        ):
            res = run_schedule(
                chunks, self.actions, self.pipe, xs, ys, self.shape, self.dtype,
                StepOptions(step=k, no_sync=no_sync, loss_scale=scale),
            )  # fmt: skip
        sharded = isinstance(dpar, ShardedDataParallel)
        if dpar is not None and not sharded:
            dpar.finish()
        sync_tied_grads(chunks, mesh.emb_group if mesh else None)
        for chunk in chunks:
            chunk.sync_grads()
        if sharded:  # ZeRO reduce-scatters what the fix-ups have summed: they come first
            dpar.finish()
            grads = dpar.shards()
        else:
            grads = [p for chunk in chunks for p in chunk.parameters()]
        if finish_scaled(scaler, grads):
            return res, torch.tensor(math.inf)
        norm = self.grad_norm()
        clip_grads(grads, norm, self.cfg.grad_clip)
        self.opt.step()
        return res, norm

    def grad_norm(self) -> torch.Tensor:
        """The whole model's gradient norm on every rank (`tpedu.model.gpt.grad_norm`): ZeRO's
        gradient shards or this rank's gradients, each element weighted by 1 / its copies in
        the job; 1 all-reduce over the world (one model alone: over its TP group)."""
        if isinstance(self.dpar, ShardedDataParallel):
            return grad_norm(self.dpar.weighted_grads())
        if self.mesh is None:
            return self.chunks[0].grad_norm()
        return grad_norm(weighted_grads(self.chunks, self.mesh.layout.copy_axes()))


def build_step(
    chunks: list[TPGPT], mesh: Mesh, parallel: ParallelConfig, cfg: TrainConfig
) -> TrainStep:
    """The TrainStep of this rank's `chunks` (from `stage_chunks`, or the dry run's meta
    ones): its optimizer and DP reducer, pipeline schedule and micro-batch shape. Raises a
    ValueError naming the fix before anything runs if the batch does not split."""
    b, m = split_batch(cfg.batch, parallel)
    actions = pipeline_schedule(parallel.schedule, m, parallel.pp, mesh.pp_rank, parallel.chunks)
    dpar, opt = make_data_parallel(chunks, cfg, parallel.zero, mesh)
    config = chunks[0].config
    return TrainStep(
        chunks=chunks,
        opt=opt,
        dpar=dpar,
        mesh=mesh,
        pipe=Pipe.from_mesh(mesh),
        actions=actions,
        per_replica=b,
        micro_batches=m,
        shape=(b // m, chunks[0].stage_positions(), config.hidden),
        dtype=next(chunks[0].parameters()).dtype,
        cfg=cfg,
        scaler=make_scaler(cfg.dtype, cfg.loss_scale, cfg.loss_scale_window),
    )


def build_model(
    config: GPTConfig,
    seed: int,
    group: torch.distributed.ProcessGroup | None = None,
    parallel: ParallelConfig | None = None,
) -> TPGPT:
    """One model of every layer (lesson 07): this rank's shards of the dense model that `seed`
    initialises, over `group` (None: the world), run as `parallel` says (sequence parallelism,
    recompute, overlap), built without materialising the dense model."""
    options = parallel.model_options() if parallel else None
    return build_sharded(config, group, seed=seed, options=options)[0].to(device())


def train_step(
    model: TPGPT,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    step: int,
    cfg: TrainConfig,
    scaler: LossScaler | None = None,
) -> tuple[float, float]:
    """One optimizer step of one model (lesson 07): `TrainStep` at one stage, one micro-batch,
    one replica, with `opt` and `scaler` as given; x, y: ids and targets [b, s] on the device.
    Returns (loss, gradient norm before clipping). With a LossScaler (fp16) the backward runs on
    the scaled loss; a step whose gradients overflow on any rank is skipped (weights and AdamW
    states untouched) and its norm reported as inf. Communication: the model's TP collectives,
    its `sync_grads`, the gradient norm's all-reduce over its TP group."""
    one = TrainStep(
        chunks=[model],
        opt=opt,
        dpar=None,
        mesh=None,
        pipe=Pipe(0, [0], None, None),
        actions=pipeline_schedule("1f1b", 1, 1, 0),
        per_replica=len(x),
        micro_batches=1,
        shape=(*x.shape, model.config.hidden),
        dtype=next(model.parameters()).dtype,
        cfg=cfg,
        scaler=scaler,
    )
    res, norm = one([x], [y], step)
    return res.loss.item(), norm.item()
