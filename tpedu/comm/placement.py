"""Lessons 14–18: where each parameter lives, a placement per parameter per mesh axis, declared
by the module that creates the parameter and read by everything that must know it.

    placement     on axis a, rank i of n holds            its gradient is reduced over a by
    Replicate()   all of it (a copy on every rank)        a sum (or mean) over the axis's group
    Shard(dim)    its 1/n slice along `dim`               nothing: each rank's slice is its own

The names and shapes are DTensor's (`torch.distributed.tensor.Shard(dim)`, `Replicate()`), so a
reader who knows DTensor reads `{"tp": Shard(0), "ep": Shard(0)}` at once. What this does not
do that DTensor does: the parameter stays a plain tensor holding the local piece (no wrapper
subclass, no operator dispatch, no automatic redistribution); a placement is a declaration
that the gradient reduction, the gradient norm and the checkpoint writer read. An axis a
parameter's declaration does not name is Replicate().

Who declares what:
  tp  each tensor-parallel module's `shard_kinds` (tpedu.model.state): column -> Shard(0),
      row -> Shard(1), qkv and vocab -> Shard(0) by heads or rows, replicated -> Replicate();
  ep  ExpertParallelMoE's `placements`: its experts stacked along a new dim 0 are Shard(0) over
      the EP group (rank i holds experts i·E/ep ...); its router and shared expert Replicate().
A module declares with a class attribute or method `placements` -> {name relative to the
module, or a prefix ending in "." for a whole child: {axis: placement}}.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class Shard:
    """Split along dimension `dim` over the axis: rank i holds the i-th of n slices."""

    dim: int


@dataclass(frozen=True)
class Replicate:
    """A whole copy on every rank of the axis."""


Placement = Shard | Replicate
Placements = dict[str, Placement]  # mesh axis ("tp", "ep", ...) -> placement


def declared(model: nn.Module) -> dict[str, Placements]:
    """{parameter name in `model`: the placements its modules declare}, for every parameter.
    An axis nobody declares is left out (it is Replicate()). No communication."""
    out: dict[str, Placements] = {name: {} for name, _ in model.named_parameters()}
    for owner, module in model.named_modules():
        table = getattr(module, "placements", None)
        if table is None:
            continue
        table = table() if callable(table) else table
        prefix = f"{owner}." if owner else ""
        for key, axes in table.items():
            for name in out:
                if name == prefix + key or (key.endswith(".") and name.startswith(prefix + key)):
                    out[name].update(axes)
    return out


def placement(placements: Placements, axis: str) -> Placement:
    """The placement on `axis` (Replicate() where none is declared)."""
    return placements.get(axis, Replicate())


def sharded_on(placements: Placements, axis: str) -> bool:
    """Whether a parameter with these placements is split over `axis` (not a copy)."""
    return isinstance(placement(placements, axis), Shard)


def split_over(model: nn.Module, axis: str) -> set[str]:
    """Names of `model`'s parameters split over `axis` (e.g. "ep": the experts' parameters)."""
    return {name for name, where in declared(model).items() if sharded_on(where, axis)}
