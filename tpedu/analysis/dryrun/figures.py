"""Lesson 13: what a dry run measures on one rank (RankFigures), and how a figure is set
beside its prediction (Comparison: the prediction plus named Terms equals the measurement).
"""

from __future__ import annotations

from dataclasses import dataclass

from tpedu.model.config import GPTConfig
from tpedu.parallel.config import ParallelConfig

VALUE_BYTES = 4  # weights and gradients (fp32: the master weights), and fp32 values
DRY_DTYPES = ("fp32", "bf16")  # the compute dtypes a dry run steps in
ADAMW_BYTES = 8  # exp_avg and exp_avg_sq per parameter (fp32 weights are their own master)
PHASE_ORDER = ("forward", "backward", "grad_sync")


@dataclass(frozen=True)
class Traffic:
    """One (group, op, phase) line of the tracer's summary for the step: `bytes` are the
    calls' logical tensors (the tracer's `bytes`), `wire` what this rank put on the wire for
    them under the ring algorithms (the tracer's `wire_bytes`: tpedu.comm.volumes)."""

    group: str
    op: str
    phase: str
    calls: int
    elements: int
    bytes: int
    wire: float = 0.0


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
    coords: dict[str, int]  # {axis: index} (Layout.coords)
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
    # (group, its ranks, parameter elements): this rank's parameters by the group their
    # placements reduce the gradients over (tpedu.train.optim.reduction_groups)
    reduced_over: tuple[tuple[str, int, int], ...] = ()
    dtype: str = "fp32"  # the step's compute dtype (train's --dtype): "fp32" or "bf16"
    moe_forwards: int = 0  # forwards of mixture-of-experts blocks among `layer_forwards`

    @property
    def blocks(self) -> int:
        return sum(b - a for a, b in self.chunks)

    def sent(self, group: str) -> int:
        """Logical bytes of every traced call on `group` during the step."""
        return sum(t.bytes for t in self.traffic if t.group == group)

    def wire(self, group: str | None = None) -> float:
        """Bytes this rank put on the wire during the step (ring algorithms; a receive sends
        nothing, a group of one rank moves nothing), on `group` or on every group."""
        return sum(t.wire for t in self.traffic if group is None or t.group == group)

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
                "moe_forwards",
                "act_embedding",
                "act_layers",
                "act_head",
                "traffic",
                "flat_buffers",
                "peak_gathered",
                "reduced_over",
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
    measured_on: int | None = None  # another rank of its class, whose figures these are

    def comparison(self, what: str) -> Comparison:
        return next(c for c in self.comparisons if c.what == what)


def count_noun(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 'es' if noun.endswith('h') else 's'}"
