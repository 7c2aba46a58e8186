"""Lesson 13: a full-scale dry run on a laptop: one rank of a 128-GPU job, built and stepped
on the meta device, with every byte it holds and sends counted and set beside the ledger.

    runs = dry_run(GPTConfig.gpt2_like(50257, seq_len=2048, n_layers=32, hidden=4096,
                                       n_heads=32), ParallelConfig(4, 4, 8), batch=8, ranks=[37])
    print(format_table(runs[0]))

How (`measure_rank`, the same code on a real process group and on a fake one):

1. A fake process group: `dist.init_process_group("fake", store=FakeStore(), rank=R,
   world_size=W)` (torch.testing's FakeProcessGroup). Every collective returns at once and
   moves nothing, so rank 37 of 128 runs alone, while `dist.get_rank()`, the group sizes and
   `tpedu.parallel.mesh.Mesh` see the real layout. Its sends and receives complete too, so
   the pipeline schedule runs unchanged: a receive leaves its (meta) buffer as it was, which
   is all a meta tensor is (a shape and a dtype).
2. The meta device: `DenseGPT` is built under `with torch.device("meta")` (6.7B parameters,
   no bytes), and TPGPT slices its tensors into this rank's shards exactly as on real ranks
   (`build_stage_chunks`). Forward, backward and AdamW run on meta tensors: shapes and dtypes
   propagate, nothing is computed.
3. One training step as `tpedu.train.loop` runs it, in fp32 (train's default --dtype) or bf16:
   `run_loop` for one step around train's own `TrainStep` (the pipeline schedule for this
   rank's stage, DP bucket all-reduces, tied-embedding and TP gradient fix-ups, the gradient
   norm, AdamW, or with ZeRO `make_sharded`'s ShardedDataParallel as both the gradient reducer
   and the optimizer) and train's loss all-reduce; tp only is a pipeline of one stage.
   `CommTracer` records every collective; `SavedTensorCounter` every tensor saved for
   backward (keyed by storage identity: meta tensors have no data pointers); the peak is the
   largest sum over the micro-batch forwards the schedule holds at once.

Two things meta tensors would get wrong, and what is done instead:

- `F.scaled_dot_product_attention` on meta falls back to the math kernel, which saves the
  [b, a, s, s] probabilities; a real CPU or GPU run uses flash attention (q, k, v, output,
  logsumexp only). During the dry run, SDPA on meta tensors calls the CPU flash kernel's meta
  function, so the saved tensors are a real run's (`tests/test_dryrun.py` checks it against
  gloo ranks). CUDA's flash kernels save the same kinds of tensors (plus their RNG state).
- Data-dependent checks (token ids in range) cannot look at values: tpedu.tp's embedding
  and loss skip them for meta tensors.
- torch.autocast refuses the meta device. With `dtype="bf16"` (--dtype bf16) the step runs
  under `tpedu.train.precision.meta_autocast` instead, which casts as CPU autocast does for the
  ops tpedu's model calls (matmuls and attention to bf16, a weight once per step, the
  replicated head's cross-entropy to fp32): the tensors saved and sent equal a CPU autocast
  run's, dtype by dtype (`tests/test_dryrun.py`). CUDA's autocast agrees on those ops; it
  runs softmax and exp in fp32 where the CPU keeps bf16, which only the explicit attention
  paths call (dropout > 0, ring attention): there a GPU run can hold more than this figure.

Context parallelism (cp > 1): each rank builds its TPGPT with its CP group (the mesh's cp
axis) and steps on its s/cp positions, as train feeds
them (`TPGPT.local_sequence`). Ring attention on meta tensors decides which K/V blocks to skip
from the real positions (a CPU tensor). The ledger's activations are then those of s/cp
positions, TP messages hold s/cp positions, and the CP group's traffic is set beside
tpedu.cp.traffic's formulas (the ring's K/V sends or Ulysses' all-to-alls), the loss's mean
over the whole sequence and the gradients' sum over CP.

ZeRO-1/2/3: the parameters are views into flat buffers (ZeRO-3 resizes their storage to
nothing at rest, which works on meta tensors too), so the weights are the whole buffers still
held after the step plus the fp32 shards AdamW steps; the gradients and AdamW's states are the
shards' (ZeRO-1 keeps the whole local gradients too); `peak_gathered` is the most bytes of
whole parameters held at once during the step.

Then `compare` sets each figure beside its prediction: the memory ledger
(`tpedu.analysis.memory.ledger`, for pipeline stage 0, at fp32: 4 + 4 + 8 bytes per parameter)
and the what-if's message volumes (`tpedu.analysis.whatif.volumes`), and names every
difference with its size: the prediction plus the named terms equals the measurement, and an
`unexplained` remainder (0 in every layout the tests run) would show a formula or the code is
wrong. Both models count GPT-2-style blocks; for --arch llama only the measured figures are
shown.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import multiprocessing as mp
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpedu.analysis import whatif
from tpedu.analysis.activation_memory import SavedTensorCounter
from tpedu.analysis.memory import GB, Ledger, activation_bytes_per_layer, ledger
from tpedu.analysis.shape import ModelShape, layer_params
from tpedu.comm import collectives
from tpedu.comm.tracer import CommTracer
from tpedu.cp.traffic import ring_messages, ulysses_messages
from tpedu.model.config import GPTConfig
from tpedu.model.dense import DenseGPT
from tpedu.parallel.config import ParallelConfig
from tpedu.parallel.mesh import Mesh
from tpedu.parallel.pipeline.runtime import build_stage_chunks
from tpedu.parallel.pipeline.schedules import action_parts
from tpedu.parallel.pipeline.schedules import schedule as pipeline_schedule
from tpedu.parallel.zero import ShardedDataParallel
from tpedu.tp.embedding import padded_vocab
from tpedu.train.config import TrainConfig
from tpedu.train.loop import run_loop
from tpedu.train.step import build_step, replica_mean, split_batch

VALUE_BYTES = 4  # weights and gradients (fp32: the master weights), and fp32 values
DRY_DTYPES = ("fp32", "bf16")  # the compute dtypes a dry run steps in
ADAMW_BYTES = 8  # exp_avg and exp_avg_sq per parameter (fp32 weights are their own master)
GROUP_ORDER = ("tp", "pp", "dp", "emb", "world")
PHASE_ORDER = ("forward", "backward", "grad_sync")


# --------------------------------------------------------------------------------- figures


@dataclass(frozen=True)
class Traffic:
    """One (group, op, phase) line of the tracer's summary for the step."""

    group: str
    op: str
    phase: str
    calls: int
    elements: int
    bytes: int


@dataclass(frozen=True)
class RankFigures:
    """What one rank holds and sends during one training step (all sizes in bytes).

    activations: the peak of the bytes saved for backward, summed over the micro-batch
    forwards the schedule holds at once (`in_flight` of them, `layer_forwards` block forwards
    in all, `held_embedding` / `held_head` through the embedding / the head); at that peak,
    `act_embedding` / `act_layers` / `act_head` of it were saved by the embedding, the blocks,
    and the final norm, LM head and loss. `act_per_layer`: one block's, one micro-batch.
    optimizer / optimizer_steps are measured from the optimizer's state tensors;
    optimizer_params / optimizer_tensors are what its assignment says it updates.
    """

    rank: int
    world: int
    coords: tuple[int, int, int]  # (tp_rank, pp_rank, dp_rank)
    chunks: tuple[tuple[int, int], ...]  # [start, stop) blocks of each model chunk
    first: bool  # holds the embedding (first virtual stage)
    last: bool  # holds the final norm and the head (last virtual stage)
    micro_batches: int
    micro_batch: int  # sequences per micro-batch
    params: int
    param_tensors: int
    weights: int
    gradients: int
    optimizer: int  # AdamW's exp_avg and exp_avg_sq
    optimizer_steps: int  # AdamW's step counters (one scalar per parameter tensor)
    optimizer_params: int  # parameters this rank's optimizer updates (ZeRO: its shards)
    optimizer_tensors: int  # ... and their tensors
    activations: int
    in_flight: int
    layer_forwards: int
    held_embedding: int  # forwards through the embedding (first chunk) held at the peak
    held_head: int  # forwards through the head (last chunk) held at the peak
    act_embedding: int
    act_layers: int
    act_head: int
    act_per_layer: int
    traffic: tuple[Traffic, ...]
    # ZeRO: each flat buffer's (parameter elements, shard elements n, model chunk, block
    # index in the chunk or -1 for the chunk's rest), and the most bytes of whole parameters
    # held at once during the step
    flat_buffers: tuple[tuple[int, int, int, int], ...] = ()
    peak_gathered: int = 0
    dtype: str = "fp32"  # the step's compute dtype (train's --dtype): "fp32" or "bf16"

    @property
    def blocks(self) -> int:
        return sum(b - a for a, b in self.chunks)

    def sent(self, group: str) -> int:
        """Logical bytes of every traced call on `group` during the step."""
        return sum(t.bytes for t in self.traffic if t.group == group)

    def comparable(self) -> dict:
        """Everything that a real run and a dry run of the same rank must give equally."""
        return {
            k: getattr(self, k)
            for k in (
                "params",
                "param_tensors",
                "weights",
                "gradients",
                "optimizer",
                "optimizer_steps",
                "optimizer_params",
                "activations",
                "in_flight",
                "act_embedding",
                "act_layers",
                "act_head",
                "traffic",
                "flat_buffers",
                "peak_gathered",
            )
        }


@dataclass(frozen=True)
class Term:
    """One named difference between a prediction and the measurement."""

    name: str
    value: float


# run_loop's per-step all-reduce (MAX) over the world of one int32: did any rank get SIGTERM
STOP_CHECK = Term("the loop's preemption check (tpedu.train.preempt): 1 int32", 4)


@dataclass(frozen=True)
class Comparison:
    """measured = predicted + Σ terms + unexplained (0 when every difference is named)."""

    what: str
    measured: float
    predicted: float | None  # None: the model does not apply (see `note`)
    source: str  # "ledger" or "what-if"
    terms: tuple[Term, ...] = ()
    note: str = ""

    @property
    def unexplained(self) -> float:
        if self.predicted is None:
            return 0.0
        return self.measured - self.predicted - sum(t.value for t in self.terms)


@dataclass(frozen=True)
class DryRun:
    """One rank's figures, their comparisons with the ledger and the what-if, and the setup."""

    config: GPTConfig
    parallel: ParallelConfig
    batch: int
    figures: RankFigures
    comparisons: tuple[Comparison, ...]
    seconds: float = 0.0  # wall time of this rank's dry run (not in the table)

    def comparison(self, what: str) -> Comparison:
        return next(c for c in self.comparisons if c.what == what)


# ---------------------------------------------------------------------- running one rank


def check_setup(config: GPTConfig, parallel: ParallelConfig, batch: int) -> int:
    """Raise a ValueError naming the problem if one training step of `batch` sequences cannot
    run so (as train would); returns the micro-batches per step."""
    parallel.check(config)
    _, m = split_batch(batch, parallel)
    pipeline_schedule(parallel.schedule, m, parallel.pp, 0, parallel.chunks)
    return m


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


def traffic_summary(tracer: CommTracer) -> tuple[Traffic, ...]:
    """The tracer's summary as Traffic lines, in a fixed order (group, phase, op)."""
    rows = [
        Traffic(g, op, ph, calls, numel, nbytes)
        for (g, op, ph), (calls, numel, nbytes) in tracer.summary().items()
    ]

    def key(t: Traffic) -> tuple:
        g = GROUP_ORDER.index(t.group) if t.group in GROUP_ORDER else len(GROUP_ORDER)
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
    """
    m = check_setup(config, parallel, batch)
    parallel.layout.check_world(dist.get_world_size())
    dense = dense if dense is not None else build_dense(config, device)
    cfg = TrainConfig(batch=batch, dtype=dtype)  # train's defaults: grad_clip 1.0, decay 0.1
    loop_cfg = TrainConfig(batch=batch, steps=1, eval_every=0, progress=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    with attention_as_on_device():
        mesh = Mesh(parallel.layout)
        options = parallel.model_options() | (
            {"cp_group": mesh.cp_group} if parallel.cp > 1 else {}
        )
        # As train's stage_chunks builds this rank's part, on the meta device
        chunks = build_stage_chunks(
            dense, mesh.tp_group, mesh.pp_rank, parallel.pp, parallel.chunks,
            parallel.stage_split, **options,
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
    owners = params  # what holds gradients
    flat, peak_gathered = (), 0
    if isinstance(opt, ShardedDataParallel):
        # The parameters are views into the flat buffers (ZeRO-3: resized to nothing at rest),
        # so their shapes no longer tell the storage: count the whole buffers still held
        # and the fp32 shards AdamW steps; the shards' gradients, and with ZeRO-1 the whole ones.
        owners = params + opt.shards()
        weights = opt.gathered_bytes() + sum(s.numel() * s.element_size() for s in opt.shards())
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
    grads = [p.grad for p in owners if p.grad is not None]
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
        gradients=sum(g.numel() * g.element_size() for g in grads),
        optimizer=opt_bytes,
        optimizer_steps=opt_other,
        optimizer_params=opt_params,
        optimizer_tensors=opt_tensors,
        activations=peak,
        in_flight=len(held),
        layer_forwards=sum(len(chunks[c].blocks) for _, c in held),
        held_embedding=sum(1 for _, c in held if c == 0 and chunks[0].first),
        held_head=sum(1 for _, c in held if c == len(chunks) - 1 and chunks[-1].last),
        act_embedding=parts[0],
        act_layers=parts[1],
        act_head=parts[2],
        act_per_layer=windows.per_layer,
        traffic=traffic_summary(tracer),
        flat_buffers=flat,
        peak_gathered=peak_gathered,
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


def default_ranks(parallel: ParallelConfig) -> list[int]:
    """The fullest ranks: rank 0 (embedding, most micro-batches in flight) and the first rank
    of the last stage (final norm, LM head, loss), or only rank 0 without a pipeline."""
    last = parallel.layout.rank(0, parallel.pp - 1, 0)
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
    """Each rank in turn on a fresh fake world; many ranks (--rank all) over forked workers,
    one per core (each about a second at full size: the meta kernels are Python)."""
    start = time.perf_counter()
    _POOL.update(
        config=config, parallel=parallel, batch=batch, dense=build_dense(config), dtype=dtype
    )
    built = time.perf_counter() - start  # once: every rank slices the same meta tensors
    try:
        workers = min(len(ranks), mp.cpu_count())
        if workers > 1 and len(ranks) > 2:
            with mp.get_context("fork").Pool(workers, torch.set_num_threads, (1,)) as pool:
                out = pool.map(_dry_run_one, ranks, chunksize=1)
        else:
            out = [_dry_run_one(r) for r in ranks]
    finally:
        _POOL.clear()
    if out:  # the shared model's build, charged to the first rank
        out[0] = dataclasses.replace(out[0], seconds=out[0].seconds + built)
    return out


# ------------------------------------------------------------------------ the predictions


def _shape(config: GPTConfig, micro_batch: int) -> tuple[ModelShape | None, str]:
    """The ledger's ModelShape, or None and why not."""
    try:
        shape = ModelShape.from_config(config, micro_batch=micro_batch)
    except ValueError as e:
        return None, str(e)
    return shape, ""


def _param_terms(fig: RankFigures, config: GPTConfig, parallel: ParallelConfig) -> list[Term]:
    """Parameters: this rank's composition against the ledger's (stage 0; see `ledger`)."""
    c, tp, pp = config, parallel.tp, parallel.pp
    h = c.hidden
    sharded, replicated = layer_params(h, c.ffn, c.kv_heads * h // c.n_heads, c.bias)
    ledger_block = sharded // tp + replicated
    ledger_blocks = math.ceil(c.n_layers / pp)
    rows = padded_vocab(c.vocab_size, tp) // tp  # the ledger's ceil(V/t)
    table = _table_rows(c, tp)
    positions = c.seq_len * h if c.position == "learned" else 0
    final_norm = 2 * h if (c.bias and c.norm == "layernorm") else h
    terms = []
    if fig.blocks != ledger_blocks:
        terms.append(
            Term(
                f"{_n(fig.blocks, 'block')} here; the ledger counts ceil(L/pp) = {ledger_blocks}",
                (fig.blocks - ledger_blocks) * ledger_block,
            )
        )
    if not fig.first:
        terms.append(
            Term(
                "no embedding or positions on this stage (the ledger's is stage 0)",
                -(rows * h + positions),
            )
        )
    elif table != rows:
        terms.append(
            Term(f"replicated embedding: {table:,} rows, the ledger's {rows:,}", (table - rows) * h)
        )
    head = 0
    if fig.last and (not c.tie_embeddings or not fig.first):
        head = table * h
    ledger_head = 0 if (pp > 1 or c.tie_embeddings) else rows * h
    if head != ledger_head:
        what = (
            "an untied LM head" if not c.tie_embeddings else "the tied table's copy as the LM head"
        )
        terms.append(Term(f"{what} [{table:,}, {h}] on the last stage", head - ledger_head))
    if fig.last and pp > 1:
        terms.append(Term("the final norm on the last stage", final_norm))
    return terms


def _layer_terms(
    config: GPTConfig, parallel: ParallelConfig, micro: int, dtype: str = "fp32"
) -> list[tuple[str, float]]:
    """tpedu's bytes per block and micro-batch minus Korthikanti et al.'s (16-bit values,
    1-byte masks), by cause, for the GPT-2 block this dry run trains (dropout 0, flash
    attention; fp32, or bf16 autocast: the matmuls' values in 2 bytes as the paper's, the
    residual stream in 4). Sums to (tpedu - paper) per layer; see the module docstring."""
    c, t, sp, rc = config, parallel.tp, parallel.sequence_parallel, parallel.recompute
    low = dtype != "fp32"
    s, b, h, a = c.seq_len, micro, c.hidden, c.n_heads
    e = _value_bytes(dtype)
    rep = t if sp else 1
    sbh = s * b * h
    paper = activation_bytes_per_layer(s, b, h, a, t, sp, rc)
    if rc == "full":  # the block's input only: the residual stream, fp32 under autocast too
        return [("4-byte values (fp32), the paper's 2", paper)]
    masks = 2 * sbh / rep + (a * s * s * b / t if rc == "none" else 0.0)  # 1-byte masks
    values = paper - masks
    d, nq = h // a, a // t
    nkv = c.kv_heads // t if t <= c.kv_heads else 1
    out = [("no dropout masks (dropout 0)", -masks)]
    if not low:
        out.append(("4-byte values (fp32), the paper's 2", values))
    else:
        out.append(
            (
                "the 2 norms' inputs in fp32, the paper's 2 bytes: autocast leaves the "
                "residual stream fp32",
                2 * sbh / rep * 2,
            )
        )
        if sp:
            out.append(
                (
                    "sequence parallelism: QKV and fc1 keep their input's shard, the norm's "
                    "fp32 output, the paper's 2 bytes",
                    2 * sbh / t * 2,
                )
            )
    # context parallelism: the core is ring attention or Ulysses' (all-to-alls around flash)
    ring = parallel.cp > 1 and parallel.cp_strategy == "ring"
    ulysses = parallel.cp > 1 and not ring
    # flash keeps its logsumexp in fp32; ring attention in the compute dtype
    lse_dtype, lse_bytes = ("bf16", 2) if (ring and low) else ("fp32", 4)
    if rc == "none":
        out.append(
            ("flash attention keeps no [b, a/t, s, s] probabilities", -2 * a * s * s * b / t * e)
        )
        who = "ring attention's" if ring else "flash attention's"
        out.append((f"{who} logsumexp [b, a/t, s] ({lse_dtype})", b * nq * s * lse_bytes))
    out.append(("LayerNorm mean and 1/std (2 norms)", 2 * 2 * b * s / rep * 4))
    if parallel.cp > 1 and rc == "selective":  # recompute_core is the single-rank core's
        who = "ring attention's" if ring else "Ulysses' flash attention's"
        out.append(
            (
                f"CP: the core is not recomputed, {who} logsumexp [b, a/t, s] ({lse_dtype})",
                b * nq * s * lse_bytes,
            )
        )
    if ulysses:
        out.append(
            (
                "Ulysses: the core's output [b, a/(t·cp), s·cp, d] apart from the "
                "out-projection's input, and 2 int64 position orders [s·cp]",
                b * s * nq * d * e + 2 * 8 * s * parallel.cp,
            )
        )
    # GQA: flash attention saves K, V repeated (and the QKV output), ring attention K, V with
    # their KV heads, Ulysses K, V repeated after its all-to-alls (not the QKV output): exact
    if nq != nkv and rc == "none" and not parallel.cp > 1:
        out.append(
            (
                "GQA: K, V repeated to the q heads; the QKV output keeps the originals",
                2 * nkv * d * b * s * e,
            )
        )
    elif nq != nkv and not ulysses:
        out.append(("GQA: K, V saved with their n_kv heads", -2 * (nq - nkv) * d * b * s * e))
    if c.ffn != 4 * h:
        out.append((f"MLP width {c.ffn}, the paper's 4h", 2 * b * s * (c.ffn - 4 * h) / t * e))
    return out


def _value_bytes(dtype: str) -> int:
    """Bytes of a value the matmuls make: 2 under bf16 autocast, else fp32's 4."""
    return 2 if dtype != "fp32" else VALUE_BYTES


def _table_rows(config: GPTConfig, t: int) -> int:
    """Rows of the embedding table (and of a tied head) on one of t TP ranks."""
    return padded_vocab(config.vocab_size, t) // t if config.vocab_parallel else config.vocab_size


def _embedding_saved(config: GPTConfig, parallel: ParallelConfig, micro: int) -> tuple[str, int]:
    """(what, bytes) the embedding saves for backward per micro-batch (dropout 0): its token
    ids (int64; vocab-parallel: the local ids and the foreign-id mask) and the position ids
    (this rank's s/t with sequence parallelism)."""
    b, s = micro, config.seq_len
    rep = parallel.tp if parallel.sequence_parallel else 1
    total, what = 8 * b * s, ["token ids"]
    if config.vocab_parallel:
        total += b * s
        what.append("foreign-id mask")
    if config.position == "learned":
        total += 8 * s // rep
        what.append("position ids")
    return "embedding: " + ", ".join(what), total


def _head_saved(
    config: GPTConfig, parallel: ParallelConfig, micro: int, dtype: str = "fp32"
) -> tuple[str, int]:
    """(what, bytes) the final norm, the LM head and the loss save per micro-batch: the norm's
    (fp32) input and statistics, the head's input (with sequence parallelism: its fp32 shard,
    gathered again in backward; a replicated head: the gathered input; under bf16 autocast
    the others are the matmul's bf16 copy), then the vocab-parallel loss's fp32 softmax
    [b, s, Vp/t], local targets (int64), two masks and the token count, or F.cross_entropy's
    log-softmax [b·s, V], targets and total weight (fp32 under autocast too)."""
    c, t, sp = config, parallel.tp, parallel.sequence_parallel
    e = _value_bytes(dtype)  # the head matmul's input, as autocast casts it
    b, s, h = micro, c.seq_len, c.hidden
    rep = t if sp else 1
    norm = b * s // rep * h * VALUE_BYTES + 2 * b * s // rep * 4
    if c.vocab_parallel:
        head_input = b * s // rep * h * (VALUE_BYTES if sp else e)
        loss = b * s * (padded_vocab(c.vocab_size, t) // t) * 4 + 8 * b * s + 2 * b * s + 8
        return "final norm, LM head, vocab-parallel loss", norm + head_input + loss
    loss = b * s * c.vocab_size * 4 + 8 * b * s + 4
    return "final norm, replicated LM head, cross-entropy", norm + b * s * h * e + loss


def _weight_copies(config: GPTConfig, parallel: ParallelConfig, fig: RankFigures) -> int:
    """Bytes of the bf16 weight copies autocast makes and caches for the step (once, whatever
    the micro-batches) that backward keeps: those of every block matmul that F.linear runs
    (not the recomputed ones, nor sequence parallelism's QKV and fc1, whose all-gather
    function keeps the fp32 weight), and the head's (not under sequence parallelism with a
    vocab-parallel head)."""
    c, t, sp = config, parallel.tp, parallel.sequence_parallel
    h, d = c.hidden, c.hidden // c.n_heads
    nq, nkv = c.n_heads // t, (c.kv_heads // t if t <= c.kv_heads else 1)
    ffn = c.ffn // t
    column = (nq + 2 * nkv) * d * h + (2 if c.activation == "swiglu" else 1) * ffn * h
    row = h * nq * d + h * ffn
    block = 0 if parallel.recompute == "full" else row + (0 if sp else column)
    head = 0
    if fig.last:
        head = 0 if (sp and c.vocab_parallel) else _table_rows(c, t) * h
    return 2 * (fig.blocks * block + head)


def _local(config: GPTConfig, parallel: ParallelConfig) -> GPTConfig:
    """The config at this rank's s/cp positions (context parallelism), for the formulas that
    count per position."""
    if parallel.cp == 1:
        return config
    return dataclasses.replace(config, seq_len=config.seq_len // parallel.cp)


def _activation_comparison(
    fig: RankFigures, config: GPTConfig, parallel: ParallelConfig, predicted: float
) -> Comparison:
    """The ledger's activations (at s/cp positions with context parallelism) against the
    measured peak."""
    c, pp = _local(config, parallel), parallel.pp
    paper = activation_bytes_per_layer(
        c.seq_len,
        fig.micro_batch,
        c.hidden,
        c.n_heads,
        parallel.tp,
        parallel.sequence_parallel,
        parallel.recompute,
    )
    ledger_forwards = math.ceil(c.n_layers / pp) * pp
    m = fig.layer_forwards
    terms = [
        Term(
            f"block forwards held at the peak: {_n(fig.in_flight, 'micro-batch')}, {m} in all; "
            f"the ledger: pp·ceil(L/pp) = {ledger_forwards}",
            paper * (m - ledger_forwards),
        )
    ]
    if c.dropout:  # masks and the explicit attention path: measured, not modelled here
        terms.append(
            Term(
                f"tpedu's saved tensors with dropout {c.dropout:g} (not itemised)",
                fig.activations - predicted - terms[0].value,
            )
        )
        return Comparison("activations (peak)", fig.activations, predicted, "ledger", tuple(terms))
    terms += [
        Term(f"per block: {name}", value * m)
        for name, value in _layer_terms(c, parallel, fig.micro_batch, fig.dtype)
    ]
    for held, (name, value) in (
        (fig.held_embedding, _embedding_saved(c, parallel, fig.micro_batch)),
        (fig.held_head, _head_saved(c, parallel, fig.micro_batch, fig.dtype)),
    ):
        if held:
            terms.append(Term(f"{name} × {held} (the ledger leaves them out)", value * held))
    if fig.dtype != "fp32" and fig.in_flight:
        terms.append(
            Term(
                "autocast's bf16 copies of the matmul weights, cast once and kept for the step",
                _weight_copies(config, parallel, fig),
            )
        )
    ring = parallel.cp_strategy == "ring"
    if parallel.cp > 1 and (ring or parallel.recompute == "full") and fig.in_flight:
        # TPGPT computes them once per forward; every block saves the same tensor
        who = "ring attention" if ring else "each checkpointed block"
        terms.append(
            Term(
                f"CP: the global positions [cp, s/cp] (int64) {who} keeps, once per "
                f"model-chunk forward × {fig.in_flight}",
                8 * config.seq_len * fig.in_flight,
            )
        )
    return Comparison("activations (peak)", fig.activations, predicted, "ledger", tuple(terms))


def _padding_term(fig: RankFigures, dp: int) -> Term | None:
    """ZeRO: the elements each flat buffer adds to reach a multiple of N = dp (at most N-1
    per buffer), as a parameter count; None without flat buffers or padding."""
    pad = sum(dp * n - elements for elements, n, *_ in fig.flat_buffers)
    if not pad:
        return None
    return Term(
        f"flat buffers padded to a multiple of N = {dp}: {pad:,} elements over "
        f"{_n(len(fig.flat_buffers), 'buffer')}",
        pad,
    )


def _gathered_comparison(
    fig: RankFigures, parallel: ParallelConfig, whole: float, terms: list[Term]
) -> Comparison:
    """The most bytes of whole parameters held at once during the step. ZeRO-1/2: all of them,
    always (the ledger's undivided weights, `whole`, plus `terms`: the parameter and padding
    terms). ZeRO-3: the ledger counts none; what is held is each chunk's rest (gathered at
    its first forward, kept until the step) and, of the blocks, the one running and the
    neighbour whose all-gather was started early (prefetch), at most two adjacent ones."""
    what = "whole parameters (peak)"
    if parallel.zero < 3:
        return Comparison(what, fig.peak_gathered, whole, "ledger", tuple(terms))
    e, dp = VALUE_BYTES, parallel.dp
    rest = sum(dp * n for _, n, _, block in fig.flat_buffers if block < 0) * e
    blocks: dict[tuple[int, int], int] = {}
    for _, n, chunk, block in fig.flat_buffers:
        if block >= 0:
            blocks[chunk, block] = blocks.get((chunk, block), 0) + dp * n * e
    pairs = [blocks[k] + blocks.get((k[0], k[1] + 1), 0) for k in blocks]
    return Comparison(
        what,
        fig.peak_gathered,
        0.0,
        "ledger",
        (
            Term("ZeRO-3: every chunk's rest (embedding, final norm, head), kept gathered", rest),
            Term(
                "ZeRO-3: the largest two adjacent blocks: one running, the next prefetched",
                max(pairs, default=0),
            ),
        ),
    )


def _memory_comparisons(
    fig: RankFigures, config: GPTConfig, parallel: ParallelConfig
) -> list[Comparison]:
    shape, why = _shape(config, fig.micro_batch)
    measured = [
        ("parameters", fig.params),
        ("weights", fig.weights),
        ("gradients", fig.gradients),
        ("optimizer states", fig.optimizer + fig.optimizer_steps),
        ("activations (peak)", fig.activations),
    ]
    if parallel.zero:
        measured.insert(4, ("whole parameters (peak)", fig.peak_gathered))
    if shape is None:
        return [Comparison(w, v, None, "ledger", note=why) for w, v in measured]
    dp, zero = parallel.dp, parallel.zero

    def ledger_of(shape: ModelShape) -> Ledger:  # as this rank runs: fp32 states, its layout
        return ledger(
            shape,
            parallel.tp,
            parallel.pp,
            dp,
            parallel.sequence_parallel,
            parallel.recompute,
            weight_bytes=VALUE_BYTES,
            grad_bytes=VALUE_BYTES,
            optimizer_bytes=ADAMW_BYTES,
            zero=zero,
        )

    try:
        led = ledger_of(shape)
    except ValueError as e:  # e.g. KV heads replicated (tp > KV heads): the ledger refuses
        return [Comparison(w, v, None, "ledger", note=str(e)) for w, v in measured]
    params = _param_terms(fig, config, parallel)
    pad = _padding_term(fig, dp)

    def scaled(per_param: float, divisor: int) -> list[Term]:
        """The parameter terms (and ZeRO's padding) at `per_param` bytes, 1/divisor."""
        terms = params + ([pad] if pad else [])
        return [Term(t.name, t.value * per_param / divisor) for t in terms]

    w_div, g_div, o_div = (dp if zero >= k else 1 for k in (3, 2, 1))
    weights = scaled(VALUE_BYTES, w_div)
    shard = sum(n for _, n, *_ in fig.flat_buffers)
    if zero in (1, 2):
        weights.append(
            Term(
                f"ZeRO-{zero}: the fp32 shards AdamW steps ({shard:,} elements), apart from the "
                "whole parameters they are all-gathered into",
                shard * VALUE_BYTES,
            )
        )
    if zero == 1:  # the whole local gradients (no padding: per parameter) and the shards' means
        grads = [Term(t.name, t.value * VALUE_BYTES) for t in params]
        grads.append(
            Term(
                f"ZeRO-1: the DP mean of this rank's shards ({shard:,} elements, shard.grad), "
                "beside the whole local gradients it keeps",
                shard * VALUE_BYTES,
            )
        )
    else:
        grads = scaled(VALUE_BYTES, g_div)
    out = [
        Comparison("parameters", fig.params, led.params, "ledger", tuple(params)),
        Comparison("weights", fig.weights, led.weights, "ledger", tuple(weights)),
        Comparison("gradients", fig.gradients, led.gradients, "ledger", tuple(grads)),
    ]
    opt = scaled(ADAMW_BYTES, o_div)
    per = "one per flat buffer's shard" if zero else "one per tensor"
    opt.append(
        Term(
            f"AdamW's step counters: {fig.optimizer_tensors} fp32 scalars ({per})",
            4 * fig.optimizer_tensors,
        )
    )
    out.append(
        Comparison(
            "optimizer states",
            fig.optimizer + fig.optimizer_steps,
            led.optimizer,
            "ledger",
            tuple(opt),
        )
    )
    if zero:
        out.append(_gathered_comparison(fig, parallel, led.weights, scaled(VALUE_BYTES, 1)))
    if parallel.cp > 1:  # the activations are those of this rank's s/cp positions
        local = dataclasses.replace(shape, seq_len=config.seq_len // parallel.cp)
        led_act = ledger_of(local).activations
    else:
        led_act = led.activations
    out.append(_activation_comparison(fig, config, parallel, led_act))
    return out


def _sp_params(config: GPTConfig, fig: RankFigures) -> int:
    """Elements of the parameters sequence parallelism marks (their gradients are all-reduced
    over the TP group after backward): both norms and the row-parallel biases of each block,
    plus the positions (first stage) and the final norm (last stage)."""
    h = config.hidden
    norm = 2 * h if (config.bias and config.norm == "layernorm") else h
    block = 2 * norm + (2 * h if config.bias else 0)
    total = fig.blocks * block
    if fig.first and config.position == "learned":
        total += config.seq_len * h
    if fig.last:
        total += norm
    return total


def _traffic_comparisons(
    fig: RankFigures, config: GPTConfig, parallel: ParallelConfig, batch: int
) -> list[Comparison]:
    c, tp, pp, dp, v = config, parallel.tp, parallel.pp, parallel.dp, parallel.chunks
    sp, e, m = parallel.sequence_parallel, VALUE_BYTES, fig.micro_batches
    shape, why = _shape(config, fig.micro_batch)
    cp = parallel.cp
    groups = ["tp", "pp", "dp", "emb"] + (["cp"] if cp > 1 else []) + ["world"]
    measured = {g: fig.sent(g) for g in groups}
    if shape is None or c.n_layers % (pp * v):
        note = why or f"the what-if needs L divisible by pp·chunks ({c.n_layers}, {pp}·{v})"
        return [
            Comparison(f"{g} traffic", measured[g], None, "what-if", note=note)
            for g in groups
            if measured[g]
        ]
    par = whatif.Parallel(
        tp=tp,
        pp=pp,
        dp=dp,
        batch=batch,
        micro=fig.micro_batch,
        chunks=v,
        recompute=parallel.recompute == "full",
    )
    c = _local(config, parallel)  # with CP every message holds this rank's s/cp positions
    vol = whatif.volumes(dataclasses.replace(shape, seq_len=c.seq_len), par, e)
    msg = vol.message_bytes  # one [b, s, h] message at 4 bytes per value
    out = []

    # TP: the blocks' all-reduces (or SP's all-gather / reduce-scatter pairs: the same bytes)
    terms = []
    per_stage = c.n_layers // pp
    if fig.blocks != per_stage:  # --stage-split flops
        terms.append(
            Term(
                f"{_n(fig.blocks, 'block')} here, the what-if's L/pp = {per_stage}",
                vol.tp_all_reduces * msg * (fig.blocks / per_stage - 1),
            )
        )
    blocks_msgs = m * fig.blocks * msg  # one [b, s, h] message per block and micro-batch
    passes = 6 if parallel.recompute == "full" else 4
    if sp:
        terms.append(
            Term(
                "sequence parallelism: each all-reduce is a reduce-scatter plus an all-gather "
                "(2 calls of [b, s, h], the same bytes on the wire)",
                passes * blocks_msgs,
            )
        )
        terms.append(
            Term(
                "sequence parallelism: QKV and fc1 keep only their input's shard and "
                "all-gather it again in backward (2 per block)",
                2 * blocks_msgs,
            )
        )
    if parallel.recompute == "full":
        op = "reduce-scatter" if sp else "all-reduce"
        terms.append(
            Term(
                f"full recompute: PyTorch's checkpoint stops at the last tensor backward needs, "
                f"so the MLP's output {op} is not rerun (1 per block)",
                -blocks_msgs,
            )
        )
    if fig.dtype != "fp32":  # the row-parallel matmuls' outputs, and their gradients, in bf16
        full = parallel.recompute == "full"
        if sp:
            what = (
                "bf16 autocast: the blocks' reduce-scatters of the row-parallel outputs (2 per "
                "block" + (", 1 more recomputed" if full else "") + "), the all-gathers of "
                "their gradients (2) and the reduce-scatters of QKV's and fc1's input "
                "gradients (2) in 2 bytes, the what-if's 4"
            )
            halved = (6 + full) * blocks_msgs / 2
            if fig.last and c.vocab_parallel:
                what += "; and the LM head's input gradient's (1 per micro-batch)"
                halved += m * msg / 2
        else:
            what = (
                "bf16 autocast: the blocks' all-reduces of the row-parallel outputs (2 per "
                "block" + (", 1 more recomputed" if full else "") + ") in 2 bytes, the "
                "what-if's 4; the backward ones carry fp32 gradients"
            )
            halved = (2 + full) * blocks_msgs / 2
        terms.append(Term(what, -halved))
    vp = c.vocab_parallel
    if fig.first:
        calls = (2 if sp else 1) if vp else (1 if sp else 0)
        if calls:
            how = "vocab-parallel" if vp else "replicated"
            terms.append(Term(f"{how} embedding: {calls} per micro-batch", calls * m * msg))
    if fig.last:
        calls = (3 if sp else 1) if vp else (1 if sp else 0)
        if calls:
            terms.append(Term(f"LM head's input: {calls} per micro-batch", calls * m * msg))
        if vp:
            terms.append(
                Term(
                    "vocab-parallel loss: 3 all-reduces of [b, s] per micro-batch",
                    3 * m * fig.micro_batch * c.seq_len * 4,
                )
            )
    if tp > c.kv_heads:
        d = c.hidden // c.n_heads
        per = c.kv_heads * 2 * d * (c.hidden + (1 if c.bias else 0)) * e
        terms.append(
            Term("replicated KV heads' gradients: 1 all-reduce per block", fig.blocks * per)
        )
    if sp:
        terms.append(
            Term(
                "sequence-parallel parameters' gradients: 1 all-reduce per chunk",
                _sp_params(c, fig) * e,
            )
        )
    terms.append(Term("gradient norm: 1 float64 all-reduce", 8))
    tp_traffic = Comparison(
        "tp traffic", measured["tp"], vol.tp_all_reduces * msg, "what-if", tuple(terms)
    )
    out.append(tp_traffic)
    if cp > 1:
        out.append(_cp_comparison(fig, config, parallel, measured["cp"]))

    # PP: activations forward, their gradients back; the what-if prices 2 sends per
    # micro-batch and chunk of a [b, s, h] message
    sends = sum(m for cc in range(v) if cc * pp + fig.coords[1] != pp * v - 1)  # forward
    sends += sum(m for cc in range(v) if cc * pp + fig.coords[1] != 0)  # backward
    pp_terms = []
    if pp > 1:
        if sends != vol.pp_sends:
            pp_terms.append(
                Term(
                    f"{_n(sends, 'send')} here, the what-if's {vol.pp_sends}: "
                    + (
                        "the first stage sends no gradient back"
                        if fig.coords[1] == 0
                        else "the last stage sends no activation on"
                    ),
                    (sends - vol.pp_sends) * msg,
                )
            )
        if sp:
            pp_terms.append(
                Term(
                    f"sequence parallelism: messages are [b, s/{tp}, h]", sends * msg * (1 / tp - 1)
                )
            )
        pp_terms.append(
            Term(
                "the receives of as many messages (the what-if prices the sends)",
                sends * msg / (tp if sp else 1),
            )
        )
    pp_terms.append(Term("gradient norm: 1 float64 all-reduce", 8))
    out.append(
        Comparison("pp traffic", measured["pp"], vol.pp_sends * msg, "what-if", tuple(pp_terms))
    )

    # DP: one all-reduce of this rank's gradients (buckets), or ZeRO's reduce-scatters and
    # all-gathers (which run over a DP group of 1 too, as train runs them)
    dp_terms = []
    predicted = vol.dp_bytes if dp > 1 else 0.0
    if dp > 1 or parallel.zero:
        dp_terms.append(
            Term(
                f"this rank's {fig.params:,} parameters, not the what-if's "
                + (
                    f"N/(tp·pp) = {shape.matmul_params / (tp * pp):,.0f} (matmul weights, "
                    "averaged over stages)"
                    if dp > 1
                    else "0 (no replicas)"
                ),
                fig.params * e - predicted,
            )
        )
    if parallel.zero:
        dp_terms += _sharded_traffic_terms(fig, parallel)
    out.append(Comparison("dp traffic", measured["dp"], predicted, "what-if", tuple(dp_terms)))

    emb_terms = []
    if pp > 1 and c.tie_embeddings and (fig.first or fig.last):
        emb_terms.append(
            Term(
                "tied embedding: the two copies' gradients summed",
                _table_rows(c, tp) * c.hidden * e,
            )
        )
    out.append(Comparison("emb traffic", measured["emb"], 0.0, "what-if", tuple(emb_terms)))
    out.append(
        Comparison(
            "world traffic",
            measured["world"],
            0.0,
            "what-if",
            (Term("the loop's loss average over replicas (1 float64)", 8), STOP_CHECK),
        )
    )
    return out


def _sharded_traffic_terms(fig: RankFigures, parallel: ParallelConfig) -> list[Term]:
    """ZeRO's DP calls beyond one all-reduce of this rank's parameters (which the
    reduce-scatter of the gradients replaces, the same bytes in): the padding, the parameters'
    all-gathers, the gradient norm's share over DP."""
    dp, m, e = parallel.dp, fig.micro_batches, VALUE_BYTES
    terms = []
    pad = _padding_term(fig, dp)
    if pad:
        terms.append(Term(pad.name + " (in the reduce-scatter)", pad.value * e))
    padded = sum(dp * n for _, n, *_ in fig.flat_buffers)
    if parallel.zero < 3:
        terms.append(
            Term(
                f"ZeRO-{parallel.zero}: every buffer all-gathered from the new shards after the "
                "step",
                padded * e,
            )
        )
    else:
        blocks = sum(dp * n for _, n, _, block in fig.flat_buffers if block >= 0)
        terms += [
            Term(
                f"ZeRO-3: every block's buffers all-gathered before its forward "
                f"({m} per block: one per micro-batch)",
                m * blocks * e,
            ),
            Term(
                f"ZeRO-3: ... and again before each backward ({m} per block, what plain DP "
                "does not send: (N-1)/N·Ψ_blocks per micro-batch on the wire)",
                m * blocks * e,
            ),
            Term(
                "ZeRO-3: the chunks' rest (embedding, final norm, head) all-gathered once, at "
                "the first forward, and kept until the step",
                (padded - blocks) * e,
            ),
        ]
    terms.append(Term("gradient norm: 1 float64 all-reduce (each rank holds 1/N of it)", 8))
    return terms


def _cp_comparison(
    fig: RankFigures, config: GPTConfig, parallel: ParallelConfig, measured: int
) -> Comparison:
    """CP traffic against tpedu.cp.traffic's formulas for every block forward and backward of
    the step (ring: the K/V blocks' sends; Ulysses: its all-to-alls), plus what else the CP
    group carries: the loss's mean over the whole sequence and the gradients' sum. Under bf16
    autocast the K/V blocks (Ulysses: q, k, v and the output) are the QKV matmul's bf16."""
    c, t, cp, m = config, parallel.tp, parallel.cp, fig.micro_batches
    e = _value_bytes(fig.dtype)  # the attention core's values
    d = c.hidden // c.n_heads
    nkv = c.kv_heads // t if t <= c.kv_heads else 1
    layers = m * fig.blocks  # block forwards (and backwards) in the step
    full = parallel.recompute == "full"
    terms = []
    if parallel.cp_strategy == "ring":
        msgs = ring_messages(fig.micro_batch, nkv, c.seq_len, cp, d, e, layers, full)
        predicted = msgs["forward"][1] + msgs["backward"][1]
        sends = msgs["forward"][0] + msgs["backward"][0]
        terms.append(
            Term(
                f"the receives of the ring's {_n(sends, 'send')} of [b, kv_heads/tp, s/cp, d] "
                f"({2 * (cp - 1)} per block forward, {4 * cp - 2} backward"
                + (f", {2 * (cp - 1)} more recomputing" if full else "")
                + "; tpedu.cp.traffic counts the sends)",
                predicted,
            )
        )
    else:
        msgs = ulysses_messages(fig.micro_batch, c.n_heads // t, nkv, c.seq_len, cp, d, e, layers)
        predicted = msgs["forward"][1] + msgs["backward"][1]
        if full:
            terms.append(
                Term(
                    "full recompute: the forward's all-to-alls run again in backward",
                    msgs["forward"][1],
                )
            )
    if fig.last:
        terms.append(
            Term(
                "the loss's mean over the whole sequence: the token count (int64) and the loss "
                "(fp32), 1 all-reduce each per micro-batch",
                12 * m,
            )
        )
    terms.append(
        Term(
            f"every gradient summed over CP: this rank's {fig.params:,} parameters "
            f"(1 all-reduce per tensor)",
            fig.params * VALUE_BYTES,
        )
    )
    return Comparison("cp traffic", measured, predicted, "what-if", tuple(terms))


def compare(
    fig: RankFigures, config: GPTConfig, parallel: ParallelConfig, batch: int
) -> tuple[Comparison, ...]:
    """Every figure of `fig` beside the ledger's or the what-if's prediction, with the named
    differences (see the module docstring)."""
    return tuple(
        _memory_comparisons(fig, config, parallel)
        + _traffic_comparisons(fig, config, parallel, batch)
    )


# ------------------------------------------------------------------------------ the table


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 'es' if noun.endswith('h') else 's'}"


def _fmt(x: float) -> str:
    return f"{x:,.0f}"


def format_table(run: DryRun) -> str:
    """The dry run of one rank as fixed-width text (deterministic: no timings)."""
    f, c, par = run.figures, run.config, run.parallel
    t, p, d = f.coords
    lay = par.layout
    blocks = ", ".join(f"{a}-{b - 1}" if b - a > 1 else f"{a}" for a, b in f.chunks)
    holds = (
        [f"block{'s' if f.blocks > 1 else ''} {blocks}"]
        + (["embedding"] if f.first else [])
        + (["final norm, head, loss"] if f.last else [])
    )
    shape, _ = _shape(c, f.micro_batch)
    arch = "llama" if c.activation == "swiglu" else "gpt2"
    n = shape.n_params if shape else 0
    size = f", {n / 1e9:.2f}B parameters" if n >= 1e8 else f", {n:,} parameters" if n else ""
    lines = [
        f"dry run: rank {f.rank} of {f.world} (tp {t}/{lay.tp}, pp {p}/{lay.pp}, dp {d}/{lay.dp}"
        + (f", cp {lay.cp_rank(f.rank)}/{lay.cp}" if lay.cp > 1 else "")
        + f"); holds {'; '.join(holds)}",
        f"model: {arch}, {c.n_layers} layers, hidden {c.hidden}, {c.n_heads} heads"
        + (f" ({c.kv_heads} KV)" if c.kv_heads != c.n_heads else "")
        + f", vocab {c.vocab_size:,}, seq {c.seq_len}{size}",
        f"step: batch {run.batch}, {_n(f.micro_batches, 'micro-batch')} of "
        f"{_n(f.micro_batch, 'sequence')} per replica"
        + (
            f", {par.schedule}" + (f" x{par.chunks} chunks" if par.chunks > 1 else "")
            if par.pp > 1
            else ""
        )
        + (", sequence parallel" if par.sequence_parallel else "")
        + (
            f", context parallel ({par.cp_strategy}, {par.cp_layout}): s/cp = "
            f"{c.seq_len // par.cp} positions per rank"
            if par.cp > 1
            else ""
        )
        + (f", recompute {par.recompute}" if par.recompute != "none" else "")
        + (f", ZeRO-{par.zero}" if par.zero else "")
        + ("; bf16 autocast" if f.dtype != "fp32" else "")
        + "; fp32 weights, AdamW, dropout "
        + f"{c.dropout:g}",
        "",
        f"{'memory on this rank':<28}{'measured':>18}{'ledger':>18}{'measured GB':>13}",
        "-" * 77,
    ]
    memory = [comp for comp in run.comparisons if comp.source == "ledger"]
    traffic = [comp for comp in run.comparisons if comp.source == "what-if"]
    for comp in memory:
        pred = _fmt(comp.predicted) if comp.predicted is not None else "n/a"
        gb = f"{comp.measured / GB:>13.3f}" if comp.what != "parameters" else f"{'':>13}"
        lines.append(f"{comp.what:<28}{_fmt(comp.measured):>18}{pred:>18}{gb}")
    lines.append("")
    lines += _differences(memory)
    lines += [
        "",
        f"{'communication, one step':<24}{'phase':<10}{'calls':>7}{'elements':>17}{'bytes':>18}",
        "-" * 76,
    ]
    for tr in f.traffic:
        lines.append(
            f"{tr.group + ' ' + tr.op:<24}{tr.phase:<10}{tr.calls:>7}{tr.elements:>17,}{tr.bytes:>18,}"
        )
    if not f.traffic:
        lines.append("(no collectives)")
    if traffic:
        lines += ["", f"{'bytes per group':<28}{'measured':>18}{'what-if':>18}", "-" * 64]
        for comp in traffic:
            pred = _fmt(comp.predicted) if comp.predicted is not None else "n/a"
            lines.append(f"{comp.what:<28}{_fmt(comp.measured):>18}{pred:>18}")
        lines.append("")
        lines += _differences(traffic)
    return "\n".join(line.rstrip() for line in lines)


def _differences(comps: Sequence[Comparison]) -> list[str]:
    lines = []
    missing = [comp for comp in comps if comp.predicted is None]
    for note in dict.fromkeys(comp.note for comp in missing):  # each reason once
        whats = ", ".join(comp.what for comp in missing if comp.note == note)
        lines.append(f"no {missing[0].source} figure for {whats}: {note}")
    for comp in comps:
        if comp.predicted is None:
            continue
        lines.append(f"{comp.what}: {comp.source} {_fmt(comp.predicted)}")
        for term in comp.terms:
            lines.append(
                f"  {'+' if term.value >= 0 else '-'} {_fmt(abs(term.value)):>16}  {term.name}"
            )
        rest = comp.unexplained
        if abs(rest) >= 0.5:
            lines.append(f"  {'+' if rest >= 0 else '-'} {_fmt(abs(rest)):>16}  UNEXPLAINED")
        lines.append(f"  = {_fmt(comp.measured):>16}  measured")
    return lines


def format_summary(runs: Sequence[DryRun]) -> str:
    """One line per rank (for --rank all): bytes held and sent, and the unexplained remainders."""
    cp = any(run.parallel.cp > 1 for run in runs)  # a cp column only for CP layouts
    head = (
        f"{'rank':>5} {'tp':>3} {'pp':>3} {'dp':>3} {'params':>14} {'weights+grads+opt GB':>21} "
        f"{'acts GB':>8} {'sent MB tp':>11} {'pp':>9} {'dp':>9}"
        + (f" {'cp':>9}" if cp else "")
        + f" {'unexpl.':>8}"
    )
    lines = [head, "-" * len(head)]
    for run in runs:
        f = run.figures
        state = (f.weights + f.gradients + f.optimizer + f.optimizer_steps) / GB
        rest = sum(abs(c.unexplained) for c in run.comparisons)
        lines.append(
            f"{f.rank:>5} {f.coords[0]:>3} {f.coords[1]:>3} {f.coords[2]:>3} {f.params:>14,} "
            f"{state:>21.3f} {f.activations / GB:>8.3f} {f.sent('tp') / 1e6:>11.1f} "
            f"{f.sent('pp') / 1e6:>9.1f} {f.sent('dp') / 1e6:>9.1f}"
            + (f" {f.sent('cp') / 1e6:>9.1f}" if cp else "")
            + f" {rest:>8,.0f}"
        )
    return "\n".join(lines)


__all__ = [
    "Comparison",
    "DryRun",
    "RankFigures",
    "Term",
    "Traffic",
    "attention_as_on_device",
    "build_dense",
    "check_setup",
    "compare",
    "default_ranks",
    "dry_run",
    "fake_world",
    "format_summary",
    "format_table",
    "measure_rank",
    "traffic_summary",
]
