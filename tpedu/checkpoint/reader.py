"""Lesson 14: loading a sharded checkpoint into a model at any layout, validated before any rank
copies a tensor (the format: tpedu.checkpoint.index)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn

from tpedu.checkpoint.files import (
    CheckpointError,
)
from tpedu.checkpoint.index import (
    INDEX,
    agree,
    check_config,
    check_file,
    optimizer_view,
    read_index,
)
from tpedu.model.config import GPTConfig
from tpedu.model.gpt import TPGPT
from tpedu.model.state import (
    dense_shapes,
    merge_shards,
    shard_map,
    split_tensor,
)


class ShardReader:
    """Reads shards, verifying each file (present, size, SHA-256) once, before its first use."""

    def __init__(self, step_dir: Path, index: dict, verify: bool = True) -> None:
        self.dir, self.index, self.verify = step_dir, index, verify
        self.checked: set[str] = set()

    def _check(self, file: str) -> None:
        if file not in self.checked:
            check_file(self.dir, self.index, file, self.verify)
            self.checked.add(file)

    def entry(self, key: str) -> dict:
        entry = self.index["tensors"].get(key)
        if entry is None:
            raise CheckpointError(f"{self.dir / INDEX}: field 'tensors' has no {key!r}")
        return entry

    def local(
        self,
        key: str,
        kind: str,
        tp: int,
        rank: int,
        config: GPTConfig,
        shape: tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        """Rank `rank`'s shard of `key` at tensor-parallel size `tp`. Saved at the same tp and
        kind, it is that rank's saved shard: one tensor read from one file. Otherwise it is
        split from the merged dense tensor (memory: that one dense tensor)."""
        entry = self.entry(key)
        shards = entry["shards"]
        same = [s.get("tp_rank") for s in shards] == list(range(tp))
        if kind == "replicated" or entry["kind"] != kind or not same:
            return split_tensor(self.dense(key, config, shape), kind, tp, rank, config)
        self._check_shape(key, entry, shape)
        return self._shard(key, shards[rank])

    def _check_shape(self, key: str, entry: dict, shape: tuple[int, ...] | None) -> None:
        if shape is not None and tuple(entry["shape"]) != tuple(shape):
            raise CheckpointError(
                f"{self.dir / INDEX}: field 'tensors.{key}.shape' is "
                f"{entry['shape']}, the model needs {list(shape)}"
            )

    def _shard(self, key: str, s: dict) -> torch.Tensor:
        """One saved shard of `key` (index entry `s`), its file and shape checked."""
        self._check(s["file"])
        with safe_open(self.dir / s["file"], framework="pt") as f:
            if key not in f.keys():
                raise CheckpointError(f"{self.dir / s['file']} has no tensor {key!r}")
            t = f.get_tensor(key)
        if list(t.shape) != s["shape"]:
            raise CheckpointError(
                f"{self.dir / s['file']}: tensor {key!r} has shape {list(t.shape)}, "
                f"{INDEX} says {s['shape']}"
            )
        return t

    def dense(
        self, key: str, config: GPTConfig, shape: tuple[int, ...] | None = None
    ) -> torch.Tensor:
        """The merged dense tensor `key` (checked against `shape` and its shards' shapes)."""
        entry = self.entry(key)
        self._check_shape(key, entry, shape)
        parts = [self._shard(key, s) for s in entry["shards"]]
        rows = entry["shape"][0] if entry["shape"] else None
        dense = merge_shards(parts, entry["kind"], config, rows)
        if list(dense.shape) != entry["shape"]:
            raise CheckpointError(
                f"{key}: its shards merge to {list(dense.shape)}, {INDEX} "
                f"field 'tensors.{key}.shape' says {entry['shape']}"
            )
        return dense


def load(
    path: str | Path,
    model: TPGPT | Sequence[TPGPT],
    opt: object | None = None,
    *,
    verify: bool = True,
) -> dict:
    """Load a checkpoint (a step directory, or a root with `latest`) into this rank's model and
    optimizer, at whatever layout they have: every tensor is merged from the saved shards and
    split for this rank. Returns the index (its "step" is the next step to run).

    Everything is read and checked first; then all ranks agree (1 tiny all-reduce over the
    world) and only then copy, so on any error no rank has changed anything.
    """
    chunks = [model] if isinstance(model, nn.Module) else list(model)
    config = chunks[0].config
    tp, rank = chunks[0].tp, dist.get_rank(chunks[0].group) if dist.is_initialized() else 0
    sharded = hasattr(opt, "load_pieces")  # ZeRO: keep only this rank's shards' elements
    inner, managed = (None, set()) if sharded else optimizer_view(opt)
    error: BaseException | None = None
    staged: list[tuple[torch.Tensor, torch.Tensor]] = []
    states: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
    pieces: list[tuple[int, slice, torch.Tensor]] = []  # ZeRO: (buffer, where, elements)
    state_pieces: dict[str, list[tuple[int, slice, torch.Tensor]]] = {}
    index: dict = {}
    try:
        step_dir, index = read_index(path)
        check_config(index, config, step_dir)
        reader = ShardReader(step_dir, index, verify)
        shapes = dense_shapes(config)
        state_keys = sorted({k.split("/", 1)[0] for k in index["tensors"] if "/" in k})
        if (sharded or (inner is not None and managed)) and index["step"] > 0 and not state_keys:
            raise CheckpointError(
                f"{step_dir / INDEX} holds no optimizer state "
                "(saved without one); load it with opt=None"
            )
        for e in shard_map(chunks):
            name, p, kind = e.name, e.param, e.stored_kind
            local = reader.local(name, kind, tp, rank, config, shapes[name])
            if local.shape != p.shape:
                raise CheckpointError(
                    f"{name}: the checkpoint gives this rank a "
                    f"{list(local.shape)} shard, the model has "
                    f"{list(p.shape)}"
                )
            if sharded:
                pieces.append(opt.shard_piece(p, local))
            else:
                staged.append((p, local))
            if sharded or (inner is not None and id(p) in managed):
                st = {}
                for key in state_keys:
                    entry = reader.entry(f"{key}/{name}")
                    scalar = entry["shape"] == []  # AdamW's step: stored once, replicated
                    st[key] = reader.local(
                        f"{key}/{name}", "replicated" if scalar else kind, tp, rank, config
                    )
                if sharded:
                    for key, value in st.items():
                        state_pieces.setdefault(key, []).append(opt.shard_piece(p, value))
                else:
                    states[p] = st
    except Exception as e:
        error = e
    agree(error, f"loading {path}")
    if sharded:
        opt.load_pieces(pieces, state_pieces)
    with torch.no_grad():
        for p, local in staged:
            p.copy_(local.to(p.dtype))
    for p, st in states.items():
        inner.state[p] = {
            k: v if v.dim() == 0 else v.to(device=p.device, dtype=p.dtype) for k, v in st.items()
        }
    return index
