"""Lesson 13: a full-scale dry run on a laptop: one rank of a 128-GPU job, built and stepped
on the meta device, with every byte it holds and sends counted and set beside the ledger.

    runs = dry_run(GPTConfig.gpt2_like(50257, seq_len=2048, n_layers=32, hidden=4096,
                                       n_heads=32), ParallelConfig(4, 4, 8), batch=8, ranks=[37])
    print(format_table(runs[0]))

    figures          what a rank measures (RankFigures) and a figure beside its prediction
    measure          one rank's training step on the meta device, in a fake world (dry_run)
    predict_memory   the ledger's memory for a rank, and each named difference from it
    predict_traffic  the what-if's messages for a rank, group by group, and each difference
    moe              a mixture of experts' layers: their named terms (lesson 18)
    compare          every figure beside its prediction
    table            a rank as a table, many ranks as a summary

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
- A mixture of experts' router (lesson 18) chooses experts by value, and the all-to-alls'
  sizes follow from its choices. On meta tensors the router still runs (its logits,
  probabilities and top-k are saved as on a real rank), but the dry run assumes *balanced
  routing* for what its choices decide (`tpedu.moe.expert_parallel.balanced_routing`, stated
  there): each of a rank's T tokens sends k assignments, T·k/E to each expert (the first
  T·k mod E one more; capped at the capacity), every EP rank alike. That is the load the
  load-balancing loss aims for: a real run's step is as large when its router is balanced,
  and larger when it is not (the experts then receive more rows than R). The tables say so.
  `tests/test_dryrun.py` holds it against gloo ranks whose routers route round robin, which
  balances exactly.
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
tpedu.cp.traffic's formulas (the ring's K/V sends or Ulysses' all-to-alls) and the loss's mean
over the whole sequence; the gradients' sum over CP is DP's reduction over dp·cp (traced as dp),
and ZeRO's N is dp·cp.

ZeRO-1/2/3: the parameters are views into flat buffers (ZeRO-3 resizes their storage to
nothing at rest, which works on meta tensors too), so weights and gradients are counted as the
storages held after the step, each once: ZeRO-1/2's shards are slices of the whole buffers
(ZeRO-3's stand alone), ZeRO-1's shard means slices of its whole gradient buffer, ZeRO-2/3
keep the means alone; AdamW's states are the shards'; `peak_gathered` is the most bytes of
whole parameters held at once during the step.

Then `compare` sets each figure beside its prediction: the memory ledger
(`tpedu.analysis.memory.ledger`, for pipeline stage 0, at fp32: 4 + 4 + 8 bytes per parameter)
and the what-if's message volumes (`tpedu.analysis.whatif.volumes`), and names every
difference with its size: the prediction plus the named terms equals the measurement, and an
`unexplained` remainder (0 in every layout the tests run) would show a formula or the code is
wrong. Both models count GPT-2-style blocks; for --arch llama only the measured figures are
shown (and the EP group's, which `moe` prices for any architecture).

Mixtures of experts (`moe`): each MoE layer's router, experts (E/ep of them, split over tp)
and shared expert replace the ledger's dense MLP in the parameter terms (so in weights,
gradients and AdamW's states, 4 + 4 + 8 bytes each); what its forward saves replaces the dense
MLP's hidden in the activation terms; its experts' and shared expert's TP all-reduces replace
the dense MLP's; the "ep" group (statistics, counts, dispatch and combine all-to-alls) and the
"edp" group (the experts' gradients, DataParallel's expert buckets) are named term by term.
"""

from __future__ import annotations

from tpedu.analysis.dryrun.compare import compare
from tpedu.analysis.dryrun.figures import Comparison, DryRun, RankFigures, Term, Traffic
from tpedu.analysis.dryrun.measure import (
    attention_as_on_device,
    build_dense,
    check_setup,
    default_ranks,
    dry_run,
    fake_world,
    measure_rank,
    rank_class,
    traffic_summary,
)
from tpedu.analysis.dryrun.table import format_summary, format_table

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
    "rank_class",
    "fake_world",
    "format_summary",
    "format_table",
    "measure_rank",
    "traffic_summary",
]
