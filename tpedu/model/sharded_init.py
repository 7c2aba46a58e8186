"""Lessons 07–14: build a rank's shards without ever holding the dense model.

`TPGPT(DenseGPT(config), group)` builds the whole dense fp32 model on every rank and then keeps
1/t of it: 26 GB per rank for a 6.5 B model, before the first step. `build_sharded` gives the
same shards, bit for bit, holding at most one dense *module* at a time:

1. Build the structure on the meta device: DenseGPT, then this rank's TPGPT chunks cut from it.
   Meta tensors have shapes and no storage, and creating them draws no random numbers.
2. Replay DenseGPT's initialisation on the CPU generator, one module at a time, in the dense
   model's order: first what each leaf module's constructor drew (its `reset_parameters`:
   Linear kaiming-uniform, Embedding normal, norms nothing), then `init_weights` (GPT-2's
   normal(0, 0.02) for every Linear and Embedding, in `nn.Module.apply`'s order, which for the
   leaves is the same order). Each draw runs on a CPU scratch copy of that one module, so the
   generator advances exactly as it does for the dense model and the values come out the same.
3. Copy this rank's part of each module's final values into its parameters with the shard
   map's rules (`tpedu.model.state.split_tensor`), and free the scratch.

Every rank replays every module, its own or not: the generator has to pass through all of them
to stay in step. That is the price of bit-exactness: each rank spends the RNG time of the whole
model (not its memory). Peak memory: this rank's shards plus the largest dense module (for a
50k-vocabulary, h = 4096 model, the 0.8 GB embedding).
"""

from __future__ import annotations

import copy
import ctypes
import ctypes.util
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from tpedu.model.config import GPTConfig
from tpedu.model.dense import INIT_TYPES, DenseGPT, init_weights
from tpedu.model.gpt import TPGPT
from tpedu.model.options import RunOptions
from tpedu.model.state import shard_map, split_tensor
from tpedu.tp.sequence_parallel import mark_sequence_parallel

try:  # glibc only (Linux): elsewhere the allocator decides
    _LIBC = ctypes.CDLL(ctypes.util.find_library("c"))
    _LIBC.malloc_trim.restype = ctypes.c_int
except (OSError, AttributeError, TypeError):
    _LIBC = None


def build_sharded(
    config: GPTConfig,
    group: dist.ProcessGroup | None = None,
    layers: Sequence[range] | None = None,
    seed: int = 0,
    fused_attention: bool = True,
    options: RunOptions | None = None,
) -> list[TPGPT]:
    """This rank's TPGPT chunks on the CPU, one per range in `layers` (None: one chunk of every
    layer), with exactly the values of `torch.manual_seed(seed); TPGPT(DenseGPT(config), group,
    r, options)`, without building the dense model. No communication."""
    with torch.device("meta"):
        dense = DenseGPT(config, fused_attention=fused_attention)
        chunks = [TPGPT(dense, group, r, options) for r in layers or [None]]
    for chunk in chunks:
        materialize(chunk)
    targets: dict[str, list[tuple[nn.Parameter, str]]] = {}
    for e in shard_map(chunks):  # a tied embedding's two copies share one dense name
        targets.setdefault(e.name, []).append((e.param, e.stored_kind))
    tp = dist.get_world_size(group) if dist.is_initialized() else 1
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    leaves = [
        (n, m) for n, m in dense.named_modules() if next(m.parameters(False), None) is not None
    ]
    torch.manual_seed(seed)
    constructed = {}
    for name, module in leaves:  # 1. the constructors' draws
        scratch = _cpu_copy(module)
        scratch.reset_parameters()
        if not isinstance(scratch, INIT_TYPES):  # kept as constructed (norms): small
            constructed[name] = scratch
    for name, module in leaves:  # 2. init_weights' draws; 3. this rank's shards
        scratch = constructed.pop(name, None) or _cpu_copy(module)
        with torch.no_grad():
            init_weights(scratch)
            for pname, value in scratch.named_parameters(recurse=False):
                key = f"{name}.{pname}"
                for p, kind in targets.get(key, []):
                    p.copy_(split_tensor(value, kind, tp, rank, config))
        del scratch, value
        _release_freed_memory()
    return chunks


def materialize(model: TPGPT) -> TPGPT:
    """A TPGPT built on the meta device, given (uninitialised) CPU storage, in place."""
    # meta -> CPU makes new Parameter objects: carry over the sequence-parallel marks
    marked = {n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", 0)}
    model.to_empty(device="cpu")
    mark_sequence_parallel(p for n, p in model.named_parameters() if n in marked)
    model._copies, model._placements = model._read_shard_map()  # qkv counts were made on meta
    _no_meta_left(model)
    return model


def _no_meta_left(model: nn.Module) -> None:
    """Refuse a model that keeps a meta tensor outside its parameters and buffers (to_empty
    cannot reach it): it would fail at the first step, far from the cause."""
    for name, m in model.named_modules():
        for attr, value in vars(m).items():
            found = [v for v in (value.values() if isinstance(value, dict) else [value])]
            if any(isinstance(v, torch.Tensor) and v.is_meta for v in found):
                raise AssertionError(f"{name or 'model'}.{attr} is still a meta tensor")


def _release_freed_memory() -> None:
    """Give the scratch module's freed pages back to the OS. glibc's malloc keeps freed blocks
    below its (adaptive, up to 32 MB) mmap threshold in the heap, where the next module's
    differently sized blocks fragment them: without this the peak creeps up module by module."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _cpu_copy(module: nn.Module) -> nn.Module:
    """A CPU copy of one meta leaf module, its storage uninitialised."""
    return copy.deepcopy(module).to_empty(device="cpu")
