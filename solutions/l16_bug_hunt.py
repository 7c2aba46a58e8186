"""Reference for exercises/l16_bug_hunt.py: for each case, the suspect that ran wrong, fixed."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from tpedu.comm import collectives
from tpedu.parallel.mesh import AXIS_NAMES
from tpedu.parallel.pipeline.schedules import Action
from tpedu.tp.attention import check_heads


def case_1() -> tuple[str, Callable]:
    """tp > n_kv_heads: rank r's query heads use KV head r // (t/nkv), not r mod nkv."""

    def local_heads(n_heads: int, n_kv_heads: int, tp: int, rank: int) -> tuple[list, list]:
        check_heads(n_heads, n_kv_heads, tp)
        if not 0 <= rank < tp:
            raise ValueError(f"rank must be in [0, tp={tp}), got {rank}")
        nq_r = n_heads // tp
        q = list(range(rank * nq_r, (rank + 1) * nq_r))
        if tp <= n_kv_heads:
            nkv_r = n_kv_heads // tp
            return q, list(range(rank * nkv_r, (rank + 1) * nkv_r))
        return q, [rank // (tp // n_kv_heads)]  # the fix: the head this rank's queries use

    return "local_heads", local_heads


def case_2() -> tuple[str, Callable]:
    """1F1B: stage s warms up with p-1-s forwards (the first stage the most), not s."""

    def one_f_one_b(n_micro: int, n_stages: int, stage: int) -> list[Action]:
        if n_micro < 1 or n_stages < 1 or not 0 <= stage < n_stages:
            raise ValueError(f"bad schedule: {n_micro} micro-batches, stage {stage}/{n_stages}")
        warm = min(n_stages - 1 - stage, n_micro)  # the fix: the stages after this one
        out: list[Action] = [("F", i) for i in range(warm)]
        for i in range(n_micro - warm):
            out += [("F", warm + i), ("B", i)]
        return out + [("B", i) for i in range(n_micro - warm, n_micro)]

    return "one_f_one_b", one_f_one_b


def case_3() -> tuple[str, Callable]:
    """The padding mask: every column whose global id is >= vocab_size, the first one too."""

    def mask_padding(logits_shard: torch.Tensor, start: int, vocab_size: int) -> torch.Tensor:
        n = logits_shard.shape[-1]
        if start + n <= vocab_size:
            return logits_shard
        cols = torch.arange(start, start + n, device=logits_shard.device)
        return logits_shard.masked_fill(cols >= vocab_size, float("-inf"))  # the fix: >=

    return "_mask_padding", mask_padding


def case_4() -> tuple[str, Callable]:
    """A group along an axis: fix every other coordinate, vary this one (the loops in order)."""

    def axis_groups(self: Any, axis: str) -> list[list[int]]:
        others = [a for a in reversed(AXIS_NAMES) if a != axis]  # slowest first
        groups = []
        for fixed in itertools.product(*(range(self.sizes[a]) for a in others)):
            coords = dict(zip(others, fixed, strict=True))
            groups.append([self.rank(**coords, **{axis: i}) for i in range(self.sizes[axis])])
        return groups

    return "Layout.axis_groups", axis_groups


def case_5() -> tuple[str, Callable]:
    """f's backward: the gradient is summed over the group (each rank has its shard's share)."""

    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()  # autograd may share the buffer: never in place
        collectives.all_reduce(grad, ctx.group)  # the fix
        return grad, None

    return "CopyToTPRegion.backward", backward


def case_6() -> tuple[str, Callable]:
    """Greedy decoding over vocab-sharded logits: every rank's best (value, id), then the best."""

    def vocab_parallel_argmax(
        logits_shard: torch.Tensor, vocab_size: int, group: dist.ProcessGroup | None = None
    ) -> torch.Tensor:
        start = dist.get_rank(group) * logits_shard.shape[-1]
        z = logits_shard.detach()
        cols = torch.arange(start, start + z.shape[-1], device=z.device)
        z = z.masked_fill(cols >= vocab_size, float("-inf"))  # padding never wins
        best, idx = z.max(dim=-1, keepdim=True)  # this shard's candidate, first on ties
        values = collectives.all_gather(best.contiguous(), group, dim=-1)  # [..., t]
        ids = collectives.all_gather((idx + start).contiguous(), group, dim=-1)
        winner = values.argmax(dim=-1, keepdim=True)  # first maximum: the lowest rank, lowest id
        return ids.gather(-1, winner).squeeze(-1)

    return "vocab_parallel_argmax", vocab_parallel_argmax
