"""Lesson 11: run a pipeline schedule on real ranks: each stage's actions, sends and receives.

`run_schedule` executes this rank's list of actions (tpedu.parallel.pipeline.schedules) on its
model chunks: forwards receive the previous stage's activations and send theirs on, backwards
send the gradient w.r.t. their input back, and it returns the loss and the peak number of
micro-batches in flight. It labels each forward's and backward's compute for the rank clock
(tpedu.comm.recorder: F<micro-batch>, B<micro-batch>, with .<chunk> when a rank has several),
so a recorded step is the pipeline's timeline (tpedu.analysis.clock.events). `Pipe` is this
rank's place in one pipeline (from a tpedu.parallel.mesh.Mesh), `build_stage_chunks` cuts a
DenseGPT into this rank's TPGPT chunks, and `sync_tied_grads` sums the gradients of a tied
embedding's two copies (first and last stage).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from tpedu.comm import collectives, recorder
from tpedu.model.gpt import TPGPT
from tpedu.model.options import RunOptions
from tpedu.parallel.pipeline.schedules import Action, action_parts, stage_layers


@dataclass
class Pipe:
    """This rank's place in one pipeline: stage index, the global ranks of all stages, and the
    groups activations (forward) and gradients (backward) travel on; the interleaved schedule's
    wrap-around edge between the last and the first stage has its own pair (None: the same)."""

    stage: int
    ranks: list[int]
    fwd_group: dist.ProcessGroup | None
    bwd_group: dist.ProcessGroup | None
    wrap_fwd_group: dist.ProcessGroup | None = None
    wrap_bwd_group: dist.ProcessGroup | None = None

    @classmethod
    def from_mesh(cls, mesh) -> Pipe:  # tpedu.parallel.mesh.Mesh (no import cycle)
        g = mesh.groups
        return cls(
            mesh.pp_rank, mesh.members["pp"], g["pp"], g["pp_grad"], g["pp_wrap"], g["pp_grad_wrap"]
        )

    @property
    def stages(self) -> int:
        return len(self.ranks)


def _edge(pipe: Pipe, src: int, dst: int, direction: str) -> dist.ProcessGroup | None:
    """The group of the edge src -> dst (stage indices, taken mod p): the wrap-around group for
    an activation leaving the last stage (to the next chunk on stage 0) or a gradient leaving
    stage 0 (back to the previous chunk on the last stage), else the direction's own group."""
    p = pipe.stages
    if direction == "fwd":
        wraps = src % p == p - 1
        return pipe.wrap_fwd_group if wraps and pipe.wrap_fwd_group else pipe.fwd_group
    wraps = src % p == 0 and dst % p == p - 1
    return pipe.wrap_bwd_group if wraps and pipe.wrap_bwd_group else pipe.bwd_group


class PipelineTimeout(RuntimeError):
    """A stage waited too long for an activation or a gradient (a hang, named precisely)."""


@dataclass
class StepResult:
    """What one pipelined step gave this rank."""

    loss: torch.Tensor | None  # the mean loss over micro-batches (last stage), else None
    peak_in_flight: int = 0


@dataclass(frozen=True)
class StepOptions:
    """How one pipelined step runs beside its data: what training and debugging set, all
    defaulted for a plain step (a lesson calls run_schedule without them)."""

    step: int = 0  # the optimizer step, handed to every chunk (chunk(x, targets, step=))
    no_sync: Callable[[], object] | None = None  # e.g. DataParallel.no_sync
    loss_scale: float = 1.0  # fp16 loss scaling: the last stage's loss times this in backward
    recv_timeout: float | None = None  # seconds a receive waits (None: forever)


def run_schedule(
    chunks: Sequence[nn.Module],
    actions: Sequence[Action],
    pipe: Pipe,
    inputs: Sequence[torch.Tensor] | None,
    targets: Sequence[torch.Tensor] | None,
    hidden_shape: Sequence[int],
    dtype: torch.dtype = torch.float32,
    options: StepOptions = StepOptions(),
) -> StepResult:
    """Run this rank's `actions` on its model `chunks`; backward leaves gradients in .grad.

    chunks[c] is virtual stage c·p + stage: chunk(x, targets, step=) -> hidden [b, s, H], or the
    mean loss on the last virtual stage. inputs[mb] (ids [b, s]) are needed on the first stage,
    targets[mb] on the last; hidden_shape = [b, s, H] of one micro-batch's activations.
    The returned loss is Σ_mb loss_mb / m: the mean over micro-batches, as one big batch gives
    when every micro-batch has the same number of counted tokens.
    `options` (StepOptions) holds the rest: `step` goes to every chunk; `no_sync()` (e.g.
    DataParallel.no_sync) wraps every backward except the last micro-batch's, so gradient
    all-reduces run once, in the last backward; `loss_scale` multiplies the last stage's loss
    before its backward (fp16 loss scaling; the returned loss is unscaled); a receive waiting
    longer than `recv_timeout` seconds raises PipelineTimeout. Without backward actions this is
    a forward-only pass (evaluation: call it under torch.no_grad()).
    Communication per micro-batch and stage boundary: forward 1 send/recv of [b, s, H];
    backward 1 send/recv of its gradient.

    Long because it is one loop over the actions: every send and receive of a step in the order
    they happen, which is what a schedule is (split, the order would be spread over helpers).
    """
    p, s = pipe.stages, pipe.stage
    last_vs = p * len(chunks) - 1
    n_micro = 1 + max(action_parts(a)[1] for a in actions)
    device = next(chunks[0].parameters()).device
    prev_rank, next_rank = pipe.ranks[(s - 1) % p], pipe.ranks[(s + 1) % p]
    sends: list[tuple[dist.Work, torch.Tensor]] = []
    stash: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    loopback: dict[tuple[str, int, int], torch.Tensor] = {}  # p = 1: chunk to chunk, no comm
    total: torch.Tensor | None = None
    peak = 0

    def receive(src: int, group: dist.ProcessGroup | None, what: str) -> torch.Tensor:
        buf = torch.empty(tuple(hidden_shape), dtype=dtype, device=device)
        work = collectives.irecv(buf, src, group)
        try:
            if options.recv_timeout is None:
                work.wait()
            else:
                work.wait(datetime.timedelta(seconds=options.recv_timeout))
        except RuntimeError as e:
            raise PipelineTimeout(
                f"pipeline stage {s} (rank {pipe.ranks[s]}) gave up waiting for {what} from rank "
                f"{src}: the stages' schedules do not match (a send without its receive), or a "
                f"stage before it failed. ({str(e).splitlines()[0][:120]})"
            ) from e
        return buf

    for action in actions:
        kind, mb, c = action_parts(action)
        vs = c * p + s
        if kind == "F":
            if vs == 0:
                x = inputs[mb]
            else:
                x = (
                    loopback.pop(("F", mb, vs))
                    if p == 1
                    else receive(
                        prev_rank,
                        _edge(pipe, s - 1, s, "fwd"),
                        f"the activation of micro-batch {mb}",
                    )
                )
                x.requires_grad_(torch.is_grad_enabled())
            with recorder.label(f"F{mb}" if len(chunks) == 1 else f"F{mb}.{c}"):  # rank clocks
                out = chunks[c](x, targets[mb] if vs == last_vs else None, step=options.step)
            if vs == last_vs:
                out = out / n_micro
                total = out.detach() if total is None else total + out.detach()
            else:
                y = out.detach().to(dtype).contiguous()  # the receiver's buffer dtype
                if p == 1:  # one stage, several chunks: the next virtual stage is on this rank
                    loopback[("F", mb, vs + 1)] = y
                else:
                    group = _edge(pipe, s, s + 1, "fwd")
                    sends.append((collectives.isend(y, next_rank, group), y))
            if torch.is_grad_enabled():
                stash[(mb, c)] = (x, out)
                peak = max(peak, len(stash))
        else:
            x, out = stash.pop((mb, c))
            grad = None
            if vs != last_vs and p == 1:
                grad = loopback.pop(("B", mb, vs))
            elif vs != last_vs:
                group = _edge(pipe, s + 1, s, "bwd")
                grad = receive(next_rank, group, f"the gradient of micro-batch {mb}")
            sync = options.no_sync is None or mb == n_micro - 1
            if vs == last_vs and options.loss_scale != 1.0:
                out = out * options.loss_scale
            with (
                nullcontext() if sync else options.no_sync(),
                recorder.label(f"B{mb}" if len(chunks) == 1 else f"B{mb}.{c}"),
            ):
                torch.autograd.backward(out, grad)
            if vs > 0:
                g = x.grad.contiguous()
                if p == 1:
                    loopback[("B", mb, vs - 1)] = g
                else:
                    sends.append((collectives.isend(g, prev_rank, _edge(pipe, s, s - 1, "bwd")), g))
    for work, _ in sends:
        work.wait()
    return StepResult(total, peak)


def build_stage_chunks(
    dense: nn.Module,
    tp_group: dist.ProcessGroup | None,
    stage: int,
    stages: int,
    chunks: int = 1,
    split: str = "even",
    options: RunOptions | None = None,
) -> list[nn.Module]:
    """This rank's TPGPT chunks: chunk c holds the layers of virtual stage c·stages + stage
    (`stage_layers(..., split)`); `options`: TPGPT's, e.g. `ParallelConfig.model_options()`."""
    parts = stage_layers(dense.config, stages * chunks, split)
    return [TPGPT(dense, tp_group, parts[c * stages + stage], options) for c in range(chunks)]


def tied_params(chunks: Sequence[nn.Module]) -> list[nn.Parameter]:
    """This rank's copies of a tied embedding split over stages: the first stage's table and/or
    the last stage's head ([] when untied, or when one chunk holds both ends)."""
    first = next((m for m in chunks if m.first and not m.last), None)
    last = next((m for m in chunks if m.last and not m.first), None)
    if not chunks[0].config.tie_embeddings:
        return []
    return [m.tok_emb.weight for m in (first,) if m] + [m.lm_head.weight for m in (last,) if m]


def sync_tied_grads(chunks: Sequence[nn.Module], emb_group: dist.ProcessGroup | None) -> None:
    """Sum the gradients of the tied embedding's two copies (first stage's table, last stage's
    head). Both on this rank (one stage, several chunks): added locally; else 1 all-reduce over
    the emb group ([first stage, last stage]) of the table (its vocab shard). No-op if untied."""
    params = tied_params(chunks)
    if not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if len(params) == 2:
        total = params[0].grad + params[1].grad
        params[0].grad.copy_(total)
        params[1].grad.copy_(total)
    else:
        collectives.all_reduce(params[0].grad, emb_group)
