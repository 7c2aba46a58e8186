"""Lessons 08–15: `ParallelConfig`, how a model runs, kept apart from what it is (`GPTConfig`).

torchtitan's rule: the model stays plain, and parallelism is applied to it from a separate
config. Every field here changes how the work is spread over ranks, never the function the
model computes or the tensors it stores, so a checkpoint saved under one ParallelConfig loads
under any other (lesson 14):

    tp, pp, dp          the 3D layout (lesson 13; `Layout`, `Mesh`)
    schedule, chunks    the pipeline schedule and model chunks per pipeline rank (lesson 11)
    micro_batches       per step, with pp > 1 (None: the largest ≤ 2·pp dividing the batch)
    stage_split         "even" blocks per stage, or "flops" (the head counted in blocks)
    sequence_parallel   norms, dropout, residuals on s/t positions between TP regions (lesson 08)
    recompute           "none", "selective" (attention core) or "full" (whole block) (lesson 10)
    overlap_comm        f's backward all-reduce overlapped with dL/dW (lesson 15)
    zero                ZeRO stage over the DP ranks (lesson 12): 0 none, 1 AdamW's states,
                        2 and the gradients, 3 and the parameters (FSDP)
    cp, cp_strategy     context parallelism: the sequence split over cp ranks for the whole
    cp_layout           layer, "ring" or "ulysses" attention, "zigzag" or "contiguous" split
                        (tpedu.cp), with TP, PP and DP around it. Ranks: tp fastest, then cp,
                        pp, dp (`Layout`)
    ep                  expert parallelism, carved from DP: each DP group's runs of ep ranks
                        hold different experts of every mixture-of-experts layer (tpedu.moe)
    tp_overlap          hide TP's communication (lesson 19): "chunks" runs each block as
    tp_chunks           tp_chunks batch chunks of a micro-batch (tpedu.tp.chunked; with CP
                        too, with experts the attention half only), "ring" the
                        sequence-parallel collectives as ring steps under the matmuls
                        (tpedu.tp.collective_matmul; not with CP or experts: no SP there)

`model_options(mesh)` is what `TPGPT` takes of it, a `tpedu.model.options.RunOptions`: the model
layer does not import this one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from tpedu.cp.context import STRATEGIES, ContextParallel
from tpedu.cp.ring import LAYOUTS, check_cp_length
from tpedu.model.config import RECOMPUTE, GPTConfig
from tpedu.model.gpt import check_context_parallel, check_moe_options, check_ring_overlap
from tpedu.model.options import TP_OVERLAPS, RunOptions, check_tp_overlap
from tpedu.moe.expert_parallel import check_experts_divide
from tpedu.parallel.mesh import AXIS_NAMES, Layout, Mesh
from tpedu.parallel.pipeline.schedules import partition, schedule
from tpedu.tp.sequence_parallel import check_sequence_length

SCHEDULES = ("1f1b", "gpipe", "interleaved")
STAGE_SPLITS = ("even", "flops")
ZERO_LEVELS = (0, 1, 2, 3)


@dataclass(frozen=True)
class ParallelConfig:
    """How a GPT runs on tp·pp·dp ranks. Checked on construction (field by field) and against a
    model by `check(config)`; both raise a ValueError naming the field and the fix."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    schedule: str = "1f1b"
    chunks: int = 1
    micro_batches: int | None = None
    stage_split: str = "even"
    sequence_parallel: bool = False
    recompute: str = "none"
    overlap_comm: bool = False
    zero: int = 0
    cp: int = 1
    cp_strategy: str = "ring"
    cp_layout: str = "zigzag"
    ep: int = 1
    tp_overlap: str = "none"
    tp_chunks: int = 2

    def __post_init__(self) -> None:
        _ = self.layout  # Layout refuses an axis that is not a positive integer
        for name, choices in (
            ("schedule", SCHEDULES),
            ("stage_split", STAGE_SPLITS),
            ("recompute", RECOMPUTE),
            ("zero", ZERO_LEVELS),
            ("cp_strategy", STRATEGIES),
            ("cp_layout", LAYOUTS),
            ("tp_overlap", TP_OVERLAPS),
        ):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")
        # ep > 1 means experts: a ring there is refused for what it is, not for a missing SP
        check_ring_overlap(self.tp_overlap, self.cp, self.ep > 1)
        check_tp_overlap(self.tp_overlap, self.tp_chunks, self.sequence_parallel)
        if self.micro_batches is not None and self.micro_batches < 1:
            raise ValueError(f"micro_batches must be at least 1, got {self.micro_batches}")
        schedule(self.schedule, self.micro_batches or self.pp, self.pp, 0, self.chunks)

    @property
    def layout(self) -> Layout:
        return Layout(**{a: getattr(self, a) for a in AXIS_NAMES}, ep=self.ep)

    @property
    def world(self) -> int:
        return self.layout.world

    def model_options(self, mesh: Mesh | None = None) -> RunOptions:
        """TPGPT's RunOptions: what of this config the model itself needs; with this rank's
        `mesh`, its CP and EP groups too."""
        return RunOptions(
            sequence_parallel=self.sequence_parallel,
            recompute=self.recompute,
            overlap_comm=self.overlap_comm,
            context=(
                ContextParallel(mesh.cp_group, self.cp_strategy, self.cp_layout)
                if mesh is not None and self.cp > 1
                else None
            ),
            ep_group=mesh.ep_group if mesh is not None and self.ep > 1 else None,
            tp_overlap=self.tp_overlap,
            tp_chunks=self.tp_chunks,
        )

    def check(self, config: GPTConfig) -> None:
        """Raise a ValueError naming the problem (and the fix) if `config` cannot run so."""
        config.check(self.tp)
        partition(config.n_layers, self.pp * self.chunks)
        if self.sequence_parallel:  # the batch's own s is checked again at run time
            check_sequence_length(config.seq_len, self.tp)
        if self.cp > 1:
            check_cp_length(config.seq_len, self.cp, self.cp_layout)
            check_context_parallel(
                config, self.sequence_parallel, self.cp_strategy, self.tp, self.cp
            )
        if config.experts:
            check_moe_options(self.sequence_parallel, self.tp_overlap)
        if self.ep > 1:
            check_expert_parallel(config, self)

    def check_dense_export(self) -> None:
        """Raise a ValueError if a run of this layout cannot write a dense model directory
        (train's `out`, --out): the experts split over ep are on no one rank."""
        if self.ep > 1:
            raise ValueError(
                f"ep = {self.ep}: a dense model directory (--out) needs every expert on one "
                "rank; save sharded checkpoints (--ckpt-dir), then `tpedu reshard CKPT --to "
                "dense --out DIR`"
            )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> ParallelConfig:
        """A config from `to_dict()`'s output; unknown keys are refused by name."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown ParallelConfig fields {unknown}; known: {sorted(known)}")
        return cls(**values)


def check_expert_parallel(config: GPTConfig, parallel: ParallelConfig) -> None:
    """Raise a ValueError naming the problem (and the fix) if ep > 1 cannot run `config`."""
    if not config.experts:
        raise ValueError(
            f"ep = {parallel.ep} needs a mixture of experts to split; give the model experts "
            "(--experts E) or use ep = 1"
        )
    check_experts_divide(config.experts, parallel.ep)
