"""Lesson 16: the bug zoo: deliberately broken variants of tpedu, one real, reported failure each.

Each bug is a context manager that monkeypatches ONE thing in tpedu, and comes with the check
that catches it (a mutation test: the check passes on tpedu and fails under the bug) and the
symptom a learner would see. The six behind the hunt's cases (tpedu.course.hunt) are `EDITS`:
one edit of tpedu's own source each (tpedu.course.mutation), so the code that ran can be read
as it ran; the others replace the function with a broken twin written here.

    with broken("no_backward_all_reduce"):      # inside a rank worker (or before tpedu.launch:
        ok, detail = BUGS["..."].check()       #  forked ranks inherit the patch)

    name                       what is wrong                                  caught by
    no_backward_all_reduce      f's backward returns the local gradient         dense vs TP gradients
    wrong_group                f̄ all-reduces over every rank, not the TP group  dense vs TP loss (tp2×dp2)
    sp_norm_grads_unsynced     SP: norm/bias gradients never all-reduced       dense vs TP gradients (SP)
    padded_vocab_unmasked      the first padding column of the vocab shard     dense vs TP loss
                               enters the softmax
    argmax_one_shard           greedy decoding takes argmax over one shard     dense vs TP argmax
    fused_qkv_naive_split      fused [q|k|v] weight chunked into t row blocks  dense vs TP loss
    kv_wrong_replica           tp > kv heads: rank r uses KV head r mod nkv    dense vs TP loss (tp 4)
    kv_replica_grads_unsynced  replicated KV heads' gradients never summed     dense vs TP gradients (tp 4)
    seed_tp_groups             groups' loops swapped: TP group = same tp_rank  dense vs TP loss (tp2×dp2)
    pipeline_warmup_reversed   1F1B warm-up counted from the wrong end         hang -> PipelineTimeout
    dropout_rank_masks         per-rank dropout masks in replicated regions    dense vs TP loss, training
    cp_lse_merge_averaged      ring attention averages partial outputs         dense vs CP loss (cp 2)
    cp_grads_unsynced          CP ranks' gradients never summed                dense vs CP gradients (cp 2)
    cp_positions_not_offset    every CP chunk's positions counted from 0       dense vs CP loss (cp 2)
    cp_zigzag_offsets_wrong    zig-zag data, contiguous positions in the model dense vs CP loss (cp 2)
    zero_grads_summed          ZeRO: reduce-scattered gradients not divided    ZeRO-2 vs DP gradient norm
                               by N
    zero_shard_updated_twice   ZeRO: AdamW stepped once per parameter group    ZeRO-2 vs DP loss, step 1
    zero3_no_backward_gather   ZeRO-3: backward never re-gathers a freed block ZeRO-3 vs DP (an error)
    ep_experts_averaged_over_dp EP: experts' gradients averaged over all of DP  EP vs plain DP (ep 2)

Checks run on every rank of a launch of `Bug.world` ranks and return (ok, detail) per rank; the
bug is caught when any rank reports not ok.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from tpedu import model
from tpedu.comm import collectives
from tpedu.comm.device import device
from tpedu.course.mutation import Mutation, patched
from tpedu.course.troubleshoot import TOLERANCE, compare_with_dense, summary
from tpedu.course.zoo_training import (
    GPT2,
    check_cp_train_step,
    check_ep_step,
    check_zero2_step,
    check_zero3_step,
)
from tpedu.cp import context, ring
from tpedu.cp.context import ContextParallel
from tpedu.cp.gradients import sum_over_cp
from tpedu.model import gpt
from tpedu.model.options import RunOptions
from tpedu.parallel import mesh, pipeline, zero
from tpedu.parallel.pipeline import schedules
from tpedu.tp import attention, vocab_parallel
from tpedu.tp import operators as tp_ops
from tpedu.train import optim

# The small models every check uses: an odd vocabulary (37: padded at tp 2 and 4), 4 heads
# (GPT2 lives with the training checks, tpedu.course.zoo_training).
LLAMA = model.GPTConfig.llama_like(37, seq_len=8, n_layers=2, hidden=16, n_heads=4, n_kv_heads=2)


@dataclass(frozen=True)
class Bug:
    """One broken variant: what it breaks, how it shows, and the check that catches it."""

    name: str
    title: str  # one line: what is wrong
    patch: Callable[[], contextlib.AbstractContextManager]
    check: Callable[[], tuple[bool, str]]  # run on every rank of `world` ranks
    world: int
    symptom: str  # what a learner sees
    source: str  # where it was reported


# ---------------------------------------------------------------------------- broken variants


def _reduce_forward_world(ctx: object, x: torch.Tensor, group: object) -> torch.Tensor:
    out = x.contiguous().clone()
    collectives.all_reduce(out, None)  # BUG: the default group (every rank), not `group`
    return out


def _sync_nothing(params: object, group: object = None) -> None:
    return None  # BUG: the SP norms' and biases' partial gradients stay partial


def _split_qkv_naive(
    weight: torch.Tensor, n_heads: int, n_kv_heads: int, tp: int, rank: int
) -> torch.Tensor:
    return weight.detach().chunk(tp, dim=0)[rank].contiguous()  # BUG: rank 0 gets q, q, ...


def _no_kv_sync(self: object) -> None:
    return None  # BUG: each replica keeps the gradient of its own queries only


_VARY_AXIS = "            for i in range(sizes[axis])\n        ]\n"
_FIX_OTHERS = "        for fixed in itertools.product(*(range(sizes[a]) for a in others))\n"
_VARY_OTHERS = (
    "            for fixed in itertools.product(*(range(sizes[a]) for a in others))\n        ]\n"
)
_FIX_AXIS = "        for i in range(sizes[axis])\n"

# The hunt's six: one edit of tpedu's own source each, so the code that ran reads as tpedu's.
EDITS: dict[str, Mutation] = {
    "no_backward_all_reduce": Mutation(
        tp_ops.CopyToTPRegion, "backward", "    collectives.all_reduce(grad, ctx.group)\n", ""
    ),
    "padded_vocab_unmasked": Mutation(
        vocab_parallel, "_mask_padding", "cols >= vocab_size", "cols > vocab_size"
    ),
    "argmax_one_shard": Mutation(
        vocab_parallel,
        "vocab_parallel_argmax",
        "    best, idx = z.max(dim=-1, keepdim=True)  # first maximum within the shard\n"
        "    values = collectives.all_gather(best.contiguous(), group, dim=-1)  # [..., t], rank "
        "order\n    ids = collectives.all_gather((idx + start).contiguous(), group, dim=-1)\n"
        "    winner = values.argmax(dim=-1, keepdim=True)  # first (lowest-rank) maximum: lowest "
        "id\n    return ids.gather(-1, winner).squeeze(-1)\n",
        "    return z.argmax(dim=-1) + start\n",
    ),
    "kv_wrong_replica": Mutation(
        attention, "local_heads", "kv = [rank // (tp // n_kv_heads)]", "kv = [rank % n_kv_heads]"
    ),
    "seed_tp_groups": Mutation(  # the two loops swapped: groups of ranks sharing the coordinate
        mesh.Layout, "axis_groups", _VARY_AXIS + _FIX_OTHERS, _VARY_OTHERS + _FIX_AXIS
    ),
    "pipeline_warmup_reversed": Mutation(
        schedules,
        "one_f_one_b",
        "warm = min(n_stages - 1 - stage, n_micro)",
        "warm = min(stage, n_micro)",
    ),
}


_index_dropout = gpt.index_dropout


def _dropout_per_rank(x: torch.Tensor, p: float, seed: int, *args: object, **kwargs: object):
    # BUG: seeding by rank (torch.manual_seed(base + rank)) in a region every rank replicates
    return _index_dropout(x, p, seed + dist.get_rank(), *args, **kwargs)


# ----------------------------------------------------------------------------------- checks


def example_batch(
    config: model.GPTConfig, seed: int = 1, b: int = 3, s: int = 6
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids and targets [b, s] from `seed`: the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, config.vocab_size, (b, s), generator=g),
        torch.randint(0, config.vocab_size, (b, s), generator=g),
    )


def _vs_dense(
    config: model.GPTConfig,
    group: object = None,
    seed: int = 1,
    training: bool = False,
    options: RunOptions | None = None,
) -> tuple[bool, str]:
    batch = example_batch(config, seed)
    cmp = compare_with_dense(config, group, batch, training=training, options=options)
    return cmp.ok, cmp.summary()


def check_tp_step() -> tuple[bool, str]:
    """TP (all ranks) vs dense: loss and every gradient, float64."""
    return _vs_dense(GPT2)


def check_sp_step() -> tuple[bool, str]:
    """Sequence-parallel TP vs dense: loss and every gradient."""
    return _vs_dense(GPT2, options=RunOptions(sequence_parallel=True))


def check_dropout_step() -> tuple[bool, str]:
    """TP vs dense with dropout 0.1 in training mode (masks must be the dense ones)."""
    return _vs_dense(replace(GPT2, dropout=0.1), training=True)


def check_gqa_step() -> tuple[bool, str]:
    """Grouped-query attention (4 q heads, 2 KV heads) at tp = world (4: replicated KV) vs dense."""
    return _vs_dense(LLAMA)


def check_two_groups() -> tuple[bool, str]:
    """world 4 = two TP groups [0,1], [2,3] with different data; each must match dense on its own."""
    world, tp = dist.get_world_size(), 2
    groups = [dist.new_group(list(range(i, i + tp))) for i in range(0, world, tp)]
    gi = dist.get_rank() // tp
    return _vs_dense(GPT2, groups[gi], seed=1 + gi)


def check_mesh_groups() -> tuple[bool, str]:
    """tp 2 × dp 2 Mesh; each DP replica gets its own batch; each must match dense on its batch."""
    m = mesh.Mesh(mesh.Layout(tp=2, pp=1, dp=2))
    return _vs_dense(GPT2, m.tp_group, seed=1 + m.dp_rank)


def argmax_logits() -> tuple[torch.Tensor, torch.Tensor]:
    """(the whole logits [16, 37], this rank's shard of them padded to 37 rounded up to the world
    size): random float64 from seed 5, the same on every rank."""
    g = torch.Generator().manual_seed(5)
    v, t, r = 37, dist.get_world_size(), dist.get_rank()
    n = -(-v // t)
    full = torch.randn(16, v, generator=g, dtype=torch.float64).to(device())
    padded = torch.nn.functional.pad(full, (0, n * t - v))
    return full, padded[:, r * n : (r + 1) * n]


def check_argmax() -> tuple[bool, str]:
    """Greedy decoding from vocab-parallel logits == argmax of the dense logits, every row."""
    full, shard = argmax_logits()
    got = vocab_parallel.vocab_parallel_argmax(shard, full.shape[-1])
    wrong = int((got != full.argmax(-1)).sum())
    return wrong == 0, f"{wrong} of 16 tokens differ from tp=1's"


def check_pipeline() -> tuple[bool, str]:
    """pp 2, 1F1B, 2 micro-batches: the step must finish (a receive waits at most 1 s)."""
    m = mesh.Mesh(mesh.Layout(tp=1, pp=2, dp=1))
    torch.manual_seed(0)
    dense = model.DenseGPT(GPT2)  # built on the CPU (the same init on every rank), then moved
    chunks = [c.to(device()) for c in pipeline.build_stage_chunks(dense, m.tp_group, m.pp_rank, 2)]
    ids, tgt = (x.to(device()) for x in example_batch(GPT2, b=4))
    acts = pipeline.schedule("1f1b", 2, 2, m.pp_rank)
    try:
        pipeline.run_schedule(
            chunks,
            acts,
            pipeline.Pipe.from_mesh(m),
            list(ids.chunk(2)),
            list(tgt.chunk(2)),
            (2, 6, GPT2.hidden),
            options=pipeline.StepOptions(recv_timeout=1.0),
        )
    except pipeline.PipelineTimeout as e:
        return False, str(e).split(": the stages")[0]
    return True, "the step finished"


# ------------------------------------------------------------------------------------ the zoo


def _merge_averaged(out_a, lse_a, out_b, lse_b):
    # BUG: the two partial outputs averaged, not weighted by their softmax denominators
    return (out_a + out_b) / 2, torch.logaddexp(lse_a, lse_b)


def _positions_from_zero(s: int, cp: int, rank: int, layout: str = "zigzag"):
    return torch.arange(s // cp)  # BUG: every chunk counted from 0, not from its global start


def _positions_contiguous(s: int, cp: int, rank: int, layout: str = "zigzag"):
    n = s // cp  # BUG: the data is split zig-zag, the model thinks it holds [r·n, (r+1)·n)
    return torch.arange(rank * n, (rank + 1) * n)


def check_cp_step() -> tuple[bool, str]:
    """cp = world (2), ring attention, zig-zag: the CP GPT's loss and gradients vs dense (float64)."""
    from tpedu.cp.ring import split_sequence

    world, rank = dist.get_world_size(), dist.get_rank()
    singles = [dist.new_group([r]) for r in range(world)]  # tp 1: each rank its own TP group
    cp_group = dist.new_group(list(range(world)))
    torch.manual_seed(0)
    dense = model.DenseGPT(GPT2).double()
    tp_model = model.TPGPT(
        dense, singles[rank], options=RunOptions(context=ContextParallel(cp_group))
    )
    ids, tgt = example_batch(GPT2, b=2, s=8)
    want = dense(ids, tgt)
    want.backward()
    loss = tp_model(*(split_sequence(t, world, rank, "zigzag", dim=1) for t in (ids, tgt)))
    loss.backward()
    tp_model.sync_grads()
    sum_over_cp(tp_model.parameters(), cp_group)
    grads = tp_model.gather_state_dict(grads=True)  # dense names (tp 1: no communication)
    worst, name = 0.0, "-"
    for n, p in dense.named_parameters():
        d = ((grads[n] - p.grad).norm() / p.grad.norm().clamp_min(1e-30)).item()
        worst, name = max((worst, name), (d, n))
    diff = abs(loss.item() - want.item()) / want.item()
    return diff <= TOLERANCE and worst <= TOLERANCE, summary(diff, name, worst)


def _finish_grads_summed(self: zero.FlatBuffer) -> None:
    if self.grad_work is None:
        self.reduce_grads()
    self.grad_work.wait()
    self.shard.grad = self.grad_out.to(self.shard.dtype)  # BUG: the sum over N ranks, not the mean
    self.ready, self.grad_out, self.grad_work = 0, None, None


@torch.no_grad()
def _step_per_group(self: zero.ShardedDataParallel) -> None:
    for _group in self.param_groups:
        self.inner.step()  # BUG: inside the loop over the 2 groups: every shard updated twice
    for b in self.buffers:
        if self.level < 3:
            b.write_params()
        else:
            b.free()


def _backward_without_gather(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return grad, None  # BUG: the block's parameters are still freed when its backward reads them


BUGS: dict[str, Bug] = {
    b.name: b
    for b in [
        Bug(
            "no_backward_all_reduce",
            "f (copy_to_tp_region) forgets the all-reduce in backward",
            EDITS["no_backward_all_reduce"].patch,
            check_tp_step,
            2,
            "forward and loss identical; the gradient of every layer in front of an f differs "
            "from tp=1 (with a vocab-parallel head: all of them); loss curves drift apart slowly",
            "seed §2.2 (f's backward all-reduce) and §5.3 (列并行层反向忘了AllReduce输入梯度); "
            "Megatron-LM copy_to_tensor_model_parallel_region",
        ),
        Bug(
            "wrong_group",
            "f̄ all-reduces over every rank instead of the TP group",
            lambda: patched(
                tp_ops.ReduceFromTPRegion, "forward", staticmethod(_reduce_forward_world)
            ),
            check_two_groups,
            4,
            "fine with one TP group; with tp 2 × dp 2 the activations of different data replicas "
            "are summed: loss wrong from step 0, or a hang if the groups' schedules differ",
            "seed §5.3 (AllReduce用错了group, TP and global group mixed up); a common 3D-parallel "
            "mistake (default group instead of the TP group)",
        ),
        Bug(
            "sp_norm_grads_unsynced",
            "sequence parallel: LayerNorm/bias gradients not all-reduced",
            lambda: patched(gpt, "all_reduce_sequence_parallel_grads", _sync_nothing),
            check_sp_step,
            2,
            "loss identical; only norm weights/biases and row-parallel biases have the wrong "
            "gradient; replicated norms drift apart across ranks over steps",
            "Megatron-LM #1446, gpt-neox #1257",
        ),
        Bug(
            "padded_vocab_unmasked",
            "the padding mask compares with > instead of >=: the first padding column is kept",
            EDITS["padded_vocab_unmasked"].patch,
            check_tp_step,
            2,
            "loss too high by log(1 + e^(z_pad - m)/S) whenever vocab % tp != 0 (fine when it "
            "divides); probability mass on an id that does not exist",
            "not in the seeds (a course addition from practice): Megatron-LM pads the vocabulary "
            "(make_vocab_size_divisible_by) and masks the padding",
        ),
        Bug(
            "argmax_one_shard",
            "greedy decoding: argmax over this rank's vocabulary shard",
            EDITS["argmax_one_shard"].patch,
            check_argmax,
            2,
            "training is fine; generated text differs per rank and from tp=1 (each rank emits "
            "its own shard's best token)",
            "seed §5.5",
        ),
        Bug(
            "fused_qkv_naive_split",
            "fused [q|k|v] weight chunked into t row blocks",
            lambda: patched(attention, "split_qkv", _split_qkv_naive),
            check_tp_step,
            2,
            "runs without error (the shapes fit); loss at tp>1 differs from tp=1 at step 0 and "
            "trains to a worse model",
            "not in the seeds: Megatron-LM / HF checkpoint conversion issues (fused QKV layout)",
        ),
        Bug(
            "kv_wrong_replica",
            "tp > KV heads: rank r takes KV head r mod nkv, not r // (tp/nkv)",
            EDITS["kv_wrong_replica"].patch,
            check_gqa_step,
            4,
            "GQA model at tp > n_kv_heads: queries attend with another group's keys; loss "
            "differs from tp=1 at step 0",
            "Megatron-LM/picotron assert nkv % tp == 0 instead; vLLM/SGLang replicate",
        ),
        Bug(
            "kv_replica_grads_unsynced",
            "replicated KV heads' gradients never summed",
            lambda: patched(
                attention.ParallelAttention, "all_reduce_replicated_kv_grads", _no_kv_sync
            ),
            check_gqa_step,
            4,
            "loss identical at step 0; KV weight gradients are partial; the replicas of a KV "
            "head drift apart from step 1",
            "Megatron-LM GQA with tp > num_query_groups",
        ),
        Bug(
            "seed_tp_groups",
            "groups built with the two loops swapped: a 'TP group' is the ranks with the same "
            "tp_rank, as in the second seed (never a TP group)",
            EDITS["seed_tp_groups"].patch,
            check_mesh_groups,
            4,
            "at dp = pp = 1 each 'TP group' is one rank: tpedu silently runs the unsharded model "
            "on every rank (right loss, no memory saved; the seed's layers, sized by a fixed "
            "tp_size, sum nothing and are wrong from step 0); with dp > 1 a 'TP group' holds "
            "ranks with different batches: loss wrong from step 0",
            "second seed §4.1, its new_group loop",
        ),
        Bug(
            "pipeline_warmup_reversed",
            "1F1B warm-up counted from the wrong end (s, not p-1-s)",
            EDITS["pipeline_warmup_reversed"].patch,
            check_pipeline,
            2,
            "hang: stage 0 waits for a gradient, stage 1 for an activation; with a timeout, "
            "PipelineTimeout naming both",
            "pipeline schedule bugs (send/recv order mismatch)",
        ),
        Bug(
            "dropout_rank_masks",
            "dropout seeded per rank in replicated regions",
            lambda: patched(gpt, "index_dropout", _dropout_per_rank),
            check_dropout_step,
            2,
            "fine with dropout 0 or in eval; in training the replicated residual stream differs "
            "across ranks, loss differs from tp=1, replicated weights drift apart",
            "not in the seeds: Megatron-LM's CUDA RNG tracker (model-parallel vs data-parallel "
            "seeds)",
        ),
        Bug(
            "cp_lse_merge_averaged",
            "ring attention averages the blocks' partial outputs instead of weighting them",
            lambda: patched(ring, "merge_partials", _merge_averaged),
            check_cp_step,
            2,
            "runs and trains, loss a little off from tp=1 and every gradient wrong; with one "
            "CP rank (nothing to merge) it is right, so a cp=1 test never sees it",
            "not in the seeds: production CP attention has shipped wrong-gradient bugs "
            "(Megatron-LM #1464, TransformerEngine #1557)",
        ),
        Bug(
            "cp_grads_unsynced",
            "context parallel: gradients never summed over the CP ranks",
            lambda: patched(optim, "gradient_group", lambda placements: "dp"),
            check_cp_train_step,
            2,
            "the first loss identical, the gradient norm off from step 0 (each rank's gradient "
            "covers its positions only) and the losses from step 1: the reduction group (dp·cp, "
            "CP folded into DP's) left the CP ranks out",
            "not in the seeds: the CP analogue of sequence parallelism's norm-gradient bug",
        ),
        Bug(
            "cp_positions_not_offset",
            "context parallel: each rank numbers its positions from 0",
            lambda: patched(context, "chunk_positions", _positions_from_zero),
            check_cp_step,
            2,
            "with learned positions every chunk gets the first positions' embeddings; the causal "
            "mask lets every rank's queries see the other ranks' keys as if earlier or equal",
            "not in the seeds: a classic of hand-written sequence splitting",
        ),
        Bug(
            "cp_zigzag_offsets_wrong",
            "zig-zag split of the data, contiguous positions in the model",
            lambda: patched(context, "chunk_positions", _positions_contiguous),
            check_cp_step,
            2,
            "loss off from tp=1 on every step; a contiguous split (or cp = 1) hides it",
            "not in the seeds: load-balanced CP needs the causal mask from the real positions",
        ),
        Bug(
            "zero_grads_summed",
            "ZeRO: reduce-scattered gradient shards summed over the DP ranks, not averaged",
            lambda: patched(zero.FlatBuffer, "finish_grads", _finish_grads_summed),
            check_zero2_step,
            2,
            "loss identical at step 0 and nearly so after (AdamW divides by √v: a gradient "
            "scaled by N barely moves the update); the gradient norm is N× plain DP's, so "
            "clipping fires N× too early and an lr tuned at another dp behaves differently",
            "not in the seeds (they stop at 'data parallelism plus ZeRO'): a reduce-scatter "
            "sums like an all-reduce, the 1/N is the caller's (FSDP's gradient divide factor)",
        ),
        Bug(
            "zero_shard_updated_twice",
            "ZeRO: the AdamW step runs inside the loop over parameter groups",
            lambda: patched(zero.ShardedDataParallel, "step", _step_per_group),
            check_zero2_step,
            2,
            "loss and gradient norm right at step 0, then off from step 1: every shard took two "
            "AdamW updates (its step counter runs at twice the rate); every DP rank agrees, so "
            "the replicas stay identical and nothing looks unsynced",
            "not in the seeds: an optimizer stepped once per group (or per chunk) instead of "
            "once per step",
        ),
        Bug(
            "ep_experts_averaged_over_dp",
            "EP: each rank's experts averaged over the whole DP group, not the ranks that "
            "hold the same experts",
            lambda: patched(optim, "gradient_group", lambda placements: "dp_cp"),
            check_ep_step,
            2,
            "the gradient norm off from step 0 and the loss from step 1: every rank's experts "
            "are pulled towards the other ranks' different experts; nothing crashes, and the "
            "attention's replicas all agree",
            "not in the seeds: Megatron-core and torchtitan reduce expert gradients over the "
            "expert-data-parallel group only (scaled by the whole DP size)",
        ),
        Bug(
            "zero3_no_backward_gather",
            "ZeRO-3: a block freed after forward is not re-gathered before its backward",
            lambda: patched(
                zero.GatherForBackward, "backward", staticmethod(_backward_without_gather)
            ),
            check_zero3_step,
            2,
            "forward and loss fine; backward stops in the last block with 'setStorage: ... out "
            "of bounds for storage of size 0' (its saved weights point into a freed buffer); "
            "ZeRO-2 and plain DP, which never free, are fine",
            "not in the seeds: FSDP's pre-backward unshard; ZeRO paper (Rajbhandari et al. "
            "2020): stage 3 gathers each layer's parameters again for its backward",
        ),
    ]
}


# Bugs in what the course teaches after lesson 16 (expert parallelism): kept in the zoo and its
# tests, left out of lesson 16's tour, which may use only what earlier lessons taught.
LATER = frozenset({"ep_experts_averaged_over_dp"})


def broken(name: str) -> contextlib.AbstractContextManager:
    """The broken variant `name` (a context manager that monkeypatches one thing in tpedu)."""
    if name not in BUGS:
        raise ValueError(f"unknown bug {name!r}; the zoo has: {', '.join(BUGS)}")
    return BUGS[name].patch()


def run_check(name: str, with_bug: bool) -> tuple[bool, str]:
    """Worker body: run bug `name`'s check on this rank, with or without the bug."""
    with broken(name) if with_bug else contextlib.nullcontext():
        return BUGS[name].check()


def catalogue(names: Iterable[str] | None = None) -> str:
    """A text table of the zoo (or of the bugs `names`): name, ranks, what is wrong."""
    lines = [f"{'bug':<26} {'ranks':>5}  what is wrong", "-" * 90]
    shown = [BUGS[n] for n in names] if names is not None else list(BUGS.values())
    lines += [f"{b.name:<26} {b.world:>5}  {b.title}" for b in shown]
    return "\n".join(lines)
