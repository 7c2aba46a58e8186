"""Lesson 04: column- and row-parallel linear layers (seed §2.1, §4.2), built from a dense weight.

Weights follow nn.Linear: weight [out, in], y = x·Wᵀ + b. With t = tp size and r = tp rank:

    ColumnParallelLinear   W split by rows (output features)   weight [out/t, in]   bias [out/t]
        x [..., in] (replicated) -> y [..., out/t] (this rank's output columns)
        forward: 0 collectives (1 all-gather if gather_output); backward: 1 all-reduce of x's size

    RowParallelLinear      W split by columns (input features) weight [out, in/t]   bias [out]
        x [..., in/t] (this rank's input columns) -> y [..., out] (replicated)
        forward: 1 all-reduce of y's size; backward: 0 collectives

Column then row is the Megatron pattern: the column layer's sharded output is exactly the row
layer's sharded input, so nothing moves in between (lesson 04).

sequence_parallel=True (lesson 08): the column layer takes this rank's sequence shard
[b, s/t, in] and all-gathers it (backward: reduce-scatter), the row layer reduce-scatters its
output to [b, s/t, out] instead of all-reducing it (backward: all-gather). See
tpedu/tp/sequence_parallel.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpedu.tp.operators import (
    copy_to_tp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    scatter_to_tp_region,
)
from tpedu.tp.overlap import linear_with_async_grad_all_reduce
from tpedu.tp.sequence_parallel import all_gather_linear, reduce_scatter_to_sp_region
from tpedu.tp.sharding import check_divisible, shard, unshard


def column_parallel_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: dist.ProcessGroup | None = None,
    gather_output: bool = False,
    async_grad_all_reduce: bool = False,
) -> torch.Tensor:
    """y_r = x·W_rᵀ + b_r with this rank's row shard W_r of the dense weight.

    x [..., in] (same on every rank), weight [out/t, in], bias [out/t] or None
    -> [..., out/t] (or [..., out] if gather_output).
    Forward: no communication (+1 all-gather if gather_output). Backward: 1 all-reduce of dL/dx
    (f = copy_to_tp_region), since every rank's shard contributes to x's gradient.
    async_grad_all_reduce: the same arithmetic, with that all-reduce overlapped with dL/dW
    (tpedu.tp.overlap, lesson 15).
    """
    if async_grad_all_reduce:
        y = linear_with_async_grad_all_reduce(x, weight, bias, group)
    else:
        y = F.linear(copy_to_tp_region(x, group), weight, bias)
    return gather_from_tp_region(y, group) if gather_output else y


def row_parallel_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: dist.ProcessGroup | None = None,
    sequence_parallel: bool = False,
) -> torch.Tensor:
    """y = Σ_r x_r·W_rᵀ + b with this rank's column shard W_r and input shard x_r.

    x [..., in/t] (this rank's chunk of the input features), weight [out, in/t],
    bias [out] or None (full, the same on every rank) -> [..., out] (the same on every rank).
    Forward: 1 all-reduce of the partial sums (f̄ = reduce_from_tp_region). Backward: none.
    The bias is added once, AFTER the all-reduce: added before, it would be summed t times.
    sequence_parallel: x [b, s, in/t] -> [b, s/t, out] (this rank's positions); forward
    1 reduce-scatter instead of the all-reduce, backward 1 all-gather. The bias then meets only
    a sequence shard: its gradient must be all-reduced after backward.
    """
    if sequence_parallel:
        y = reduce_scatter_to_sp_region(F.linear(x, weight), group)
    else:
        y = reduce_from_tp_region(F.linear(x, weight), group)
    return y + bias if bias is not None else y


def _check_weight(weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if weight.dim() != 2:
        raise ValueError(
            f"weight must be 2-D [out, in] (nn.Linear layout), got {tuple(weight.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(
            f"bias must have shape [out] = ({weight.shape[0]},) for a weight of shape "
            f"{tuple(weight.shape)}, got {tuple(bias.shape)}"
        )


class ColumnParallelLinear(nn.Module):
    """Linear layer split along its output features; see `column_parallel_linear`.

    Built from the dense weight [out, in] and bias [out]: rank r keeps rows
    [r·out/t, (r+1)·out/t). `.weight` [out/t, in], `.bias` [out/t].

    `row_order` (a permutation of range(out), optional) takes the dense rows in that order before
    sharding: rank r then holds dense output features row_order[r·out/t : (r+1)·out/t] (e.g. to
    give each rank whole heads of a fused matrix). `dense_weight()` and a gathered output
    (gather_output=True) undo it, so they are always in the dense order.
    """

    shard_kinds = {"weight": "column", "bias": "column"}  # how the shard map stores them

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        group: dist.ProcessGroup | None = None,
        gather_output: bool = False,
        row_order: torch.Tensor | Sequence[int] | None = None,
        sequence_parallel: bool = False,
        async_grad_all_reduce: bool = False,
    ) -> None:
        super().__init__()
        _check_weight(weight, bias)
        if sequence_parallel and gather_output:
            raise ValueError("sequence_parallel and gather_output cannot be combined")
        self.group = group
        self.sequence_parallel = sequence_parallel  # input [b, s/t, in]: all-gather it first
        self.gather_output = gather_output
        self.async_grad_all_reduce = async_grad_all_reduce  # overlap f's backward (lesson 15)
        self.tp = dist.get_world_size(group)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        check_divisible(self.out_features, self.tp, "out_features of ColumnParallelLinear")
        # Buffers, not attributes, so .to(device) moves them with the weight; not in state_dict.
        self.register_buffer("row_order", None, persistent=False)
        self.register_buffer("inverse_order", None, persistent=False)
        if row_order is not None:
            order = torch.as_tensor(row_order, dtype=torch.long, device=weight.device)
            if not torch.equal(
                order.sort().values, torch.arange(self.out_features, device=order.device)
            ):
                raise ValueError(f"row_order must be a permutation of range({self.out_features})")
            self.row_order, self.inverse_order = order, order.argsort()
            weight = weight.detach().index_select(0, order)
            bias = bias.detach().index_select(0, order) if bias is not None else None
        self.weight = nn.Parameter(shard(weight, 0, group))
        self.bias = nn.Parameter(shard(bias, 0, group)) if bias is not None else None

    @classmethod
    def from_dense(
        cls,
        linear: nn.Linear,
        group: dist.ProcessGroup | None = None,
        gather_output: bool = False,
    ) -> ColumnParallelLinear:
        """Shard an nn.Linear (the same on every rank) by output features."""
        return cls(linear.weight, linear.bias, group, gather_output)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out/t] ([..., out] if gather_output).

        sequence_parallel: x [b, s/t, in] -> [b, s, out/t] (1 all-gather forward; backward
        1 all-gather and 1 reduce-scatter, see all_gather_linear).
        """
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"ColumnParallelLinear expects the full input [..., {self.in_features}], "
                f"got {tuple(x.shape)}"
            )
        if self.sequence_parallel:
            return all_gather_linear(x, [self.weight], [self.bias], self.group)[0]
        y = column_parallel_linear(
            x, self.weight, self.bias, self.group, self.gather_output, self.async_grad_all_reduce
        )
        if self.gather_output and self.inverse_order is not None:
            y = y.index_select(-1, self.inverse_order)  # back to the dense feature order
        return y

    def _dense_order(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        return full if self.inverse_order is None else full.index_select(dim, self.inverse_order)

    def dense_weight(self, grad: bool = False) -> torch.Tensor:
        """The dense weight [out, in] (or its gradient if grad=True); 1 all-gather."""
        return self._dense_order(
            unshard(self.weight.grad if grad else self.weight, 0, self.group), 0
        )

    def dense_bias(self, grad: bool = False) -> torch.Tensor | None:
        """The dense bias [out] (or its gradient); 1 all-gather; None without bias."""
        if self.bias is None:
            return None
        return self._dense_order(unshard(self.bias.grad if grad else self.bias, 0, self.group), 0)

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, tp={self.tp}, "
            f"local weight={tuple(self.weight.shape)}, gather_output={self.gather_output}"
        )


class RowParallelLinear(nn.Module):
    """Linear layer split along its input features; see `row_parallel_linear`.

    Built from the dense weight [out, in] and bias [out]: rank r keeps weight columns
    [r·in/t, (r+1)·in/t). `.weight` [out, in/t], `.bias` [out] (replicated, added once after the
    all-reduce). If `input_is_parallel` is False the layer takes the full input [..., in] and
    keeps its own chunk first (scatter_to_tp_region: backward all-gathers the gradient).
    """

    # the bias is added after the sum, the same on every rank: replicated
    shard_kinds = {"weight": "row", "bias": "replicated"}

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        group: dist.ProcessGroup | None = None,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        _check_weight(weight, bias)
        self.group = group
        self.sequence_parallel = sequence_parallel  # output [b, s/t, out]: reduce-scatter
        self.input_is_parallel = input_is_parallel
        self.tp = dist.get_world_size(group)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        check_divisible(self.in_features, self.tp, "in_features of RowParallelLinear")
        self.weight = nn.Parameter(shard(weight, 1, group))
        self.bias = nn.Parameter(bias.detach().clone()) if bias is not None else None

    @classmethod
    def from_dense(
        cls,
        linear: nn.Linear,
        group: dist.ProcessGroup | None = None,
        input_is_parallel: bool = True,
    ) -> RowParallelLinear:
        """Shard an nn.Linear (the same on every rank) by input features."""
        return cls(linear.weight, linear.bias, group, input_is_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in/t] ([..., in] if not input_is_parallel) -> [..., out]."""
        want = self.in_features // self.tp if self.input_is_parallel else self.in_features
        if x.shape[-1] != want:
            kind = "this rank's input shard" if self.input_is_parallel else "the full input"
            raise ValueError(
                f"RowParallelLinear (in={self.in_features}, tp={self.tp}) expects {kind} "
                f"[..., {want}], got {tuple(x.shape)}"
            )
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.group)
        return row_parallel_linear(x, self.weight, self.bias, self.group, self.sequence_parallel)

    def dense_weight(self, grad: bool = False) -> torch.Tensor:
        """The dense weight [out, in] (or its gradient if grad=True); 1 all-gather."""
        return unshard(self.weight.grad if grad else self.weight, 1, self.group)

    def dense_bias(self, grad: bool = False) -> torch.Tensor | None:
        """The dense bias [out] (or its gradient): already full on every rank, no communication."""
        if self.bias is None:
            return None
        return (self.bias.grad if grad else self.bias).detach().clone()

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, tp={self.tp}, "
            f"local weight={tuple(self.weight.shape)}, input_is_parallel={self.input_is_parallel}"
        )
