"""Lesson 14: saving a sharded checkpoint: every rank writes what it owns, atomically (the format:
tpedu.checkpoint.index)."""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Sequence
from dataclasses import asdict, is_dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes
from torch import nn

import tpedu
from tpedu.checkpoint.files import (
    CheckpointError,
    file_sha256,
    fsync_dir,
    replace_dir,
    write_synced,
)
from tpedu.checkpoint.index import (
    FORMAT,
    INDEX,
    LATEST,
    agree,
    layout_entry,
    optimizer_view,
    shard_file,
    step_name,
)
from tpedu.model.config import GPTConfig
from tpedu.model.gpt import TPGPT
from tpedu.model.state import (
    dense_shapes,
    shard_map,
)
from tpedu.parallel.config import ParallelConfig
from tpedu.parallel.mesh import AXIS_NAMES, CHECKPOINT_AXES, Layout, gradient_group


def prepare_step(root: Path, step: int) -> Path:
    """A fresh temporary directory for this step (a stale one from a crashed save is removed)."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{step_name(step)}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def write_shard(
    tmp: Path, coords: dict[str, int], tensors: dict[str, torch.Tensor], kinds: dict[str, str]
) -> None:
    """Write this rank's file (`shard_file(coords)`), its coordinates and kinds as metadata."""
    meta = {f"{a}_rank": str(coords[a]) for a in CHECKPOINT_AXES} | {"kinds": json.dumps(kinds)}
    data = safetensors_bytes({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, meta)
    write_synced(tmp / shard_file(coords), data)


def finalize_step(root: Path, tmp: Path, step: int, header: dict, tok: object | None) -> Path:
    """Index the shard files in `tmp`, write index.json, rename to step_N, then move `latest`."""
    config = GPTConfig.from_dict(header["model"])
    shapes = dense_shapes(config)
    tensors: dict[str, dict] = {}
    files: dict[str, dict] = {}
    for path in sorted(tmp.glob("*.safetensors")):
        files[path.name] = {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
        with safe_open(path, framework="pt") as f:
            meta = f.metadata()
            kinds = json.loads(meta["kinds"])
            for key in f.keys():
                shape = list(f.get_slice(key).get_shape())
                name = key.split("/", 1)[-1]
                entry = tensors.setdefault(
                    key,
                    {
                        "shape": list(shapes[name]) if shape else [],
                        "dtype": "",
                        "kind": kinds[key],
                        "stage": int(meta["pp_rank"]),  # the rank that wrote it
                        "shards": [],
                    },
                )
                entry["dtype"] = str(f.get_slice(key).get_dtype())
                entry["shards"].append(
                    {"file": path.name, "tp_rank": int(meta["tp_rank"]), "shape": shape}
                )
    tp = header["layout"]["tp"]
    for key, entry in tensors.items():
        entry["shards"].sort(key=lambda s: s["tp_rank"])
        want = 1 if entry["kind"] == "replicated" else tp
        if len(entry["shards"]) != want:  # a bug in the writer, caught before `latest` moves
            raise CheckpointError(f"{key}: {len(entry['shards'])} shards written, expected {want}")
    index = {**header, "step": step, "files": files, "tensors": dict(sorted(tensors.items()))}
    if tok is not None:
        tok.save(tmp / "tokenizer.json")
    write_synced(tmp / INDEX, json.dumps(index, indent=1).encode())
    fsync_dir(tmp)
    final = root / step_name(step)
    replace_dir(tmp, final)  # renames, atomic on one file system: never a half-written step_N
    write_synced(root / ".latest.tmp", f"{final.name}\n".encode())
    os.replace(root / ".latest.tmp", root / LATEST)  # atomic too: latest moves last
    fsync_dir(root)
    return final


def _header(
    config: GPTConfig,
    parallel: ParallelConfig,
    step: int,
    train_cfg: object | None,
    opt: object | None,
) -> dict:
    batch = getattr(train_cfg, "batch", None)
    seed = getattr(train_cfg, "seed", None)
    inner, _ = optimizer_view(opt)
    optim = None
    if inner is not None:
        g = inner.param_groups[0] if inner.param_groups else {}
        optim = {
            "type": type(inner).__name__,
            "betas": list(g.get("betas", ())),
            "eps": g.get("eps"),
            "weight_decay": [x.get("weight_decay") for x in inner.param_groups],
        }
    return {
        "format": FORMAT,
        "tpedu_version": tpedu.__version__,
        "model": config.to_dict(),
        "parallel": parallel.to_dict(),
        "layout": layout_entry(parallel, config),
        "tokens_seen": step * batch * config.seq_len if batch else None,
        "data": {
            "sampler": "tpedu.data.batches.packed_batch",
            "seed": seed,
            "next_step": step,
            "note": "batch k is drawn from a generator seeded by (seed, k): resuming at "
            "next_step redraws exactly the batches an uninterrupted run sees",
        },
        "rng": {
            "dropout_seed": config.seed,
            "init_seed": seed,
            "note": "dropout masks hash (seed, layer, site, step, index); the loop draws no "
            "other random numbers after initialisation, so step + seeds are the "
            "whole RNG state",
        },
        "optimizer": optim,
        "train": asdict(train_cfg) if is_dataclass(train_cfg) else None,
    }


def save(
    root: str | Path,
    model: TPGPT | Sequence[TPGPT],
    opt: object | None,
    step: int,
    *,
    parallel: ParallelConfig | None = None,
    train_cfg: object | None = None,
    tok: object | None = None,
    scaler: object | None = None,
) -> Path:
    """Save this step's checkpoint under `root` from every rank of the world. Collective.

    model: this rank's TPGPT (or its pipeline chunks); opt: its AdamW, its ShardedDataParallel
    (ZeRO) or None; parallel: the run's ParallelConfig, stored in the index, whose layout
    places this rank (its Mesh's coordinates); None: one TP group, a model saved outside
    train, plain TP over the model's group with its sequence parallelism as built; train_cfg
    and tok: the run's TrainConfig and tokenizer; scaler: the fp16 LossScaler, whose state the
    index keeps ("loss_scaler"). Returns root/step_N.
    3 tiny all-reduces (barriers that also carry failures: one rank's error makes every rank
    raise, and `latest` does not move).
    """
    root = Path(root)
    chunks = [model] if isinstance(model, nn.Module) else list(model)
    first, config = chunks[0], chunks[0].config
    axes = first.axes()  # the model's own groups: {axis: (size, this rank's index)}
    sizes = {a: n for a, (n, _) in axes.items()}
    if parallel is None:  # one model alone: a layout of its own groups
        layout = Layout(**sizes)
        coords = layout.coords(layout.rank(**{a: i for a, (_, i) in axes.items()}))
        sp = first.sequence_parallel
        parallel = ParallelConfig(**layout.sizes, chunks=len(chunks), sequence_parallel=sp)
    else:  # the ranks of parallel's layout, as a Mesh of it places them
        layout, world = parallel.layout, dist.get_world_size()
        ours = {a: layout.sizes[a] for a in sizes}
        if (ours, layout.world, parallel.chunks) != (sizes, world, len(chunks)):
            raise ValueError(
                f"parallel says {layout} with chunks={parallel.chunks}, the ranks run "
                f"{_ranks_layout(sizes, parallel.pp)} with {len(chunks)} chunks; pass the "
                "ParallelConfig the model was built with"
            )
        coords = layout.coords(dist.get_rank())
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    tmp = Path(root) / f".tmp-{step_name(step)}"
    error: BaseException | None = None
    try:
        if rank0:
            prepare_step(root, step)
    except Exception as e:  # reported to every rank by agree
        error = e
    agree(error, f"preparing {tmp}")
    try:
        tensors, kinds = _rank_tensors(chunks, opt, coords, layout)
        if tensors:
            write_shard(tmp, coords, tensors, kinds)
    except Exception as e:  # reported to every rank by agree
        error = e
    agree(error, f"writing {tmp}")
    final = root / step_name(step)
    try:
        if rank0:
            header = _header(config, parallel, step, train_cfg, opt)
            if scaler is not None:
                header["loss_scaler"] = scaler.state_dict()
            finalize_step(root, tmp, step, header, tok)
    except Exception as e:
        error = e
    agree(error, f"finalizing {final}")
    return final


def _ranks_layout(sizes: dict[str, int], pp: int) -> Layout:
    """The layout the world's ranks run as far as this rank sees it (for an error message): its
    model's own group sizes, `pp` stages, and as many replicas as the world holds."""
    dp = max(1, dist.get_world_size() // (math.prod(sizes.values()) * pp))
    return Layout(**sizes, pp=pp, dp=dp)


def writers(layout: Layout, kind: str, rank: int) -> list[int]:
    """The ranks that share the writing of the tensors whose copies are `rank`'s group of
    `kind` (a gradient group: the ranks holding the same elements): those of it a file is
    named for, whose coordinate on every axis outside the file names (cp) is 0."""
    unnamed = [a for a in AXIS_NAMES if a not in CHECKPOINT_AXES]
    group = layout.group_of(kind, rank)
    return [r for r in group if not any(layout.coords(r)[a] for a in unnamed)]


def _rank_tensors(
    chunks: list[TPGPT], opt: object | None, coords: dict[str, int], layout: Layout
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """What this rank writes, each tensor with the optimizer state it holds. One rule, read
    from the placements: a tensor is written once, by one of the ranks holding a copy of it.
    Over TP a replicated tensor's copies are the TP ranks', and tp rank 0 writes it. Over the
    rest, its copies are its gradient group's ranks (tpedu.parallel.mesh.gradient_group: the
    DP replicas and CP ranks, or an expert's replicas), and `state_writers` balances the
    tensors of each group over its `writers`, about 1/n each, largest first.
    ZeRO (an `opt` with `whole_tensors`) hands them over whole from its shards, one buffer at a
    time: collective over its groups."""
    rank, tp_rank = layout.rank(**coords), coords["tp"]
    entries = [
        e
        for e in shard_map(chunks)
        if not (e.tied_copy or (e.stored_kind == "replicated" and tp_rank))
    ]
    by_group: dict[str, list] = {}
    for e in entries:
        by_group.setdefault(layout.present(gradient_group(e.placements)), []).append(e)
    mine = []
    for kind, group in by_group.items():
        ranks = writers(layout, kind, rank)
        who = state_writers([e.param.numel() for e in group], len(ranks))
        mine += [e for e, w in zip(group, who, strict=True) if ranks[w] == rank]
    if hasattr(opt, "whole_tensors"):
        got = opt.whole_tensors({id(e.param) for e in mine})
    else:
        inner, managed = optimizer_view(opt)
        got = {
            id(e.param): (
                e.param.detach(),
                inner.state.get(e.param, {})
                if inner is not None and id(e.param) in managed
                else {},
            )
            for e in mine
        }
    tensors: dict[str, torch.Tensor] = {}
    kinds: dict[str, str] = {}
    for e in mine:
        value, state = got[id(e.param)]
        tensors[e.name], kinds[e.name] = value, e.stored_kind
        for key, v in state.items():
            if torch.is_tensor(v) and (v.dim() or not tp_rank):  # scalars once
                k = f"{key}/{e.name}"
                tensors[k], kinds[k] = v.detach(), e.stored_kind if v.dim() else "replicated"
    return tensors, kinds


def state_writers(numels: Sequence[int], n: int) -> list[int]:
    """Which of n dp ranks writes each tensor and its optimizer state: largest first, each to the
    rank with the fewest elements so far (ties keep the order), so every rank writes about 1/n.
    numels [5, 3, 3, 1], n 2 -> [0, 1, 1, 0]."""
    load = [0] * n
    writer = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: -numels[i]):  # stable: ties keep order
        writer[i] = min(range(n), key=lambda r: load[r])
        load[writer[i]] += numels[i]
    return writer
