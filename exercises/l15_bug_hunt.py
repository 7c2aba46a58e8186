"""Exercise l15: the bug hunt. Each function below has a broken twin in tpedu/course/bugzoo.py.

Notebook 15 runs each broken variant and shows its symptom (a loss that differs from tp=1, a
gradient table with a few red rows, tokens that differ per rank, a hang). For each one: find the
bug in the broken twin (its source is printed in the notebook, and marked `# BUG` in
tpedu/course/bugzoo.py, but try first from the symptom alone), then write the FIXED function here.

Communicate only through tpedu.comm.collectives (so the tests' tracer sees it). Run `make grade`.
The production versions are in tpedu/tp/ (operators.py, vocab_parallel.py, attention.py) and
tpedu/parallel/ (mesh.py, pipeline/schedules.py); solutions/l15_bug_hunt.py writes them out.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def copy_to_tp_region(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """f: x [...] -> x [...] (the same values). Forward: no communication. Backward: the
    gradient is all-reduced (summed) over `group`, exactly once per use.

    Broken twin (bug `no_backward_all_reduce`): its backward returns the local gradient.
    Symptom: loss identical to tp=1, but every gradient before the layer differs.
    """
    raise NotImplementedError("l15: fix f; hint: tpedu.grading.hint('l15', 1)")


def mask_padding(logits_shard: torch.Tensor, start: int, vocab_size: int) -> torch.Tensor:
    """logits_shard [..., n] holds global vocabulary columns [start, start + n); return it with
    every column whose global id is >= vocab_size (padding) set to -inf. No communication.

    Broken twin (bug `padded_vocab_unmasked`): returns the shard unchanged.
    Symptom: loss too high whenever vocab_size % tp != 0.
    """
    raise NotImplementedError("l15: fix the padding mask; hint: tpedu.grading.hint('l15', 1)")


def vocab_parallel_argmax(
    logits_shard: torch.Tensor, vocab_size: int, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The global argmax id [...] (int64) from this rank's logits [..., n] (columns [r·n,
    (r+1)·n) of the vocabulary padded to n·t; padding never wins), the same on every rank.
    Ties go to the lowest id, as torch.argmax does. Never gather the full logits.

    Broken twin (bug `argmax_one_shard`): returns argmax over this rank's shard + r·n.
    Symptom: greedy generation differs per rank and from tp=1.
    """
    raise NotImplementedError("l15: fix the argmax; hint: tpedu.grading.hint('l15', 1)")


def kv_heads_of_rank(n_heads: int, n_kv_heads: int, tp: int, rank: int) -> list[int]:
    """The global KV heads `rank` needs: query heads [r·nq/t, (r+1)·nq/t) use KV head
    j // (nq/nkv) for query head j. tp <= nkv: the rank's nkv/t heads; tp > nkv: the ONE head
    its queries use (a replica). Assume nq % tp == 0 and (nkv % tp == 0 or tp % nkv == 0).

    Broken twin (bug `kv_wrong_replica`): for tp > nkv it returns [rank % nkv].
    Symptom: GQA model at tp > n_kv_heads: loss differs from tp=1 at step 0.
    """
    raise NotImplementedError("l15: fix the KV heads; hint: tpedu.grading.hint('l15', 1)")


def tp_groups(world: int, tp: int, pp: int = 1) -> list[list[int]]:
    """Every TP group of a (tp, pp, dp = world / (tp·pp)) layout with TP varying fastest:
    rank = tp_rank + tp·(pp_rank + pp·dp_rank). Groups in order of their first rank.
    Example: tp_groups(8, 2, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]].

    Broken twin (bug `seed_tp_groups`): groups ranks with the same tp_rank (the second seed).
    Symptom: at dp = pp = 1 every such group is a single rank, so each rank silently runs the
    unsharded model (right loss, no TP, no memory saved); once two data-parallel replicas exist,
    ranks with different batches are summed: wrong loss from step 0.
    """
    raise NotImplementedError("l15: fix the TP groups; hint: tpedu.grading.hint('l15', 1)")


def one_f_one_b(n_micro: int, n_stages: int, stage: int) -> list[tuple[str, int]]:
    """The 1F1B schedule of `stage`: [("F", mb) | ("B", mb), ...]. Warm-up: min(p-1-s, m)
    forwards; then alternately one forward and the backward of the oldest micro-batch in
    flight; then the remaining backwards.

    Broken twin (bug `pipeline_warmup_reversed`): counts the warm-up as min(s, m).
    Symptom: the pipeline hangs (stage 0 waits for a gradient, stage 1 for an activation).
    """
    raise NotImplementedError("l15: fix the warm-up; hint: tpedu.grading.hint('l15', 1)")
