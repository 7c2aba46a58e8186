"""Lesson 06: token embeddings under tensor parallelism: replicated, or split along the vocabulary.

A 50k × 4096 table is 204.8M parameters (seed §1.1). Two ways to hold it on t ranks:

    ReplicatedEmbedding      every rank keeps the whole [V, H] table; no communication at all.
                             The seed's advice: start here, it is simple and obviously correct.
    VocabParallelEmbedding   rank r keeps rows [r·Vp/t, (r+1)·Vp/t) of the table padded to Vp
                             rows (a multiple of t). Each rank looks up the ids it owns, writes
                             zeros for the others, and one all-reduce (f̄) sums the partial
                             results: forward 1 all-reduce of b·s·H elements, backward none.

    rank 0 rows [0, Vp/t)      ids 3 17 42 ...  ->  e3  0   0   ...
    rank 1 rows [Vp/t, Vp)     ids 3 17 42 ...  ->  0   e17 e42 ...
                                  all-reduce(sum) -> e3  e17 e42 ...  (on every rank)

Why the replicated table needs no gradient sync in TP: its input ids are the same on every
rank, and the gradient arriving from the first column-parallel layer was already all-reduced
by that layer's f, so every rank computes the same, complete weight gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpedu.comm import collectives
from tpedu.tp.operators import reduce_from_tp_region
from tpedu.tp.sequence_parallel import reduce_scatter_to_sp_region


def padded_vocab(vocab_size: int, tp: int) -> int:
    """The smallest multiple of `tp` that is >= vocab_size (50257 -> 50258 at tp=2, 50260 at 4)."""
    if vocab_size < 1 or tp < 1:
        raise ValueError(f"vocab_size and tp must be >= 1, got vocab_size={vocab_size}, tp={tp}")
    return -(-vocab_size // tp) * tp


def vocab_range(vocab_size: int, tp: int, rank: int) -> tuple[int, int]:
    """Rank `rank`'s vocabulary columns [start, end) in the padded vocabulary.

    Every rank owns Vp/t ids with Vp = padded_vocab(vocab_size, tp); ids >= vocab_size in that
    range are padding (they exist only so the shards are equal, as the collectives require).
    """
    if not 0 <= rank < tp:
        raise ValueError(f"rank must be in [0, tp={tp}), got {rank}")
    n = padded_vocab(vocab_size, tp) // tp
    return rank * n, (rank + 1) * n


def _check_ids(ids: torch.Tensor, vocab_size: int) -> None:
    if ids.device.type == "meta":  # shapes only, no values to check (lesson 13's dry run)
        return
    if ids.device.type == "cuda":  # int(ids.max()) would stall the GPU every forward
        ok = ((ids >= 0) & (ids < vocab_size)).all()
        torch._assert_async(ok, f"token ids must be in [0, {vocab_size})")
        return
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(
            f"token ids must be in [0, {vocab_size}), got min {int(ids.min())}, "
            f"max {int(ids.max())}; check the tokenizer's vocabulary size"
        )


class ReplicatedEmbedding(nn.Module):
    """A plain copy of the [V, H] table on each rank. ids [...] -> [..., H]. No communication."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.vocab_size = weight.shape[0]
        self.weight = nn.Parameter(weight.detach().clone())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        _check_ids(ids, self.vocab_size)
        return F.embedding(ids, self.weight)

    def dense_weight(self) -> torch.Tensor:
        """The full [V, H] table (already local; no communication)."""
        return self.weight.detach().clone()


class VocabParallelEmbedding(nn.Module):
    """The [V, H] table split by rows (vocabulary) over the group.

    .weight: [Vp/t, H], rows [r·Vp/t, (r+1)·Vp/t) of the table zero-padded to Vp rows.
    forward: ids [...] (the same on every rank) -> [..., H] (the same on every rank).
    Forward: 1 all-reduce of ids.numel()·H elements (f̄). Backward: none (the output gradient is
    already complete on every rank; each rank's lookup keeps only its own rows' share).
    """

    shard_kinds = {"weight": "vocab"}  # how the shard map stores it

    def __init__(self, weight: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.group = group
        t, r = dist.get_world_size(group), dist.get_rank(group)
        self.vocab_size, self.hidden = weight.shape
        self.padded_vocab = padded_vocab(self.vocab_size, t)
        self.start, self.end = vocab_range(self.vocab_size, t, r)
        local = torch.zeros(
            self.end - self.start, self.hidden, dtype=weight.dtype, device=weight.device
        )
        real = max(0, min(self.end, self.vocab_size) - self.start)  # rows that are not padding
        local[:real] = weight.detach()[self.start : self.start + real]
        self.weight = nn.Parameter(local)

    @classmethod
    def from_dense(
        cls, embedding: nn.Embedding, group: dist.ProcessGroup | None = None
    ) -> VocabParallelEmbedding:
        return cls(embedding.weight, group)

    def forward(self, ids: torch.Tensor, sequence_parallel: bool = False) -> torch.Tensor:
        """ids [b, s] -> [b, s, H]; sequence_parallel: -> this rank's positions [b, s/t, H].

        With sequence parallelism the partial lookups are reduce-scattered along the sequence
        (as Megatron-LM does) instead of all-reduced and then cut: half the bytes on the wire,
        the same result. Backward: 1 all-gather of the gradient.
        """
        _check_ids(ids, self.vocab_size)
        foreign = (ids < self.start) | (ids >= self.end)
        # Foreign ids look up row 0 (any valid row) and are zeroed: the owner supplies them.
        local_ids = (ids - self.start).masked_fill(foreign, 0)
        partial = F.embedding(local_ids, self.weight).masked_fill(foreign.unsqueeze(-1), 0.0)
        if sequence_parallel:
            return reduce_scatter_to_sp_region(partial, self.group)
        return reduce_from_tp_region(partial, self.group)

    def dense_weight(self) -> torch.Tensor:
        """The full [V, H] table (1 all-gather along the vocabulary; padding dropped)."""
        full = collectives.all_gather(self.weight.detach().contiguous(), self.group, dim=0)
        return full[: self.vocab_size]

    def dense_grad(self) -> torch.Tensor:
        """The weight gradient in dense layout [V, H] (1 all-gather; padding rows dropped)."""
        full = collectives.all_gather(self.weight.grad.contiguous(), self.group, dim=0)
        return full[: self.vocab_size]
