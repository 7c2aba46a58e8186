"""Lesson 14: the sharded checkpoint's format: its directory, its index, and reading the index.

Sharded, reshardable checkpoints: every rank saves only what it owns (tpedu.checkpoint.writer)
and loads its shards at any layout (tpedu.checkpoint.reader).

A checkpoint is a directory per step, next to a `latest` pointer:

    run/ckpt/
      latest                      "step_00000200"  (written last: the newest complete step)
      step_00000200/
        index.json                model config, parallel config, layout, step, tokens seen, data
                                  position, and for every tensor its global shape, dtype,
                                  sharding kind and its shards
        tp0-pp0-dp0.safetensors   rank (tp 0, pp 0, dp 0)'s tensors: parameters and AdamW state
        tp1-pp0-dp0.safetensors   ...
        tokenizer.json            (if the run had one)

Tensors are stored under their *dense* name (DenseGPT's state-dict key, blocks by global index)
and sharded by kind, the same rules the model uses to build its shards:

    kind        dense tensor          rank r of t keeps                     merge
    replicated  any                   all of it (stored once, by tp rank 0) take it
    column      [out, in] / [out]     rows [r·out/t, (r+1)·out/t)           cat along dim 0
    row         [out, in]             columns [r·in/t, (r+1)·in/t)          cat along dim 1
    qkv         [(nq+2·nkv)·d, ...]   its heads' q, k, v rows (split_qkv)   scatter rows back
    vocab       [V, H]                rows of the table padded to Vp        cat, drop padding

Optimizer state (AdamW's exp_avg, exp_avg_sq, step) is stored as `exp_avg/<name>` etc., sharded
exactly like its parameter. Every tensor is written once, by one of the ranks holding a copy,
read from its placements (tpedu.comm.placement): the ranks of its gradient group (the DP
replicas, or an expert's replicas over edp) share the writing, whole tensors each with their
optimizer state, about 1/n per rank (`state_writers`); CP ranks, whose copies are the same and
which files are not named by, leave it to cp rank 0. With ZeRO the whole tensors are gathered
from the shards one flat buffer at a time, and each rank loads only its shards' elements: no
rank ever holds the whole stage. Experts are named by their global index, as in the dense
model. On disk, then, a checkpoint depends only on (tp, pp): loading at any dp, ep and ZeRO
stage just reads the files, each rank the tensors it holds.

"RNG state": tpedu's dropout masks are a hash of (seed, layer, call site, step, element index)
and batches come from a generator seeded by (seed, step), so after initialisation the training
loop draws no random numbers: the step counter and the seeds (saved in the index) are the whole
RNG state, and a resumed run redraws exactly the same masks and batches.

Saves are atomic: every rank writes into `.tmp-step_N/` and fsyncs; rank 0 writes the index
(with each file's size and SHA-256), renames the directory to `step_N`, and only then replaces
`latest`. Saving a step that exists again moves the old `step_N` aside before renaming and
deletes it last (`replace_dir`). A crash at any point leaves the previous checkpoint loadable.
Loads validate before touching the model (config, files, sizes, checksums, shapes) and all ranks
agree before any rank copies a tensor: nothing is half-loaded.

Resharding = merge each tensor's shards into the dense tensor, split it for the new layout.
`reshard()` does it offline in one process; `load()` does it on the fly for a live model at
any layout, one tensor at a time. At the tp it was saved at, `load()` reads each rank's own
shards straight from its own file (and the replicated tensors from tp rank 0's).
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import torch
import torch.distributed as dist

import tpedu
from tpedu.checkpoint.files import (
    CheckpointError,
    file_sha256,
)
from tpedu.comm import collectives
from tpedu.model.config import LEGACY, GPTConfig
from tpedu.parallel.config import ParallelConfig
from tpedu.parallel.mesh import CHECKPOINT_AXES
from tpedu.parallel.pipeline.schedules import stage_layers

# 2: the index keeps "model" (GPTConfig) and "parallel" (ParallelConfig) apart. tpedu 0.1 wrote
# 1, with the run-time fields inside "model": still read, by read_config and read_parallel.
FORMAT = "tpedu-sharded-2"

READABLE = ("tpedu-sharded-1", FORMAT)

INDEX = "index.json"

LATEST = "latest"


def optimizer_view(opt: object | None) -> tuple[torch.optim.Optimizer | None, set[int]]:
    """(the torch optimizer holding state, ids of the parameters it updates): `opt` itself, or
    the `.inner` optimizer of a wrapper that has one."""
    inner = getattr(opt, "inner", opt) if opt is not None else None
    if inner is None:
        return None, set()
    return inner, {id(p) for g in inner.param_groups for p in g["params"]}


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def shard_file(coords: dict[str, int]) -> str:
    """The file of the rank at `coords` ({axis: index}): "tp0-pp1-dp0.safetensors", named by
    the axes whose ranks hold different tensors (`CHECKPOINT_AXES`; the dp index is the ZeRO
    writer's)."""
    return "-".join(f"{a}{coords[a]}" for a in CHECKPOINT_AXES) + ".safetensors"


def agree(error: BaseException | None, what: str) -> None:
    """Every rank learns whether every rank succeeded (1 tiny all-reduce, also a barrier).

    A rank that failed raises its own error; the others raise a CheckpointError saying so.
    """
    failed = 1.0 if error is not None else 0.0
    if dist.is_available() and dist.is_initialized():
        flag = torch.tensor([failed], device=tpedu.device())
        collectives.all_reduce(flag)
        failed = flag.item()
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(
            f"{what}: a remote worker failed ({int(failed)} rank(s)); see its error"
        )


def layout_entry(parallel: ParallelConfig, config: GPTConfig) -> dict:
    """The index's "layout", what the files hold: sizes, ZeRO stage, and the layers of each
    (virtual) stage; virtual stage c·pp + s is on pp rank s ("chunks" > 1 only with the
    interleaved schedule)."""
    stages = stage_layers(config, parallel.pp * parallel.chunks, parallel.stage_split)
    return {
        **{a: getattr(parallel, a) for a in CHECKPOINT_AXES},
        "zero": parallel.zero,
        **({"chunks": parallel.chunks} if parallel.chunks > 1 else {}),  # absent: 1
        "stages": [[r.start, r.stop] for r in stages],
    }


def resolve(path: str | Path) -> Path:
    """A step directory, given it or its parent (then `latest` names the step)."""
    path = Path(path)
    if (path / INDEX).exists():
        return path
    if (path / LATEST).exists():
        name = (path / LATEST).read_text().strip()
        if not (path / name / INDEX).exists():
            # killed inside replace_dir while re-saving this step: the old one is complete aside
            aside = [p.parent for p in path.glob(f".old-{name}-*/{INDEX}")]
            if aside:
                return max(aside, key=lambda p: (p / INDEX).stat().st_mtime)
            raise CheckpointError(f"{path / LATEST} names {name!r}, which has no {INDEX}")
        return path / name
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    raise CheckpointError(
        f"{path} is not a tpedu checkpoint: no {INDEX} and no {LATEST} in it "
        "(an interrupted save leaves only a .tmp-step_N directory)"
    )


def read_index(path: str | Path) -> tuple[Path, dict]:
    """(the step directory, its parsed index), checking the format field."""
    step_dir = resolve(path)
    text = (step_dir / INDEX).read_text()
    try:
        index = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(
            f"{step_dir / INDEX} is not valid JSON ({e}); the file is corrupted"
        ) from None
    if index.get("format") not in READABLE:
        raise CheckpointError(
            f"{step_dir / INDEX}: field 'format' is {index.get('format')!r}, expected one of "
            f"{READABLE}"
        )
    for key in ("model", "layout", "tensors", "files", "step"):
        if key not in index:
            raise CheckpointError(f"{step_dir / INDEX} has no field {key!r}; the file is damaged")
    return step_dir, index


def read_config(path: str | Path) -> GPTConfig:
    """The model config a checkpoint was saved with."""
    step_dir, index = read_index(path)
    try:
        return GPTConfig.from_dict(index["model"])
    except TypeError as e:
        raise CheckpointError(
            f"{step_dir / INDEX}: field 'model' is not a GPTConfig ({e})"
        ) from None


def read_parallel(path: str | Path) -> ParallelConfig:
    """The ParallelConfig a checkpoint was saved with (tpedu 0.1's: from its layout and the
    run-time fields it kept in "model")."""
    step_dir, index = read_index(path)
    if "parallel" in index:
        try:
            return ParallelConfig.from_dict(index["parallel"])
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{step_dir / INDEX}: field 'parallel': {e}") from None
    lay, model = index["layout"], index["model"]
    legacy = {k: model[k] for k in LEGACY if k in model and k not in ("extra", "fused_attention")}
    return ParallelConfig(
        lay["tp"],
        lay["pp"],
        lay["dp"],
        chunks=lay.get("chunks", 1),
        schedule="interleaved" if lay.get("chunks", 1) > 1 else "1f1b",
        zero=lay.get("zero", int(bool(lay.get("zero1")))),  # tpedu 0.1 wrote "zero1"
        **legacy,
    )


def check_config(index: dict, config: GPTConfig, where: Path) -> None:
    """Raise naming the first model config field that differs from the checkpoint's (a field
    an older checkpoint lacks counts as its default, as `GPTConfig.from_dict` reads it)."""
    saved = GPTConfig.from_dict(index["model"])
    for f in fields(GPTConfig):
        mine, theirs = getattr(config, f.name), getattr(saved, f.name)
        if theirs != mine:
            raise CheckpointError(
                f"{where / INDEX}: field 'model.{f.name}' is {theirs!r} but the model "
                f"being loaded has {f.name}={mine!r}; build the model with the checkpoint's "
                "config (checkpoint.read_config)"
            )


def check_file(step_dir: Path, index: dict, file: str, verify: bool = True) -> None:
    """Raise a CheckpointError unless shard `file` is listed in the index, present, of the
    listed size and (with `verify`) of the listed SHA-256."""
    path = step_dir / file
    info = index["files"].get(file)
    if info is None:
        raise CheckpointError(f"{step_dir / INDEX}: field 'files' does not list {file}")
    if not path.exists():
        raise CheckpointError(f"{path} is missing (listed in {INDEX} 'files')")
    size = path.stat().st_size
    if size != info["bytes"]:
        raise CheckpointError(
            f"{path} is truncated or overwritten: {size} bytes, "
            f"{INDEX} field 'files.{file}.bytes' says {info['bytes']}"
        )
    if verify and file_sha256(path) != info["sha256"]:
        raise CheckpointError(
            f"{path} is corrupted: its SHA-256 differs from {INDEX} field 'files.{file}.sha256'"
        )


def check_files(path: str | Path, verify: bool = False) -> tuple[Path, dict]:
    """(step dir, index) of checkpoint `path` after checking every shard file it lists (one
    process, before any rank starts; `verify` also checks the SHA-256s)."""
    step_dir, index = read_index(path)
    for file in index["files"]:
        check_file(step_dir, index, file, verify)
    return step_dir, index


def summary(path: str | Path) -> str:
    """A short human-readable description of a checkpoint: layout, step, files, tensors."""
    step_dir, index = read_index(path)
    lay = index["layout"]
    zero = lay.get("zero", int(bool(lay.get("zero1"))))  # tpedu 0.1 wrote "zero1"
    lines = [
        f"{step_dir}: step {index['step']}, tp={lay['tp']} pp={lay['pp']} dp={lay['dp']}"
        f"{f' zero={zero}' if zero else ''}, {len(index['files'])} shard files, "
        f"{len(index['tensors'])} tensors"
    ]
    for f, info in index["files"].items():
        lines.append(f"  {f:<28} {info['bytes']:>10,} bytes")
    return "\n".join(lines)
