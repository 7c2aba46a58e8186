"""Lesson 14: how Hugging Face tensors become tpedu's dense tensors, once, for every use.

Each DenseGPT tensor is a stack of Hugging Face tensors along its rows (dim 0), each stored
as is or transposed: Llama's fused QKV is q_proj, k_proj, v_proj one under the other; every
GPT-2 matrix is one Conv1D weight, transposed. A model family describes itself as this table
(`Part`s per dense key), and three things follow from it:

    pack      HF tensors -> the dense tensor (import from a state dict)
    unpack    the dense tensor -> HF tensors (export)
    HFSlice   the dense tensor as a safetensors slice, read block by block from the HF files,
              so `convert.fill_rank_slices` loads one rank's rows or columns without ever
              reading (or holding) the whole tensor
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open


class Part(NamedTuple):
    """One Hugging Face tensor inside a dense tpedu tensor: its key, the dense rows it fills
    (None: all of them) and whether it is stored transposed (GPT-2's Conv1D: [in, out])."""

    key: str
    rows: int | None = None
    transposed: bool = False


Table = dict[str, list[Part]]  # DenseGPT key -> its parts, top to bottom


def pack(table: Table, get: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
    """The DenseGPT state dict from HF tensors (`get(key)`): each dense tensor = its parts,
    transposed where stored so, stacked along dim 0. Copies (contiguous)."""
    out = {}
    for name, parts in table.items():
        blocks = [get(p.key).t() if p.transposed else get(p.key) for p in parts]
        out[name] = torch.cat([b.detach() for b in blocks]).contiguous()
    return out


def unpack(table: Table, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The HF tensors of a DenseGPT state dict: the inverse of `pack`. Copies (contiguous)."""
    out = {}
    for name, parts in table.items():
        dense = state[name].detach()
        sizes = [dense.shape[0] if p.rows is None else p.rows for p in parts]
        if sum(sizes) != dense.shape[0]:
            raise ValueError(f"{name} has {dense.shape[0]} rows, the config gives {sum(sizes)}")
        for p, block in zip(parts, dense.split(sizes), strict=True):
            out[p.key] = (block.t() if p.transposed else block).clone().contiguous()
    return out


class HFSlice:
    """A dense tensor as a safetensors slice (`get_shape()`, `[a:b]`, `[:, a:b]`, `[:]`), each
    read going to the parts' own safetensors slices: only the requested rows or columns are
    read from disk. `stored`: each part's safetensors slice, in table order."""

    def __init__(self, parts: list[Part], stored: list[object]) -> None:
        self.parts, self.stored = parts, stored
        shapes = [list(s.get_shape()) for s in stored]
        self.shapes = [s[::-1] if p.transposed else s for p, s in zip(parts, shapes, strict=True)]
        if len({tuple(s[1:]) for s in self.shapes}) > 1:
            raise ValueError(f"{[p.key for p in parts]} have shapes {shapes}: they cannot stack")

    def get_shape(self) -> list[int]:
        return [sum(s[0] for s in self.shapes), *self.shapes[0][1:]]

    def __getitem__(self, key: slice | tuple[slice, ...]) -> torch.Tensor:
        rows, cols = (key, slice(None)) if isinstance(key, slice) else (*key, slice(None))[:2]
        r0, r1, _ = rows.indices(self.get_shape()[0])
        blocks, top = [], 0
        for part, sl, shape in zip(self.parts, self.stored, self.shapes, strict=True):
            a, b = max(r0, top) - top, min(r1, top + shape[0]) - top  # this part's rows
            top += shape[0]
            if a >= b:
                continue
            if len(shape) == 1:
                blocks.append(sl[a:b])
            elif part.transposed:  # dense rows are the stored columns
                blocks.append(sl[cols, a:b].t())
            else:
                blocks.append(sl[a:b, cols])
        return torch.cat(blocks)


class HFFiles:
    """The safetensors files of a `save_pretrained` directory (model.safetensors, or the shards
    listed in model.safetensors.index.json), opened lazily; `slice(parts)` is an HFSlice.
    Use as a context manager: the files close on exit."""

    def __init__(self, path: str | Path, alias: Callable[[str], list[str]] = lambda k: [k]):
        self.path, self.alias = Path(path), alias
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            self.where = json.loads(index.read_text())["weight_map"]
        elif (self.path / "model.safetensors").exists():
            with safe_open(self.path / "model.safetensors", "pt") as f:
                self.where = dict.fromkeys(f.keys(), "model.safetensors")
        else:
            raise ValueError(
                f"{self.path} has no model.safetensors: is it a `save_pretrained` directory "
                "(saved with safe_serialization)?"
            )
        self.stack, self.open = ExitStack(), {}

    def __enter__(self) -> HFFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.close()

    def get_slice(self, key: str) -> object:
        """The safetensors slice of `key` (or of the first of its aliases the files hold)."""
        found = next((k for k in self.alias(key) if k in self.where), None)
        if found is None:
            raise ValueError(
                f"{self.path} has no tensor {key!r}: is it a checkpoint of this model?"
            )
        file = self.where[found]
        if file not in self.open:
            self.open[file] = self.stack.enter_context(safe_open(self.path / file, "pt"))
        return self.open[file].get_slice(found)

    def slice(self, parts: list[Part]) -> HFSlice:
        return HFSlice(parts, [self.get_slice(p.key) for p in parts])


def require(config: object, family: str, wanted: dict[str, object]) -> None:
    """Raise a one-line ValueError naming the first of `wanted`'s settings that `config` does
    not have: what the Hugging Face `family` cannot express."""
    for key, value in wanted.items():
        if getattr(config, key) != value:
            raise ValueError(
                f"{family} needs {key}={value!r}, this model has {getattr(config, key)!r}"
            )
