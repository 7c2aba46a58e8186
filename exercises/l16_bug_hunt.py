"""Exercise l16: the bug hunt. Lesson 16 shows six mystery cases: a run of tpedu with one
function broken, the symptom a practitioner would see, and the check that fails.

Each function below is the correct version of one broken function. Match each case to the
function whose contract its symptom breaks (the docstrings state both), read the tpedu code the
case points at, and write the function here. `hunt.mystery(k, fix=pick("l16_bug_hunt"))` runs
case k's check with your function in place of the broken one (the reference's while yours still
raises NotImplementedError); `make grade` runs every case.

Communicate only through tpedu.comm.collectives (so the tests' tracer sees it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def copy_to_tp_region(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """f: x [...] -> x [...] (the same values). Forward: no communication. Backward: the
    gradient is all-reduced (summed) over `group`, exactly once per use.

    Symptom when this is wrong: the loss at step 0 equals tp=1's to rounding, yet gradients
    differ (by tens of percent) and the loss curve drifts away from tp=1's from step 1.
    """
    raise NotImplementedError("l16: fix f; hint: tpedu.grading.hint('l16', 1)")


def mask_padding(logits_shard: torch.Tensor, start: int, vocab_size: int) -> torch.Tensor:
    """logits_shard [..., n] holds global vocabulary columns [start, start + n); return it with
    every column whose global id is >= vocab_size (padding) set to -inf. No communication.

    Symptom when this is wrong: the loss is too high from step 0 whenever vocab_size % tp
    != 0, and exactly right when tp divides the vocabulary.
    """
    raise NotImplementedError("l16: fix the padding mask; hint: tpedu.grading.hint('l16', 1)")


def vocab_parallel_argmax(
    logits_shard: torch.Tensor, vocab_size: int, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The global argmax id [...] (int64) from this rank's logits [..., n] (columns [r·n,
    (r+1)·n) of the vocabulary padded to n·t; padding never wins), the same on every rank.
    Ties go to the lowest id, as torch.argmax does. Never gather the full logits.

    Symptom when this is wrong: training matches tp=1, but greedy decoding picks different
    tokens on each rank, none of them reliably tp=1's.
    """
    raise NotImplementedError("l16: fix the argmax; hint: tpedu.grading.hint('l16', 1)")


def kv_heads_of_rank(n_heads: int, n_kv_heads: int, tp: int, rank: int) -> list[int]:
    """The global KV heads `rank` needs: query heads [r·nq/t, (r+1)·nq/t) use KV head
    j // (nq/nkv) for query head j. tp <= nkv: the rank's nkv/t heads; tp > nkv: the ONE head
    its queries use (a replica). Assume nq % tp == 0 and (nkv % tp == 0 or tp % nkv == 0).

    Symptom when this is wrong: a grouped-query model matches tp=1 while tp <= n_kv_heads,
    and its loss differs from step 0 once tp > n_kv_heads.
    """
    raise NotImplementedError("l16: fix the KV heads; hint: tpedu.grading.hint('l16', 1)")


def tp_groups(world: int, tp: int, pp: int = 1) -> list[list[int]]:
    """Every TP group of a (tp, pp, dp = world / (tp·pp)) layout with TP varying fastest:
    rank = tp_rank + tp·(pp_rank + pp·dp_rank). Groups in order of their first rank.
    Example: tp_groups(8, 2, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]].

    Symptom when this is wrong: with dp = pp = 1 the loss is right but every rank keeps the
    whole model (nothing is sharded); with two data replicas the loss is wrong from step 0.
    """
    raise NotImplementedError("l16: fix the TP groups; hint: tpedu.grading.hint('l16', 1)")


def one_f_one_b(n_micro: int, n_stages: int, stage: int) -> list[tuple[str, int]]:
    """The 1F1B schedule of `stage`: [("F", mb) | ("B", mb), ...]. Warm-up: min(p-1-s, m)
    forwards; then alternately one forward and the backward of the oldest micro-batch in
    flight; then the remaining backwards.

    Symptom when this is wrong: the first step never finishes; with a receive timeout, each
    stage reports what it was waiting for.
    """
    raise NotImplementedError("l16: fix the warm-up; hint: tpedu.grading.hint('l16', 1)")
