"""Lesson 14: between formats: model directories, sharded checkpoints, layouts, Hugging Face.

    write_model_dir / load_model_files   the dense model directory of `train --out` (lesson 07)
    reshard                              a checkpoint rewritten for another (tp, pp, dp) layout
    export_dense / import_dense          checkpoint -> dense model directory, and back
    export_hf                            a GPT-2-shaped checkpoint -> a Hugging Face directory

Resharding merges every tensor to dense and splits it again with the model's own rules
(tpedu.model.state), one process, the whole model in memory.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

import tpedu
from tpedu.checkpoint.files import CheckpointError, export_tmp, replace_dir
from tpedu.checkpoint.index import (
    FORMAT,
    layout_entry,
    read_config,
    read_index,
    read_parallel,
    resolve,
)
from tpedu.checkpoint.reader import ShardReader
from tpedu.checkpoint.writer import finalize_step, prepare_step, write_shard
from tpedu.data import tokenizer
from tpedu.model.config import GPTConfig
from tpedu.model.dense import DenseGPT
from tpedu.model.gpt import TPGPT
from tpedu.model.options import RunOptions
from tpedu.model.plan import param_kind
from tpedu.model.sharded_init import materialize
from tpedu.model.state import (
    dense_shapes,
    shard_map,
    split_tensor,
)
from tpedu.parallel.config import ParallelConfig
from tpedu.parallel.pipeline.schedules import stage_of


def write_model_dir(
    out: str | Path,
    config: GPTConfig,
    state: dict[str, torch.Tensor],
    train: dict | None = None,
    tok: object | None = None,
) -> Path:
    """Write a dense model directory (config.json, model.safetensors, tokenizer.json) from one
    process, atomically: into a temporary sibling, then `replace_dir`. `out` must be absent or
    a model directory (`check_replaceable`): whatever else is there is never replaced."""
    out = Path(out)
    tmp = export_tmp(out)
    save_file({k: v.contiguous().cpu() for k, v in state.items()}, tmp / "model.safetensors")
    meta = {"model": config.to_dict(), "train": train, "format": DENSE_FORMAT}
    (tmp / "config.json").write_text(json.dumps(meta, indent=2))
    if tok is not None:
        tok.save(tmp / "tokenizer.json")
    replace_dir(tmp, out)  # the previous model stays complete until the new one is in place
    return out


def load_model_files(path: str | Path) -> tuple[GPTConfig, dict[str, torch.Tensor], object]:
    """(config, dense state dict, tokenizer) from a directory written by `write_model_dir`, checked
    (format, config, tensor names and shapes) by `checkpoint.read_model_dir`."""
    _, tok = load_model_info(path)
    config, state = read_model_dir(path)
    return config, state, tok


def load_model_info(path: str | Path) -> tuple[GPTConfig, object]:
    """(config, tokenizer) of a model directory, every file checked, no tensor read."""
    path = Path(path)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        if not (path / name).exists():
            raise FileNotFoundError(
                f"{path / name} is missing: is {path} a model saved by `tpedu train --out`?"
            )
    return check_model_dir(path), tokenizer.load(path / "tokenizer.json")


DENSE_FORMAT = "tpedu-dense-1"  # a dense model directory: `train --out`, export_dense


def read_dense(
    path: str | Path, verify: bool = True
) -> tuple[GPTConfig, dict[str, torch.Tensor], dict]:
    """(config, {key: dense tensor}, index) for every stored tensor: the parameters under their
    DenseGPT names and the optimizer state as `exp_avg/<name>`, `exp_avg_sq/<name>`,
    `step/<name>`. One process; memory: the whole model (and its optimizer state) once."""
    step_dir, index = read_index(path)
    config = read_config(step_dir)
    reader = ShardReader(step_dir, index, verify)
    return config, {k: reader.dense(k, config) for k in index["tensors"]}, index


def write_sharded(
    root: str | Path,
    config: GPTConfig,
    tensors: dict[str, torch.Tensor],
    step: int,
    parallel: ParallelConfig | None = None,
    header: dict | None = None,
    tok: object | None = None,
) -> Path:
    """Write dense `tensors` (parameters and `exp_avg/<name>`-style optimizer entries, as
    read_dense returns them) as a checkpoint for `parallel` (default: one rank) under `root`,
    atomically, from this one process. Each (tp rank, pp stage) gets one file, written as dp
    rank 0."""
    parallel = parallel or ParallelConfig()
    parallel.check(config)  # raises if tp does not divide the heads, pp does not fit, ...
    tp, pp = parallel.tp, parallel.pp
    layout = layout_entry(parallel, config)
    stages = [range(a, b) for a, b in layout["stages"]]
    tmp = prepare_step(Path(root), step)
    for p in range(pp):
        for t in range(tp):
            out, kinds = {}, {}
            for key, dense in tensors.items():
                name = key.split("/", 1)[-1]
                kind = param_kind(name, config) if dense.dim() else "replicated"
                if stage_of(name, stages, pp) != p or (kind == "replicated" and t):
                    continue
                out[key], kinds[key] = split_tensor(dense, kind, tp, t, config), kind
            write_shard(tmp, parallel.layout.coords(parallel.layout.rank(tp=t, pp=p)), out, kinds)
    head = dict(header or {})
    head.update(
        {
            "format": FORMAT,
            "tpedu_version": tpedu.__version__,
            "model": config.to_dict(),
            "parallel": parallel.to_dict(),
            "layout": layout,
        }
    )
    head.pop("files", None), head.pop("tensors", None)
    return finalize_step(Path(root), tmp, step, head, tok)


def reshard(
    src: str | Path, dst: str | Path, tp: int = 1, pp: int = 1, dp: int = 1, zero: int = 0
) -> Path:
    """Rewrite checkpoint `src` (a step dir or a root) for layout (tp, pp, dp) and ZeRO stage
    `zero` under `dst` (written as one process: dp rank 0's files hold everything).

    Parameters and optimizer state are merged to dense and re-split; step, data position, the
    source's other parallel settings (sequence parallelism, stage split, ...) and the rest of
    the index are kept, with one model chunk per pipeline rank. One process, no ranks; memory:
    the whole model once.
    """
    config, tensors, index = read_dense(src)
    tok = _tokenizer(resolve(src))
    source = read_parallel(src)
    parallel = replace(source, tp=tp, pp=pp, dp=dp, zero=zero, chunks=1)
    return write_sharded(dst, config, tensors, index["step"], parallel, index, tok)


def _tokenizer(step_dir: Path) -> object | None:
    if not (step_dir / "tokenizer.json").exists():
        return None
    return tokenizer.load(step_dir / "tokenizer.json")


def export_dense(src: str | Path, out: str | Path) -> Path:
    """A checkpoint -> a dense model directory, the format of `train --out` (config.json,
    model.safetensors, tokenizer.json if saved): `tpedu generate --model OUT` runs it."""
    config, tensors, index = read_dense(src)
    state = {k: v for k, v in tensors.items() if "/" not in k}
    return write_model_dir(out, config, state, index.get("train"), _tokenizer(resolve(src)))


def read_model_dir(model_dir: str | Path) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """(config, dense state dict) of a dense model directory (`train --out`, export_dense),
    checked first (`check_model_dir`). Memory: the whole model; `load_rank_slices` reads only
    one rank's part."""
    from safetensors.torch import load_file

    config = check_model_dir(model_dir)
    return config, load_file(Path(model_dir) / "model.safetensors")


def check_model_dir(model_dir: str | Path) -> GPTConfig:
    """The config of a dense model directory, after checking config.json's format and config,
    and that model.safetensors holds exactly DenseGPT's keys at DenseGPT's shapes (from the
    file's header: no tensor is read)."""
    model_dir = Path(model_dir)
    what = f"is {model_dir} a dense model directory (`tpedu train --out`, `reshard --to dense`)?"
    for name in ("config.json", "model.safetensors"):
        if not (model_dir / name).exists():
            raise CheckpointError(f"{model_dir / name} is missing: {what}")
    where = model_dir / "config.json"
    try:
        meta = json.loads(where.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{where} is not valid JSON ({e}); the file is corrupted") from None
    meta = meta if isinstance(meta, dict) else {}
    if meta.get("format") != DENSE_FORMAT:
        hint = (
            " It is a Hugging Face config (e.g. from `reshard --to hf`): load it with "
            "transformers, or convert it with tpedu.checkpoint.hf.config_from_hf and state_from_hf."
            if "model_type" in meta
            else ""
        )
        raise CheckpointError(
            f"{where}: field 'format' is {meta.get('format')!r}, expected "
            f"{DENSE_FORMAT!r}: {what}{hint}"
        )
    if not isinstance(meta.get("model"), dict):
        raise CheckpointError(f"{where} has no field 'model' (the GPTConfig); the file is damaged")
    try:
        config = GPTConfig.from_dict(meta["model"])
        config.check()
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: field 'model' is not a valid GPTConfig ({e})") from None
    file = model_dir / "model.safetensors"
    try:
        with safe_open(file, "pt") as f:
            stored = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error type
        raise CheckpointError(f"{file} cannot be read ({e}); the file is damaged") from None
    shapes = dense_shapes(config)
    wrong = [
        f"{k} {list(stored[k])} (config.json gives {list(shapes[k])})"
        for k in sorted(set(stored) & set(shapes))
        if stored[k] != shapes[k]
    ]
    problems = [
        f"{len(keys)} {label}: {', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''}"
        for label, keys in (
            ("missing", sorted(set(shapes) - set(stored))),
            ("unexpected", sorted(set(stored) - set(shapes))),
            ("with the wrong shape", wrong),
        )
        if keys
    ]
    if problems:
        raise CheckpointError(
            f"{file} does not hold the tensors of the model in config.json: {'; '.join(problems)}"
        )
    return config


def load_rank_slices(model_dir: str | Path, model: TPGPT | Sequence[TPGPT]) -> None:
    """Fill this rank's parameters from a dense model directory, reading from model.safetensors
    only the rows or columns the rank holds (safetensors' `get_slice`: memory = the shards).
    No communication."""
    with safe_open(Path(model_dir) / "model.safetensors", "pt") as f:
        fill_rank_slices(model, f.get_slice)


def fill_rank_slices(model: TPGPT | Sequence[TPGPT], get_slice: Callable[[str], object]) -> None:
    """Fill this rank's parameters from `get_slice(dense name)`, a safetensors-style slice of
    the dense tensor (`get_shape()`, `[:]`, `[a:b]`, `[:, a:b]`), reading only the rows or
    (row-parallel) columns the rank holds, one read per contiguous block.

    Which dense rows or columns a shard holds, in its order, is found by splitting an index
    vector with the shard map's own rules (`split_tensor`), so the fused QKV layout and the
    vocabulary padding need no second description here. No communication."""
    chunks = [model] if isinstance(model, nn.Module) else list(model)
    config, tp = chunks[0].config, chunks[0].tp
    rank = dist.get_rank(chunks[0].group) if dist.is_initialized() else 0
    with torch.no_grad():
        for e in shard_map(chunks):
            sl = get_slice(e.name)
            shape = sl.get_shape()
            if e.stored_kind == "replicated" or len(shape) == 0:
                e.param.copy_(sl[:])
                continue
            dim = 1 if e.stored_kind == "row" else 0
            index = torch.arange(1, shape[dim] + 1)  # 0 marks a padding row
            if dim == 1:
                index = index[None, :]
            picked = split_tensor(index, e.stored_kind, tp, rank, config).reshape(-1).tolist()
            for start, stop, at in _runs(picked):  # one read per contiguous block
                block = sl[:, start:stop] if dim else sl[start:stop]
                e.param.narrow(dim, at, stop - start).copy_(block)
            for at in (i for i, v in enumerate(picked) if v == 0):
                e.param.narrow(dim, at, 1).zero_()


def _runs(picked: list[int]) -> list[tuple[int, int, int]]:
    """[(dense start, dense stop, local offset)] of the contiguous blocks of a 1-based index
    list (0 entries: padding, skipped)."""
    runs: list[tuple[int, int, int]] = []
    for at, v in enumerate(picked):
        if v == 0:
            continue
        if runs and runs[-1][1] == v - 1 and runs[-1][2] + (runs[-1][1] - runs[-1][0]) == at:
            runs[-1] = (runs[-1][0], v, runs[-1][2])
        else:
            runs.append((v - 1, v, at))
    return runs


def load_sharded_model(
    model_dir: str | Path, group: dist.ProcessGroup | None = None, options: RunOptions | None = None
) -> TPGPT:
    """This rank's TPGPT of a dense model directory, built on the meta device and filled with
    `load_rank_slices`: the dense model is never in memory. `options`: TPGPT's."""
    config = check_model_dir(model_dir)
    with torch.device("meta"):
        structure = TPGPT(DenseGPT(config), group, options=options)
    model = materialize(structure)
    load_rank_slices(model_dir, model)
    return model


def import_dense(
    model_dir: str | Path, dst: str | Path, tp: int = 1, pp: int = 1, dp: int = 1
) -> Path:
    """A dense model directory (`train --out`, export_dense) -> a sharded checkpoint at step 0
    without optimizer state (so `train --resume` starts a fresh optimizer from these weights)."""
    config, state = read_model_dir(model_dir)
    return write_sharded(
        dst, config, state, 0, ParallelConfig(tp, pp, dp), tok=_tokenizer(model_dir)
    )
