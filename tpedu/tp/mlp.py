"""Lesson 04: the tensor-parallel MLP: column-parallel fc1, elementwise activation, row-parallel
fc2.

    x [..., H] ─f─► fc1 (column, [F/t, H]) ─► act ─► [dropout] ─► fc2 (row, [H, F/t]) ─f̄─► + b ─► y [..., H]
       replicated       hidden [..., F/t] stays on its rank: no communication      replicated

Forward: exactly 1 all-reduce of y ([..., H], the f̄ inside fc2).
Backward: exactly 1 all-reduce of dL/dx ([..., H], the f in front of fc1).
That is seed §2.2's point: GeLU is elementwise, so the column layer's sharded output is exactly
the row layer's sharded input and nothing moves in between. Column+column would all-gather the
hidden activation ([..., F], 4x larger) and row+row would need it scattered; both cost more.

SwiGLU (a DenseMLP with activation "swiglu"): gate and up are both column-parallel with the SAME row split, so
silu(gate)·up is still elementwise per rank; both share one f, so backward still all-reduces once.

sequence_parallel=True (lesson 08): x is this rank's sequence shard [b, s/t, H]; the f becomes
one all-gather fused with fc1 (and up), fc2 reduce-scatters to [b, s/t, H], and the output
dropout draws the shard's slice of the dense mask.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpedu.tp.dense import (
    ACTIVATIONS,
    HIDDEN_DROPOUT_SITE,
    OUTPUT_DROPOUT_SITE,
    DenseMLP,
    check_activation,
)
from tpedu.tp.dropout import derive_seed, index_dropout
from tpedu.tp.layers import ColumnParallelLinear, RowParallelLinear
from tpedu.tp.operators import copy_to_tp_region
from tpedu.tp.sequence_parallel import all_gather_linear, sequence_dropout
from tpedu.tp.sharding import check_divisible


class ParallelMLP(nn.Module):
    """Megatron MLP over a TP group, built from the dense layers (the same on every rank).

    fc1: nn.Linear(H, F) -> ColumnParallelLinear, weight [F/t, H], bias [F/t]
    fc2: nn.Linear(F, H) -> RowParallelLinear,    weight [H, F/t], bias [H] (replicated)
    x [..., H] (replicated) -> y [..., H] (replicated). 1 all-reduce forward, 1 backward.
    Dropout (index_dropout) on the hidden activation uses this rank's global column offset, and
    on the output offsets 0, so masks equal DenseMLP's with the same seed and step.
    """

    def __init__(
        self,
        dense: DenseMLP,
        group: dist.ProcessGroup | None = None,
        *,
        sequence_parallel: bool = False,
        overlap_comm: bool = False,
    ) -> None:
        super().__init__()
        fc1, fc2, up, activation = dense.fc1, dense.fc2, dense.up, dense.activation
        check_activation(activation)
        if (activation == "swiglu") != (up is not None):
            raise ValueError("activation='swiglu' needs the `up` projection (and only it does)")
        hidden, ffn = fc1.in_features, fc1.out_features
        if (fc2.in_features, fc2.out_features) != (ffn, hidden) or (
            up is not None and (up.in_features, up.out_features) != (hidden, ffn)
        ):
            raise ValueError(
                f"MLP shapes do not chain: fc1 {hidden}->{ffn}, fc2 "
                f"{fc2.in_features}->{fc2.out_features}"
                + (f", up {up.in_features}->{up.out_features}" if up is not None else "")
                + f"; expected fc2 {ffn}->{hidden}"
            )
        self.group = group
        self.tp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        check_divisible(ffn, self.tp, "ffn_hidden (fc1.out_features)")
        self.hidden, self.ffn_hidden, self.activation = hidden, ffn, activation
        self.hidden_dropout, self.output_dropout = dense.hidden_dropout, dense.output_dropout
        self.seed, self.sequence_parallel = dense.seed, sequence_parallel
        # overlap: bitwise the same results, only backward's timeline changes (SwiGLU's shared f
        # and sequence parallelism keep their own paths)
        self.fc1 = ColumnParallelLinear(
            fc1.weight,
            fc1.bias,
            group,
            sequence_parallel=sequence_parallel,
            async_grad_all_reduce=overlap_comm,
        )
        self.up = ColumnParallelLinear.from_dense(up, group) if up is not None else None
        self.fc2 = RowParallelLinear(
            fc2.weight, fc2.bias, group, sequence_parallel=sequence_parallel
        )

    @classmethod
    def from_dense(
        cls, dense: DenseMLP, group: dist.ProcessGroup | None = None, **options: bool
    ) -> ParallelMLP:
        """Shard a DenseMLP (same weights on every rank); keeps its activation and dropout.
        `options`: the constructor's keyword arguments."""
        return cls(dense, group, **options)

    def forward(self, x: torch.Tensor, step: int = 0) -> torch.Tensor:
        """x [..., H] -> [..., H]; `step` selects this step's dropout masks.

        sequence_parallel: x [b, s/t, H] -> [b, s/t, H].
        """
        if self.up is None:
            h = ACTIVATIONS[self.activation](self.fc1(x))  # [..., F/t], no communication
        elif self.sequence_parallel:  # one all-gather feeds both projections
            gate, up = all_gather_linear(
                x, [self.fc1.weight, self.up.weight], [self.fc1.bias, self.up.bias], self.group
            )
            h = F.silu(gate) * up
        else:
            # One f for both projections: two would all-reduce dL/dx twice in backward.
            x = copy_to_tp_region(x, self.group)
            gate = F.linear(x, self.fc1.weight, self.fc1.bias)
            h = F.silu(gate) * F.linear(x, self.up.weight, self.up.bias)
        if self.training and self.hidden_dropout > 0:
            n = self.ffn_hidden // self.tp
            h = index_dropout(
                h,
                self.hidden_dropout,
                derive_seed(self.seed, HIDDEN_DROPOUT_SITE, step),
                global_shape=(*h.shape[:-1], self.ffn_hidden),
                offsets=(*[0] * (h.dim() - 1), self.rank * n),  # this rank's dense columns
            )
        y = self.fc2(h)  # 1 all-reduce (SP: reduce-scatter), then the bias once
        seed = derive_seed(self.seed, OUTPUT_DROPOUT_SITE, step)
        if self.sequence_parallel:
            return sequence_dropout(y, self.output_dropout, seed, self.group, self.training)
        return index_dropout(y, self.output_dropout, seed, training=self.training)

    def extra_repr(self) -> str:
        return (
            f"hidden={self.hidden}, ffn_hidden={self.ffn_hidden}, tp={self.tp}, "
            f"activation={self.activation!r}"
        )
