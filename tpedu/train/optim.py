"""Lessons 07–12: the optimizer and the data-parallel gradient reducer of a rank's chunks.

AdamW (betas 0.9, 0.95) with weight decay on matrices only; over DP replicas either
DataParallel's bucketed all-reduce and that AdamW, or (ZeRO, lesson 12) one
ShardedDataParallel that is both the reducer and the optimizer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from tpedu.model.gpt import TPGPT, Weight
from tpedu.model.state import shard_map
from tpedu.parallel.data_parallel import DataParallel
from tpedu.parallel.mesh import TRACED_AS, Layout, Mesh, gradient_group
from tpedu.parallel.pipeline.runtime import tied_params
from tpedu.parallel.zero import ShardedDataParallel
from tpedu.train.config import TrainConfig
from tpedu.train.precision import DTYPES


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
    """ZeRO-1/2/3 over the dp·cp group for this rank's chunks (the gradients' reduction group,
    tpedu.parallel.mesh: the DP group at cp 1): AdamW as make_optimizer's; the
    gradients TP and the tied embedding fix up are reduce-scattered after the fix-ups; the
    gradient norm weighs each element by TPGPT.norm_weight, ZeRO's rule (a DP rank's shard is
    its own)."""

    def weight_of(chunk: TPGPT, name: str) -> Weight:
        return chunk.norm_weight(name, mesh.layout.copy_axes(zero=True))

    defer = [p for c in chunks for p in c.grad_sync_params()] + tied_params(chunks)
    return ShardedDataParallel(
        chunks,
        mesh.reduce_group,
        level,
        decay=decayed,
        weight_of=weight_of,
        defer=defer,
        reduce_dtype=DTYPES[cfg.dtype] if cfg.grad_reduce == "low" else None,
        gather_dtype=DTYPES[cfg.dtype] if cfg.param_gather == "low" else None,
        lr=cfg.lr,
        betas=(0.9, 0.95),
        weight_decay=cfg.weight_decay,
        group_of=gradient_groups(chunks, mesh),
        mean_over=mesh.layout.dp,
    )


def gradient_groups(
    chunks: Sequence[TPGPT], mesh: Mesh
) -> Callable[[torch.nn.Parameter], dist.ProcessGroup | None]:
    """parameter -> the group its gradient is summed over, read from its placements
    (tpedu.parallel.mesh.gradient_group): the reducers bucket by it."""
    groups = {id(e.param): mesh.groups[gradient_group(e.placements)] for e in shard_map(chunks)}
    return lambda p: groups[id(p)]


def reduction_groups(chunks: Sequence[TPGPT], layout: Layout) -> tuple[tuple[str, int, int], ...]:
    """(group as the tracer names it, its ranks, elements) of this rank's parameters by the
    group their placements reduce the gradients over: what the reducers' buckets carry, and
    what the dry run predicts DP's traffic from. No communication."""
    elements: dict[str, int] = {}
    for e in shard_map(chunks):
        kind = layout.present(gradient_group(e.placements))
        elements[kind] = elements.get(kind, 0) + e.param.numel()
    return tuple(
        (TRACED_AS.get(kind, kind), len(layout.group_of(kind, 0)), n)
        for kind, n in elements.items()
    )


def make_data_parallel(
    chunks: Sequence[TPGPT], cfg: TrainConfig, zero: int, mesh: Mesh
) -> tuple[DataParallel | ShardedDataParallel | None, torch.optim.Optimizer | ShardedDataParallel]:
    """A rank's gradient reducer over its dp·cp group and its optimizer: with ZeRO (zero ≥ 1)
    one ShardedDataParallel is both; without, DataParallel's bucketed all-reduce (None at
    dp·cp = 1) and make_optimizer's AdamW over all of this rank's chunks. Either sums each
    gradient over the group and divides by dp: CP's sum folded into DP's mean."""
    if zero:
        sharded = make_sharded(chunks, cfg, zero, mesh)
        return sharded, sharded
    stage = torch.nn.ModuleList(chunks)
    low = DTYPES[cfg.dtype] if cfg.grad_reduce == "low" else None
    dpar, lay = None, mesh.layout
    if lay.reduce_ranks > 1:  # the mean over the replicas of a sum over each one's CP ranks
        groups = gradient_groups(chunks, mesh)
        dpar = DataParallel(
            stage, mesh.reduce_group, reduce_dtype=low, group_of=groups, mean_over=lay.dp
        )
    return dpar, make_optimizer(stage, cfg)
