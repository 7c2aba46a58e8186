"""Lesson 13: one rank's training step on the meta device, in a fake process group: the bytes
it holds and sends (measure_rank), for any rank of any layout (dry_run).
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import time
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpedu.analysis.activation_memory import SavedTensorCounter
from tpedu.analysis.dryrun.compare import compare
from tpedu.analysis.dryrun.figures import (
    DRY_DTYPES,
    PHASE_ORDER,
    DryRun,
    RankFigures,
    Traffic,
)
from tpedu.comm import collectives
from tpedu.comm.tracer import CommTracer
from tpedu.model.config import GPTConfig
from tpedu.model.dense import DenseGPT
from tpedu.moe.expert_parallel import ExpertParallelMoE, balanced_routing
from tpedu.parallel.config import ParallelConfig
from tpedu.parallel.mesh import AXIS_NAMES, Mesh
from tpedu.parallel.pipeline.runtime import build_stage_chunks
from tpedu.parallel.pipeline.schedules import action_parts
from tpedu.parallel.zero import ShardedDataParallel
from tpedu.train.config import TrainConfig
from tpedu.train.loop import run_loop
from tpedu.train.optim import reduction_groups
from tpedu.train.step import build_step, check_setup, replica_mean, split_batch


def build_dense(config: GPTConfig, device: str | torch.device = "meta", seed: int = 0) -> DenseGPT:
    """The dense model every rank slices its shards from: on the meta device, no memory at all
    (on a real device, seeded as train seeds it)."""
    if torch.device(device).type != "meta":
        torch.manual_seed(seed)
    with torch.device(device):
        return DenseGPT(config)


@contextlib.contextmanager
def attention_as_on_device() -> Iterator[None]:
    """While active, F.scaled_dot_product_attention on meta tensors runs the CPU flash kernel's
    meta function (what a real CPU/GPU run's autograd saves), not the math fallback that meta
    tensors would get (which saves the [b, a, s, s] probabilities). Other calls are untouched.
    A patch of the function for the whole step rather than a TorchFunctionMode: checkpointed
    blocks (recompute) rerun attention inside autograd's backward, which such a mode entered
    here does not reach (tried: the recomputed shapes then differ and checkpoint raises)."""
    original = F.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
        plain = attn_mask is None and dropout_p == 0.0 and not kw.get("enable_gqa", False)
        if q.device.type == "meta" and plain and q.shape[1] == k.shape[1]:
            flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
            return flash(q, k, v, dropout_p, is_causal, scale=scale)[0]
        return original(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, **kw)

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


class _ActivationWindows:
    """Bytes each forward of each model chunk saves for backward, split into embedding,
    blocks and head (by the position of the records between hooks on the chunk and on its
    first and last block)."""

    def __init__(self, counter: SavedTensorCounter, chunks: Sequence[nn.Module]) -> None:
        self.counter = counter
        self.per_forward: dict[tuple[int, int], tuple[int, int, int]] = {}  # (mb, c) -> parts
        self.per_layer = 0
        self._handles: list = []
        self._marks: list[int] = []
        self._seen = [0] * len(chunks)
        for c, chunk in enumerate(chunks):
            self._handles.append(chunk.register_forward_pre_hook(self._start))
            self._handles.append(chunk.register_forward_hook(lambda *_, c=c: self._end(c)))
            if len(chunk.blocks):
                first, last = chunk.blocks[0], chunk.blocks[-1]
                self._handles.append(first.register_forward_pre_hook(self._mark))
                self._handles.append(last.register_forward_hook(lambda *_: self._mark()))
                self._handles.append(first.register_forward_hook(lambda *_: self._mark_one()))

    def _now(self) -> int:
        return len(self.counter.records)

    def _start(self, *_: object) -> None:
        self._marks = [self._now()]

    def _mark(self, *_: object) -> None:
        self._marks.append(self._now())

    def _mark_one(self) -> None:  # the first block's own bytes: one layer, one micro-batch
        if not self.per_layer:
            self.per_layer = self._bytes(self._marks[-1], self._now())

    def _bytes(self, a: int, b: int) -> int:
        return sum(r.nbytes for r in self.counter.records[a:b])

    def _end(self, c: int) -> None:
        end = self._now()
        marks = self._marks + [end] * (3 - len(self._marks))  # a chunk without blocks
        start, lo, hi = marks[0], marks[1], marks[2]
        mb = self._seen[c]
        self._seen[c] += 1
        self.per_forward[(mb, c)] = (
            self._bytes(start, lo),
            self._bytes(lo, hi),
            self._bytes(hi, end),
        )

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def _peak(
    actions: Sequence[tuple], per_forward: dict
) -> tuple[int, list[tuple[int, int]], tuple[int, int, int]]:
    """(peak bytes, the (micro-batch, chunk) forwards held then, their (embedding, layers,
    head) bytes): walk the schedule, adding a forward's saved bytes at F, freeing them at B."""
    held: list[tuple[int, int]] = []
    best, at_peak, parts = 0, [], (0, 0, 0)
    for action in actions:
        kind, mb, c = action_parts(action)
        if kind == "F":
            held.append((mb, c))
            total = sum(sum(per_forward[k]) for k in held)
            if total > best:
                best, at_peak = total, list(held)
                parts = tuple(sum(per_forward[k][i] for k in held) for i in range(3))
        else:
            held.remove((mb, c))
    return best, at_peak, parts


def _moe_blocks(chunk: nn.Module) -> int:
    """Blocks of a model chunk whose MLP is a mixture of experts."""
    return sum(isinstance(b.mlp, ExpertParallelMoE) for b in chunk.blocks)


def traffic_summary(tracer: CommTracer) -> tuple[Traffic, ...]:
    """The tracer's summary as Traffic lines, in a fixed order (group, phase, op)."""
    rows = [
        Traffic(g, op, ph, calls, numel, nbytes, tracer.wire_bytes(op, ph, g))
        for (g, op, ph), (calls, numel, nbytes) in tracer.summary().items()
    ]

    order = [*AXIS_NAMES, "emb", "ep", "edp", "world"]

    def key(t: Traffic) -> tuple:
        g = order.index(t.group) if t.group in order else len(order)
        ph = PHASE_ORDER.index(t.phase) if t.phase in PHASE_ORDER else len(PHASE_ORDER)
        return g, t.group, ph, t.op

    return tuple(sorted(rows, key=key))


def _optimizer_state(opt: object, params: Sequence[nn.Parameter]) -> tuple[int, int, int, int]:
    """(bytes of per-parameter states, bytes of the other (step) states) that an AdamW or a
    ShardedDataParallel holds, and (parameters, tensors) it is to update: all of `params`, or
    with ZeRO its shards (padding included). Sizes from shapes: valid on meta."""
    if isinstance(opt, ShardedDataParallel):
        inner, owned = opt.inner, opt.shards()
    else:
        inner, owned = opt, list(params)
    per_param = other = 0
    for p, state in inner.state.items() if inner is not None else ():
        for v in state.values():
            if torch.is_tensor(v):
                n = v.numel() * v.element_size()
                if v.shape == p.shape:
                    per_param += n
                else:
                    other += n
    return per_param, other, sum(p.numel() for p in owned), len(owned)


def measure_rank(
    config: GPTConfig,
    parallel: ParallelConfig,
    batch: int,
    device: str | torch.device = "meta",
    dense: DenseGPT | None = None,
    dtype: str = "fp32",
) -> RankFigures:
    """One training step of this rank, as train runs it, on `device`; its figures. Collective:
    every rank of the (real or fake) world must call it.

    Data: token ids [b/m, s] (zeros) per micro-batch, targets likewise; the pipeline passes
    [b/m, s, H] activations ([b/m, s/t, H] with sequence parallelism). The step runs inside
    `run_loop` for one step, so its communication is a real step's: `TrainStep`'s,
    train's world all-reduce of the loss, and whatever
    run_loop adds per step (today 1 int32 world all-reduce: the preemption check).

    Long because it is build, step, then read: the figures are read off the objects the step
    used (its optimizer, its flat buffers, its saved tensors), which live only in here.
    """
    m = check_setup(config, parallel, batch)
    parallel.layout.check_world(dist.get_world_size())
    dense = dense if dense is not None else build_dense(config, device)
    cfg = TrainConfig(batch=batch, dtype=dtype)  # train's defaults: grad_clip 1.0, decay 0.1
    loop_cfg = TrainConfig(batch=batch, steps=1, eval_every=0, progress=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    with attention_as_on_device():
        mesh = Mesh(parallel.layout)
        # As train's stage_chunks builds this rank's part, on the meta device
        chunks = build_stage_chunks(
            dense, mesh.tp_group, mesh.pp_rank, parallel.pp, parallel.chunks,
            parallel.stage_split, parallel.model_options(mesh),
        )  # fmt: skip
        stage = nn.ModuleList(chunks)
        train_step = build_step(chunks, mesh, parallel, cfg)  # as train builds it
        opt, acts, micro = train_step.opt, train_step.actions, train_step.shape[0]
        # inputs and targets apart, as a real batch has them (a shared storage would be
        # counted once by SavedTensorCounter); CP: this rank's s/cp positions
        s_cp = config.seq_len // parallel.cp
        ids = [torch.zeros(micro, s_cp, dtype=torch.long, device=device) for _ in range(m)]
        targets = [torch.zeros(micro, s_cp, dtype=torch.long, device=device) for _ in range(m)]

        def step(k: int) -> tuple[float, float]:
            # train's step, minus its .item()s (meta has no values): TrainStep, then the loss
            # averaged over the replicas, whose 1 float64 world all-reduce sends the same
            # message with no value to add (None)
            train_step(ids, targets, k)
            replica_mean(None, mesh)
            return 0.0, 0.0

        counter = SavedTensorCounter(stage)
        windows = _ActivationWindows(counter, chunks)
        try:
            # run_loop itself, for one step: whatever the loop adds per step (e.g. the
            # preemption check's all-reduce) is traced as in a real run
            with CommTracer() as tracer, counter:
                run_loop(loop_cfg, 0, "dry run", step, evaluate=lambda: 0.0, save=lambda k: None)
        finally:
            windows.remove()
    peak, held, parts = _peak(acts, windows.per_forward)
    params = list(stage.parameters())
    weights = sum(p.numel() * p.element_size() for p in params)
    gradients = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    flat, peak_gathered = (), 0
    if isinstance(opt, ShardedDataParallel):
        # The parameters (and ZeRO-1's gradients) are views into the flat buffers (ZeRO-3:
        # resized to nothing at rest), so their shapes no longer tell the storage: count the
        # storages held, each once.
        weights, gradients = opt.weight_bytes(), opt.grad_bytes()
        where = {}  # id(module) -> (chunk, block index or -1)
        for c, chunk in enumerate(chunks):
            where[id(chunk)] = (c, -1)
            where |= {id(block): (c, i) for i, block in enumerate(chunk.blocks)}
        flat = tuple(
            (sum(p.numel() for p in b.params), b.n, *where[id(u.module)])
            for u in opt.units
            for b in u.buffers
        )
        # ZeRO-2 holds every buffer whole throughout (its peak is all of them)
        peak_gathered = opt.peak_gathered if opt.level == 3 else opt.gathered_bytes()
    opt_bytes, opt_other, opt_params, opt_tensors = _optimizer_state(opt, params)
    chunk_layers = tuple(
        (c.layer_ids[0], c.layer_ids[-1] + 1) if c.layer_ids else (0, 0) for c in chunks
    )
    return RankFigures(
        rank=rank,
        world=world,
        coords=parallel.layout.coords(rank),
        chunks=chunk_layers,
        first=chunks[0].first,
        last=chunks[-1].last,
        micro_batches=m,
        micro_batch=micro,
        params=sum(p.numel() for p in params),
        param_tensors=len(params),
        weights=weights,
        gradients=gradients,
        optimizer=opt_bytes,
        optimizer_steps=opt_other,
        optimizer_params=opt_params,
        optimizer_tensors=opt_tensors,
        activations=peak,
        in_flight=len(held),
        layer_forwards=sum(len(chunks[c].blocks) for _, c in held),
        moe_forwards=sum(_moe_blocks(chunks[c]) for _, c in held),
        held_embedding=sum(1 for _, c in held if c == 0 and chunks[0].first),
        held_head=sum(1 for _, c in held if c == len(chunks) - 1 and chunks[-1].last),
        act_embedding=parts[0],
        act_layers=parts[1],
        act_head=parts[2],
        act_per_layer=windows.per_layer,
        traffic=traffic_summary(tracer),
        flat_buffers=flat,
        peak_gathered=peak_gathered,
        reduced_over=reduction_groups(chunks, parallel.layout),
        dtype=dtype,
    )


@contextlib.contextmanager
def fake_world(rank: int, world: int) -> Iterator[None]:
    """This process as rank `rank` of a fake process group of `world` ranks, torn down after
    (and the tracer's group names it added removed), so nothing leaks into the caller."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError(
            "a process group is already initialised in this process; run the dry run in a "
            "fresh process (dry_run does that by itself)"
        )
    with collectives.group_names_kept():  # Mesh names its groups; the ids die with them
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            yield
        finally:
            dist.destroy_process_group()


def rank_class(
    parallel: ParallelConfig,
    rank: int,
    config: GPTConfig | None = None,
    batch: int | None = None,
) -> tuple[int, ...]:
    """(pp rank, cp rank), and with an MoE `config` whose balanced routing (see below) gives
    the EP ranks unequal loads also the EP rank: the ranks of one class measure equal figures,
    so a dry run measures one of them and gives the others its figures under their own rank
    and coordinates.

    Why the tp and dp ranks do not matter: every TP rank of a stage holds shards of the same
    shapes (the vocabulary padded to Vp/t rows each, heads split evenly or a KV head
    replicated whole), every DP rank the same stage (ZeRO's shards are equal n-element pieces
    of a padded buffer), and every collective a rank joins has the same size and the same
    number of members; on the meta device nothing else, no value, can differ. The stage (its
    layers, the embedding or the head, the first stage sends no gradient back) and the CP rank
    (a contiguous split gives later ranks more of the causal square) do differ. EP ranks hold
    as many experts each; under balanced routing (tpedu.moe.expert_parallel.balanced_routing)
    they also receive as many rows unless E does not divide T·k (the first experts then get
    one more): only then is the EP rank part of the class (it needs `config` and `batch`).
    tests/test_dryrun.py measures every rank of small layouts against its class's."""
    c = parallel.layout.coords(rank)
    if config is None or batch is None or not _uneven_experts(config, parallel, batch):
        return c["pp"], c["cp"]
    return c["pp"], c["cp"], parallel.layout.expert_coords(rank)["ep"]


def _uneven_experts(config: GPTConfig, parallel: ParallelConfig, batch: int) -> bool:
    """Whether balanced routing gives the EP ranks' experts unequal numbers of rows."""
    if not config.experts or parallel.ep == 1:
        return False
    per_replica, m = split_batch(batch, parallel)
    tokens = per_replica // m * config.seq_len // parallel.cp
    kept = balanced_routing(tokens, config.experts, config.top_k, config.capacity_factor).kept
    local = config.experts // parallel.ep
    return len({sum(kept[i : i + local]) for i in range(0, config.experts, local)}) > 1


def default_ranks(parallel: ParallelConfig) -> list[int]:
    """The fullest ranks: rank 0 (embedding, most micro-batches in flight) and the first rank
    of the last stage (final norm, LM head, loss), or only rank 0 without a pipeline."""
    last = parallel.layout.rank(pp=parallel.pp - 1)
    return [0] if last == 0 else [0, last]


def dry_run(
    config: GPTConfig,
    parallel: ParallelConfig,
    batch: int = 8,
    ranks: Sequence[int] | None = None,
    dtype: str = "fp32",
) -> list[DryRun]:
    """Dry-run one training step on each of `ranks` (default: `default_ranks`), each alone on a
    fake process group of parallel.world ranks, on the meta device, computing in `dtype`
    ("fp32", or "bf16": autocast as train's --dtype bf16). Returns one DryRun each.

    Raises a ValueError (before building anything) if the setup cannot run. Inside a process
    that already has a process group (a launched rank), it runs in a fresh spawned process.
    """
    check_setup(config, parallel, batch)
    if dtype not in DRY_DTYPES:
        raise ValueError(
            f"the dry run steps in {' or '.join(DRY_DTYPES)}, not {dtype!r}: fp16's loss "
            "scaler reads the gradients' values, which meta tensors do not have"
        )
    ranks = list(default_ranks(parallel) if ranks is None else ranks)
    for r in ranks:
        parallel.layout.coords(r)  # raises for a rank outside the world
    if dist.is_initialized():
        with mp.get_context("spawn").Pool(1) as pool:
            return pool.apply(_dry_run_here, (config, parallel, batch, ranks, dtype))
    return _dry_run_here(config, parallel, batch, ranks, dtype)


_POOL: dict = {}  # what forked workers inherit: the setup and the meta model


def _dry_run_one(rank: int) -> DryRun:
    config, parallel, batch, dense, dtype = (
        _POOL[k] for k in ("config", "parallel", "batch", "dense", "dtype")
    )
    t0 = time.perf_counter()
    with fake_world(rank, parallel.world):
        figures = measure_rank(config, parallel, batch, "meta", dense, dtype)
    seconds = time.perf_counter() - t0
    return DryRun(
        config, parallel, batch, figures, compare(figures, config, parallel, batch), seconds
    )


def _dry_run_here(
    config: GPTConfig, parallel: ParallelConfig, batch: int, ranks: list[int], dtype: str
) -> list[DryRun]:
    """One rank of each class (`rank_class`) in turn on a fresh fake world, many over forked
    workers, one per core (each about a second at full size: the meta kernels are Python);
    the other ranks of a class get its figures."""
    start = time.perf_counter()
    _POOL.update(
        config=config, parallel=parallel, batch=batch, dense=build_dense(config), dtype=dtype
    )
    built = time.perf_counter() - start  # once: every rank slices the same meta tensors
    first = {}  # class -> the first of `ranks` in it, the one measured
    for r in ranks:
        first.setdefault(rank_class(parallel, r, config, batch), r)
    measure = list(first.values())
    try:
        workers = min(len(measure), mp.cpu_count())
        if workers > 1 and len(measure) > 2:
            with mp.get_context("fork").Pool(workers, torch.set_num_threads, (1,)) as pool:
                runs = pool.map(_dry_run_one, measure, chunksize=1)
            measured = dict(zip(measure, runs, strict=True))
        else:
            measured = {r: _dry_run_one(r) for r in measure}
    finally:
        _POOL.clear()
    cls = lambda r: rank_class(parallel, r, config, batch)
    out = [measured.get(r) or _as_rank(measured[first[cls(r)]], r) for r in ranks]
    if out:  # the shared model's build, charged to the first rank
        out[0] = dataclasses.replace(out[0], seconds=out[0].seconds + built)
    return out


def _as_rank(run: DryRun, rank: int) -> DryRun:
    """`run`'s figures as those of `rank`, a rank of the same class (compared anew)."""
    figures = dataclasses.replace(run.figures, rank=rank, coords=run.parallel.layout.coords(rank))
    return dataclasses.replace(
        run,
        figures=figures,
        comparisons=compare(figures, run.config, run.parallel, run.batch),
        seconds=0.0,
        measured_on=run.figures.rank,
    )
