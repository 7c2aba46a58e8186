"""Lesson 14: sharded, reshardable checkpoints: every rank saves only what it owns.

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
exactly like its parameter. Data-parallel replicas hold identical copies, so only dp rank 0
writes them; with ZeRO (any stage) the dp ranks share the writing, whole tensors each with their
optimizer state, about 1/dp per rank (`state_writers`), gathered from the shards one flat buffer
at a time, and each rank loads only its shards' elements: no rank ever holds the whole stage.
On disk, then, a checkpoint depends only on (tp, pp): loading at any dp and ZeRO stage just
reads the files, and each rank keeps the optimizer state of the parameters it updates.

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
import os
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import asdict, fields, is_dataclass
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
from tpedu.comm import collectives
from tpedu.model.config import LEGACY, GPTConfig
from tpedu.model.gpt import TPGPT
from tpedu.model.state import (
    dense_shapes,
    merge_shards,
    shard_map,
    split_tensor,
)
from tpedu.parallel.config import ParallelConfig
from tpedu.parallel.pipeline.schedules import stage_layers

# 2: the index keeps "model" (GPTConfig) and "parallel" (ParallelConfig) apart. tpedu 0.1 wrote
# 1, with the run-time fields inside "model": still read, by read_config and read_parallel.
FORMAT = "tpedu-sharded-2"
READABLE = ("tpedu-sharded-1", FORMAT)


INDEX = "index.json"


LATEST = "latest"


def _optimizer_view(opt: object | None) -> tuple[torch.optim.Optimizer | None, set[int]]:
    """(the torch optimizer holding state, ids of the parameters it updates): `opt` itself, or
    the `.inner` optimizer of a wrapper that has one."""
    inner = getattr(opt, "inner", opt) if opt is not None else None
    if inner is None:
        return None, set()
    return inner, {id(p) for g in inner.param_groups for p in g["params"]}


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def shard_file(tp_rank: int, pp_rank: int, dp_rank: int) -> str:
    return f"tp{tp_rank}-pp{pp_rank}-dp{dp_rank}.safetensors"


def prepare_step(root: Path, step: int) -> Path:
    """A fresh temporary directory for this step (a stale one from a crashed save is removed)."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{step_name(step)}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def write_shard(
    tmp: Path, coords: tuple[int, int, int], tensors: dict[str, torch.Tensor], kinds: dict[str, str]
) -> None:
    meta = {
        "tp_rank": str(coords[0]),
        "pp_rank": str(coords[1]),
        "dp_rank": str(coords[2]),
        "kinds": json.dumps(kinds),
    }
    data = safetensors_bytes({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, meta)
    write_synced(tmp / shard_file(*coords), data)


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


def _agree(error: BaseException | None, what: str) -> None:
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


def _header(
    config: GPTConfig,
    parallel: ParallelConfig,
    step: int,
    train_cfg: object | None,
    opt: object | None,
) -> dict:
    batch = getattr(train_cfg, "batch", None)
    seed = getattr(train_cfg, "seed", None)
    inner, _ = _optimizer_view(opt)
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


def layout_entry(parallel: ParallelConfig, config: GPTConfig) -> dict:
    """The index's "layout", what the files hold: sizes, ZeRO stage, and the layers of each
    (virtual) stage; virtual stage c·pp + s is on pp rank s ("chunks" > 1 only with the
    interleaved schedule)."""
    stages = stage_layers(config, parallel.pp * parallel.chunks, parallel.stage_split)
    return {
        "tp": parallel.tp,
        "pp": parallel.pp,
        "dp": parallel.dp,
        "zero": parallel.zero,
        **({"chunks": parallel.chunks} if parallel.chunks > 1 else {}),  # absent: 1
        "stages": [[r.start, r.stop] for r in stages],
    }


def save(
    root: str | Path,
    model: TPGPT | Sequence[TPGPT],
    opt: object | None,
    step: int,
    *,
    mesh: object | None = None,
    parallel: ParallelConfig | None = None,
    train_cfg: object | None = None,
    tok: object | None = None,
    scaler: object | None = None,
) -> Path:
    """Save this step's checkpoint under `root` from every rank of the world. Collective.

    model: this rank's TPGPT (or its pipeline chunks); opt: its AdamW, its ShardedDataParallel
    (ZeRO) or None; mesh: the run's tpedu.parallel.mesh.Mesh (None: one TP group, a model
    saved outside train); parallel: the run's ParallelConfig, stored in the index (None:
    plain TP over the model's group, its sequence parallelism as built); scaler: the fp16
    LossScaler, whose state the index keeps ("loss_scaler"). Returns root/step_N.
    3 tiny all-reduces (barriers that also carry failures: one rank's error makes every rank
    raise, and `latest` does not move).
    """
    root = Path(root)
    chunks = [model] if isinstance(model, nn.Module) else list(model)
    config = chunks[0].config
    if mesh is None:
        coords = (dist.get_rank(chunks[0].group), 0, 0)
        layout = (dist.get_world_size(chunks[0].group), 1, 1)
        cp_rank = dist.get_rank(chunks[0].cp_group) if chunks[0].cp > 1 else 0
    else:
        coords = (mesh.tp_rank, mesh.pp_rank, mesh.dp_rank)
        layout = (mesh.layout.tp, mesh.layout.pp, mesh.layout.dp)
        cp_rank = mesh.cp_rank
    if parallel is None:
        tp, pp, dp = layout
        sp = chunks[0].sequence_parallel
        parallel = ParallelConfig(tp, pp, dp, chunks=len(chunks), sequence_parallel=sp)
    if (parallel.tp, parallel.pp, parallel.dp, parallel.chunks) != (*layout, len(chunks)):
        raise ValueError(
            f"parallel says tp={parallel.tp} pp={parallel.pp} dp={parallel.dp} "
            f"chunks={parallel.chunks}, the ranks run tp, pp, dp = {layout} with {len(chunks)} "
            "chunks; pass the ParallelConfig the model was built with"
        )
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    tmp = Path(root) / f".tmp-{step_name(step)}"
    error: BaseException | None = None
    try:
        if rank0:
            prepare_step(root, step)
    except Exception as e:  # reported to every rank by _agree
        error = e
    _agree(error, f"preparing {tmp}")
    try:
        dp_size = layout[2] if parallel.zero else 1  # how many dp ranks write optimizer state
        tensors, kinds = _rank_tensors(chunks, opt, coords, dp_size)
        if tensors and cp_rank == 0:  # CP ranks hold the same shards, as replicas do
            write_shard(tmp, coords, tensors, kinds)
    except Exception as e:  # reported to every rank by _agree
        error = e
    _agree(error, f"writing {tmp}")
    final = root / step_name(step)
    try:
        if rank0:
            header = _header(config, parallel, step, train_cfg, opt)
            if scaler is not None:
                header["loss_scaler"] = scaler.state_dict()
            finalize_step(root, tmp, step, header, tok)
    except Exception as e:
        error = e
    _agree(error, f"finalizing {final}")
    return final


def _rank_tensors(
    chunks: list[TPGPT], opt: object | None, coords: tuple[int, int, int], dp_size: int
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """What this rank writes: the tensors `state_writers` gives its dp rank of `dp_size` (1, no
    ZeRO: dp rank 0 writes them all), each with the optimizer state it holds; replicated ones
    by tp rank 0 only. ZeRO (an `opt` with `whole_tensors`) hands them over whole from its
    shards, one buffer at a time: collective over DP."""
    tp_rank, _, dp_rank = coords
    entries = [
        e
        for e in shard_map(chunks)
        if not (e.tied_copy or (e.stored_kind == "replicated" and tp_rank))
    ]
    writers = state_writers([e.param.numel() for e in entries], dp_size)
    mine = [e for e, writer in zip(entries, writers, strict=True) if writer == dp_rank]
    if hasattr(opt, "whole_tensors"):
        got = opt.whole_tensors({id(e.param) for e in mine})
    else:
        inner, managed = _optimizer_view(opt)
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
    """Raise naming the first model config field that differs from the checkpoint's."""
    saved = index["model"]
    for f in fields(GPTConfig):
        mine = getattr(config, f.name)
        if saved.get(f.name) != mine:
            raise CheckpointError(
                f"{where / INDEX}: field 'model.{f.name}' is {saved.get(f.name)!r} but the model "
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
    inner, managed = (None, set()) if sharded else _optimizer_view(opt)
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
    _agree(error, f"loading {path}")
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


# Set by saving_now(): the loop's `save(k)` hook then saves at any step (a preempted run).
_SAVING_NOW: ContextVar[bool] = ContextVar("saving_now", default=False)


@contextmanager
def saving_now() -> Iterator[None]:
    """Inside: save_if_due saves whatever the step (a preempted run's last save,
    tpedu.train.preempt), without the loop knowing how its save hook was built."""
    token = _SAVING_NOW.set(True)
    try:
        yield
    finally:
        _SAVING_NOW.reset(token)


def save_if_due(
    cfg: object, step: int, model: TPGPT | Sequence[TPGPT], opt: object | None, **kwargs: object
) -> Path | None:
    """The training loop's hook: save() to cfg.ckpt_dir when `step` (optimizer steps done) is a
    multiple of cfg.save_every, the last step (cfg.steps), or inside `saving_now()`. No
    ckpt_dir: nothing."""
    every, steps = getattr(cfg, "save_every", 0), getattr(cfg, "steps", None)
    ckpt_dir = getattr(cfg, "ckpt_dir", None)
    if ckpt_dir and ((every and step % every == 0) or step == steps or _SAVING_NOW.get()):
        return save(ckpt_dir, model, opt, step, train_cfg=cfg, **kwargs)
    return None


def resume_from(
    cfg: object,
    model: TPGPT | Sequence[TPGPT],
    opt: object | None,
    scaler: object | None = None,
) -> int:
    """The training loop's hook: load cfg.resume (if set) and return the next step to run; an
    fp16 run's LossScaler continues from the saved scale (a fresh one if the run was not fp16)."""
    path = getattr(cfg, "resume", None)
    if not path:
        return 0
    index = load(path, model, opt)
    if scaler is not None and "loss_scaler" in index:
        scaler.load_state_dict(index["loss_scaler"])
    return index["step"]


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
