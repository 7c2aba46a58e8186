"""Lesson 16: the hunt's six cases: what each broken run shows, the code that ran, and the answers.

A `Case` is one bug of the zoo (tpedu.course.bugzoo.EDITS: an edit of tpedu's own source) seen
the way a practitioner sees it: a story (the run), an observation (loss curves next to tp=1's,
gradient differences, each rank's tokens, what each pipeline stage runs), the check that fails,
and the suspects: functions that ran on the failing path, the edited one among them, in a fixed
shuffled order. What a learner reads (tpedu.course.hunt prints it) names no bug; the rest of a
case (its bug, `secrets`, `explain`) is the answer key, printed only by `hunt.answer(k)`.

A fix is judged on more than the run a learner saw: `unseen` runs the same contract on inputs
the case never shows (other shapes, vocabularies, layouts, seeds, schedules), so a rewrite that
only matches the shown run stays open.

Observations run on every rank of a launch, under the bug, and return rank 0's `Observation`.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from tpedu.comm.device import device
from tpedu.course import bugzoo
from tpedu.course.hunt_checks import (
    check_schedule,
    every_rank,
    unseen_gradients,
    unseen_groups,
    unseen_heads,
    unseen_schedules,
    unseen_tokens,
    unseen_vocab,
)
from tpedu.course.mutation import Suspect
from tpedu.course.troubleshoot import compare_with_dense
from tpedu.model.dense import DenseGPT
from tpedu.model.gpt import TPGPT
from tpedu.parallel import mesh, pipeline
from tpedu.parallel.pipeline import runtime, schedules
from tpedu.tp import attention, embedding, vocab_parallel
from tpedu.tp import operators as tp_ops

STEPS = 10  # AdamW steps of each training run a case draws


@dataclass
class Observation:
    """What a broken run shows on rank 0: text, and the data of its figure."""

    text: str = ""
    # run label -> (its losses per step, tp=1's losses on the same batches)
    runs: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)
    grads: dict[str, float] = field(default_factory=dict)  # parameter -> rel diff vs tp=1, step 0


@dataclass(frozen=True, repr=False)
class Case:
    """One mystery: the zoo bug behind it (never printed), the run, what it shows, the check's
    description, the functions that ran (owner, attribute), and the answer's texts."""

    bug: str
    story: str  # printed: the run that went wrong
    observe: Callable[[], Observation]  # on every rank, under the bug
    compares: str  # printed: what the check compares
    ran: tuple[tuple[object, str], ...]  # the suspects, before the fixed shuffle
    secrets: tuple[str, ...]  # words that would give the bug away (tests keep them unprinted)
    explain: str  # the answer: why the edit shows as it does
    unseen: Callable[[], tuple[bool, str]]  # on every rank: the contract on inputs never shown
    own_check: Callable[[], tuple[bool, str]] | None = None  # instead of the zoo bug's check

    def __repr__(self) -> str:  # the fields hold the answer
        return f"Case({self.story!r})"

    @property
    def edit(self) -> object:
        return bugzoo.EDITS[self.bug]

    @property
    def world(self) -> int:
        return bugzoo.BUGS[self.bug].world

    def check(self) -> tuple[bool, str]:
        """The check the case shows (the zoo's check of its bug unless the case has its own),
        on this rank."""
        return (self.own_check or bugzoo.BUGS[self.bug].check)()

    def suspects(self, number: int) -> list[Suspect]:
        """The functions that ran, in the order case `number` shows them (fixed, shuffled)."""
        found = [Suspect(owner, attr) for owner, attr in self.ran]
        random.Random(f"case {number}").shuffle(found)
        return found


# ------------------------------------------------------------------------------ observations


def train_curves(
    config: object, group: object = None, steps: int = STEPS, seed: int = 0
) -> tuple[list[float], list[float]]:
    """(TP losses, dense losses) of `steps` AdamW steps of a TPGPT over `group` and the DenseGPT
    it was built from (same init, same batches: `bugzoo.example_batch(config, seed + step)`),
    float64."""
    torch.manual_seed(0)
    dense = DenseGPT(config).double()
    tp = TPGPT(dense, group).double().to(device())
    dense.to(device())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (tp, dense)]
    out: tuple[list[float], list[float]] = ([], [])
    for step in range(steps):
        ids, tgt = (x.to(device()) for x in bugzoo.example_batch(config, seed=seed + step))
        for m, opt, losses in zip((tp, dense), opts, out, strict=True):
            opt.zero_grad()
            loss = m(ids, tgt)
            loss.backward()
            if m is tp:
                m.sync_grads()
            opt.step()
            losses.append(loss.item())
    return out


def _step0(config: object, group: object = None, seed: int = 1) -> str:
    return compare_with_dense(config, group, bugzoo.example_batch(config, seed)).summary()


def _see_gqa() -> Observation:
    c, rank = bugzoo.LLAMA, dist.get_rank()
    pairs = [dist.new_group([i, i + 1]) for i in range(0, dist.get_world_size(), 2)]
    pair = pairs[rank // 2]
    text = [
        f"model: Llama-like, {c.n_layers} layers, hidden {c.hidden}, {c.n_heads} query heads "
        f"sharing {c.n_kv_heads} key/value heads, vocabulary {c.vocab_size}; float64",
        f"  tp=2 (ranks 0-1) vs tp=1, step 0: {_step0(c, pair)}",
        f"  tp=4 (ranks 0-3) vs tp=1, step 0: {_step0(c)}",
    ]
    runs = {"tp=2": train_curves(c, pair), "tp=4": train_curves(c)}
    return Observation("\n".join(text), runs)


def _see_pipeline() -> Observation:
    stage = dist.get_rank()
    acts = pipeline.schedule("1f1b", 2, 2, stage)
    line = f"  stage {stage} (rank {stage}): " + " ".join(f"{k}{mb}" for k, mb in acts)
    head = "what each stage runs, in order (F2 = forward of micro-batch 2, B2 = its backward):"
    return Observation("\n".join([head, *every_rank(line)]))


def _see_vocab() -> Observation:
    c = bugzoo.GPT2
    wide = replace(c, vocab_size=c.vocab_size + 1)
    text = [
        f"  vocabulary {c.vocab_size}, tp=2 vs tp=1, step 0: {_step0(c)}",
        f"  vocabulary {wide.vocab_size}, tp=2 vs tp=1, step 0: {_step0(wide)}",
    ]
    runs = {
        f"vocabulary {c.vocab_size}": train_curves(c),
        f"vocabulary {wide.vocab_size}": train_curves(wide),
    }
    return Observation("\n".join(text), runs)


def _see_mesh() -> Observation:
    c, rank = bugzoo.GPT2, dist.get_rank()
    wide = mesh.Mesh(mesh.Layout(tp=dist.get_world_size()))  # tp 4 × dp 1
    dense = DenseGPT(c)
    held = every_rank(str(sum(p.numel() for p in TPGPT(dense, wide.tp_group).parameters())))
    m = mesh.Mesh(mesh.Layout(tp=2, pp=1, dp=2))
    step0 = every_rank(
        f"    rank {rank} (replica {m.dp_rank}): {_step0(c, m.tp_group, 1 + m.dp_rank)}"
    )
    text = [
        f"  tp 4 × dp 1, the parameters each rank holds (the model has "
        f"{sum(p.numel() for p in dense.parameters())}): {', '.join(held)}",
        "  tp 2 × dp 2, each data replica's step 0 against tp=1 on the replica's batch:",
        *step0,
    ]
    curves = train_curves(c, m.tp_group, seed=100 * m.dp_rank)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, curves)
    runs = {"tp 2 × dp 2, replica 0": every[0], "tp 2 × dp 2, replica 1": every[2]}
    return Observation("\n".join(text), runs)


def _see_gradients() -> Observation:
    c = bugzoo.GPT2
    cmp = compare_with_dense(c, None, bugzoo.example_batch(c))
    bad = sum(d > 1e-9 for d in cmp.grad_diff.values())
    text = (
        f"  tp=2 vs tp=1, step 0: {cmp.summary()}\n"
        f"  parameters whose gradient differs from tp=1's: {bad} of {len(cmp.grad_diff)}"
    )
    return Observation(text, {"tp=2": train_curves(c)}, dict(cmp.grad_diff))


def _see_tokens() -> Observation:
    c = bugzoo.GPT2
    full, shard = bugzoo.argmax_logits()
    g = torch.Generator().manual_seed(0)  # unused at temperature 0 (greedy)
    got = vocab_parallel.vocab_parallel_sample(shard, full.shape[-1], g, temperature=0.0)
    parts = [torch.empty_like(got) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, got.contiguous())
    lines = [
        f"  a training step at tp=2 vs tp=1: {_step0(c)}",
        "  the next token of 16 sequences, greedy, from the same logits:",
        "    tp=1          " + " ".join(f"{int(i):>2}" for i in full.argmax(-1)),
    ]
    lines += [
        f"    tp=2, rank {q}  " + " ".join(f"{int(i):>2}" for i in p) for q, p in enumerate(parts)
    ]
    return Observation("\n".join(lines))


# ---------------------------------------------------------------------------------- the cases

# A fixed order, not the zoo's, so that a case's number says nothing about its bug.
CASES: list[Case] = [
    Case(
        "kv_wrong_replica",
        "A Llama-like model trains on 4 ranks at tp=2 and at tp=4, each next to tp=1 (the same "
        "model on one rank) on the same batches.",
        _see_gqa,
        "tp=4 against tp=1, one step: the loss and every gradient (float64)",
        (
            (attention, "local_heads"),
            (attention, "qkv_rows"),
            (attention, "split_qkv"),
            (attention.ParallelAttention, "all_reduce_replicated_kv_grads"),
        ),
        ("kv_wrong_replica", "local_heads", "rank % n_kv", "mod nkv", "modulo", "kv replica"),
        "With more ranks than key/value heads, each rank keeps a copy (a replica) of the one KV "
        "head its query heads use: rank r holds query heads [r·nq/t, (r+1)·nq/t), which use KV "
        "head r // (t/nkv). The edit takes r mod nkv instead: at tp 4 with 2 KV heads, ranks 1 "
        "and 2 attend with the other group's keys and values. At tp = 2 = nkv the replica branch "
        "never runs, which is why tp=2 matched. Megatron-LM and picotron refuse this layout "
        "(they assert nkv % tp == 0); vLLM and SGLang replicate, as tpedu does.",
        unseen=unseen_heads,
    ),
    Case(
        "pipeline_warmup_reversed",
        "A model split into 2 pipeline stages (one rank each) starts its first step on 2 "
        "micro-batches and never finishes it.",
        _see_pipeline,
        "2 stages, 2 micro-batches: each stage's order must keep at most p - s micro-batches in "
        "flight on stage s of p, forward and backward each in micro-batch order, a backward as "
        "soon as that many are in flight (a forward while fewer are); and the step must finish "
        "(a receive waits at most 3 s)",
        (
            (schedules, "schedule"),
            (schedules, "one_f_one_b"),
            (schedules, "action_parts"),
            (runtime, "_edge"),
        ),
        ("pipeline_warmup_reversed", "one_f_one_b", "warm-up", "warmup", "warm up", "1f1b"),
        "1F1B runs w = min(p-1-s, m) warm-up forwards on stage s: the first stage the most, the "
        "last none, so the last stage can start each backward as soon as its forward is done. "
        "The edit counts min(s, m), from the wrong end: stage 0 runs F0 B0 (and waits for the "
        "gradient of micro-batch 0) while stage 1 runs F0 F1 (and waits for the activation of "
        "micro-batch 1). Nobody sends; each waits for the other. run_schedule's recv_timeout "
        "turned the hang into the error that named both sides; without it the job sits at 100 % "
        "until NCCL's watchdog kills it. A schedule that only finishes is not 1F1B either: GPipe's "
        "order (all forwards, then all backwards) finishes too, with m micro-batches in flight "
        "on every stage, and the check refuses it.",
        unseen=unseen_schedules,
        own_check=check_schedule,
    ),
    Case(
        "padded_vocab_unmasked",
        "A small GPT with a vocabulary of 37 tokens trains at tp=2 next to tp=1; then the same "
        "with 38 tokens.",
        _see_vocab,
        "tp=2 against tp=1, one step: the loss and every gradient (float64)",
        (
            (vocab_parallel, "_mask_padding"),
            (vocab_parallel, "_shard_info"),
            (embedding, "padded_vocab"),
            (embedding, "vocab_range"),
        ),
        ("padded_vocab_unmasked", "mask_padding", "padding", "padded", "unmasked"),
        "Vocabulary 37 at tp 2 is padded to 38 so the shards are equal; column 37 is padding "
        "(a zero row of the table, logit 0) and must be -inf before the softmax. The edit masks "
        "ids > vocab_size instead of >= vocab_size: the first padding column stays, takes "
        "probability mass, and the loss is too high by log(1 + e^(0 - m)/S). With 38 tokens "
        "nothing is padded, so nothing changes: the check that finds this bug must use a "
        "vocabulary tp does not divide. Megatron-LM pads the vocabulary "
        "(make_vocab_size_divisible_by) and masks the padding the same way.",
        unseen=unseen_vocab,
    ),
    Case(
        "seed_tp_groups",
        "4 ranks are laid out as tp 4 × dp 1, then as tp 2 × dp 2 (a different batch for each "
        "data replica).",
        _see_mesh,
        "tp 2 × dp 2: each data replica's step against tp=1 on its batch: loss and every gradient",
        (
            (mesh.Layout, "axis_groups"),
            (mesh.Layout, "rank"),
            (mesh.Layout, "coords"),
            (mesh.Layout, "groups"),
        ),
        ("seed_tp_groups", "axis_groups", "swapped", "same tp_rank", "transpos"),
        "A group along an axis is the ranks that differ only in that axis: fix the other "
        "coordinates, vary this one. The edit swaps the two loops, so each 'group' holds the "
        "ranks that share this axis's coordinate: the TP groups become the DP groups (and the DP "
        "groups the TP ones). That is the second seed's new_group loop (§4.1): its 'TP group' is "
        "the ranks with the same tp_rank, never a TP group. At tp 4 × dp 1 every 'TP group' is "
        "one rank, so tpedu, which shards over the group it is given, quietly ran the whole "
        "model on every rank: the right loss, no memory saved (the seed's own layers, sized by "
        "a fixed tp_size, all-reduce over one rank and are wrong from step 0). At tp 2 × dp 2 "
        "the 'TP group' holds two data replicas with different batches, and the loss is wrong.",
        unseen=unseen_groups,
    ),
    Case(
        "no_backward_all_reduce",
        "A small GPT trains at tp=2 next to tp=1 on the same batches.",
        _see_gradients,
        "tp=2 against tp=1, one step: the loss and every gradient (float64)",
        (
            (tp_ops.CopyToTPRegion, "forward"),
            (tp_ops.CopyToTPRegion, "backward"),
            (tp_ops.ReduceFromTPRegion, "forward"),
            (tp_ops.ReduceFromTPRegion, "backward"),
        ),
        (
            "no_backward_all_reduce",
            "CopyToTPRegion",
            "copy_to_tp_region",
            "backward all-reduce",
            "all-reduce in backward",
            "forgets",
        ),
        "f (CopyToTPRegion) is the identity in forward and an all-reduce of the gradient in "
        "backward: each rank's column-parallel shard sends back dL/dx through its own columns "
        "only, and the true gradient is their sum. The edit drops the all-reduce. The forward is "
        "untouched, so the loss at step 0 is exact; every gradient in front of an f is partial "
        "(here all of them: the vocab-parallel head has its own f), and the curves drift apart "
        "from step 1. The seed lists it first among the bugs it has seen (§5.3): "
        "列并行层反向忘了AllReduce输入梯度 (the column-parallel layer forgets to all-reduce its "
        "input gradient); Megatron-LM's copy_to_tensor_model_parallel_region is this operator.",
        unseen=unseen_gradients,
    ),
    Case(
        "argmax_one_shard",
        "A tp=2 model that trains exactly like tp=1 generates different text on each rank.",
        _see_tokens,
        "greedy tokens from 16 rows of logits split over 2 ranks, against the whole logits' tokens",
        (
            (vocab_parallel, "vocab_parallel_argmax"),
            (vocab_parallel, "vocab_parallel_sample"),
            (vocab_parallel, "_shard_info"),
            (vocab_parallel, "vocab_parallel_cross_entropy"),
        ),
        ("argmax_one_shard", "vocab_parallel_argmax", "argmax", "one shard", "shard's best"),
        "Each rank holds the logits of its own vocabulary columns. The edit returns the best "
        "token of this rank's columns and stops there: the two all-gathers that compare every "
        "rank's best (value, id) are gone. Rank 0 emits its half's best token, rank 1 its half's; "
        "each is tp=1's token only where the best token happens to be in its half. Training "
        "never takes an argmax, so the loss and gradients are exact. The seed's §5.5: "
        "直接拿分片的logits做argmax会得到错误token (an argmax over one shard's logits gives the "
        "wrong token).",
        unseen=unseen_tokens,
    ),
]


def unhunted(later: bool = False) -> list[str]:
    """The zoo's bugs that no case is built on, in the zoo's order; `later`: with those of what
    the course teaches after this lesson (bugzoo.LATER)."""
    hunted = {c.bug for c in CASES}
    return [n for n in bugzoo.BUGS if n not in hunted and (later or n not in bugzoo.LATER)]
