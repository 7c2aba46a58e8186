"""Lesson 04: the tensor-parallel MLP: column-parallel fc1, elementwise activation, row-parallel
fc2.

    x [..., H] ─f─► fc1 (column, [F/t, H]) ─► act ─► [dropout] ─► fc2 (row, [H, F/t]) ─f̄─► + b ─► y [..., H]
       replicated       hidden [..., F/t] stays on its rank: no communication      replicated

Forward: exactly 1 all-reduce of y ([..., H], the f̄ inside fc2).
Backward: exactly 1 all-reduce of dL/dx ([..., H], the f in front of fc1).
That is seed §2.2's point: GeLU is elementwise, so the column layer's sharded output is exactly
the row layer's sharded input and nothing moves in between. Column+column would all-gather the
hidden activation ([..., F], 4x larger) and row+row would need it scattered; both cost more.

SwiGLU (`ParallelMLP.swiglu`): gate and up are both column-parallel with the SAME row split, so
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
        fc1: nn.Linear,
        fc2: nn.Linear,
        group: dist.ProcessGroup | None = None,
        activation: str = "gelu",
        hidden_dropout: float = 0.0,
        output_dropout: float = 0.0,
        seed: int = 0,
        up: nn.Linear | None = None,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        check_activation(activation)
        if (activation == "swiglu") != (up is not None):
            raise ValueError(
                "activation='swiglu' needs the `up` projection (and only it does); "
                "use ParallelMLP.swiglu(gate, up, down, group)"
            )
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
        self.hidden_dropout, self.output_dropout, self.seed = hidden_dropout, output_dropout, seed
        self.sequence_parallel = sequence_parallel
        self.fc1 = ColumnParallelLinear(
            fc1.weight, fc1.bias, group, sequence_parallel=sequence_parallel
        )
        self.up = ColumnParallelLinear.from_dense(up, group) if up is not None else None
        self.fc2 = RowParallelLinear(
            fc2.weight, fc2.bias, group, sequence_parallel=sequence_parallel
        )

    @classmethod
    def swiglu(
        cls,
        gate: nn.Linear,
        up: nn.Linear,
        down: nn.Linear,
        group: dist.ProcessGroup | None = None,
        **kwargs: float,
    ) -> ParallelMLP:
        """down(silu(gate(x)) · up(x)) with gate, up column-parallel and down row-parallel."""
        return cls(gate, down, group, activation="swiglu", up=up, **kwargs)

    @classmethod
    def from_dense(
        cls,
        dense: DenseMLP,
        group: dist.ProcessGroup | None = None,
        sequence_parallel: bool = False,
    ) -> ParallelMLP:
        """Shard a DenseMLP (same weights on every rank); keeps its activation and dropout."""
        return cls(
            dense.fc1,
            dense.fc2,
            group,
            dense.activation,
            dense.hidden_dropout,
            dense.output_dropout,
            dense.seed,
            up=dense.up,
            sequence_parallel=sequence_parallel,
        )

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
