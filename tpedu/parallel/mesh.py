"""Lesson 13: the device mesh: which global ranks form each TP, CP, PP and DP group.

A layout (tp, pp, dp) puts world = tp·pp·dp ranks on a grid; context parallelism adds a fourth
axis, cp (default 1). TP varies fastest, then CP, then PP, then DP:

    rank = tp_rank + tp · (cp_rank + cp · (pp_rank + pp · dp_rank))

so the tp ranks of one TP group are consecutive global ranks: on a cluster they sit in one node
(TP all-reduces run in every layer, forward and backward, and need the fastest links). CP comes
next: its ring passes K/V chunks in every attention layer, forward and backward, less often than
TP's all-reduces but far more than PP's point-to-point between neighbouring stages or DP's one
gradient reduction per step, which cross nodes.

Groups:
    tp   ranks that differ only in tp_rank (one pipeline stage of one replica)
    cp   ranks that differ only in cp_rank (the sequence's chunks of one stage: their gradients
         are summed, as each saw only its positions)
    pp   ranks that differ only in pp_rank (one pipeline: stage 0 → stage pp-1)
    dp   ranks that differ only in dp_rank (replicas of the same shard: gradients are averaged)
    emb  the first and last stage of one pipeline (same tp_rank, dp_rank), when pp > 1: the
         tied embedding's two copies have their gradients summed over it

`torch.distributed.new_group` is collective over the WHOLE world: every rank must create every
group, in the same order, even the groups it is not in. `Mesh` does exactly that.

The second seed builds its "TP group" as `[r for r in range(world) if r % tp == tp_rank]`: those
are the ranks with the same tp_rank, i.e. a DP group (at pp = 1), not a TP group. `seed_tp_group`
reproduces it so lesson 13 can show the difference.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist

from tpedu.comm import collectives
from tpedu.tp.sharding import divisors

if TYPE_CHECKING:
    import ipywidgets
    from matplotlib.axes import Axes


@dataclass(frozen=True)
class Layout:
    """A (tp, pp, dp) layout (and cp) of tp·cp·pp·dp ranks; TP varies fastest, then CP, PP, DP."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "cp"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def check_world(self, world: int) -> None:
        """Raise a ValueError if this layout does not use exactly `world` ranks."""
        if self.world != world:
            sizes = f"{self.tp}·{self.pp}·{self.dp}" + (f"·{self.cp}" if self.cp > 1 else "")
            raise ValueError(
                f"tp·pp·dp{'·cp' if self.cp > 1 else ''} = {sizes} = {self.world} does not "
                f"match the world size {world}; choose sizes whose product is {world} "
                f"(each a divisor of it: {', '.join(map(str, divisors(world)))})"
            )

    def coords(self, rank: int) -> tuple[int, int, int]:
        """Global rank -> (tp_rank, pp_rank, dp_rank) (its cp_rank: `cp_rank(rank)`)."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside [0, {self.world})")
        rest = rank // (self.tp * self.cp)
        return rank % self.tp, rest % self.pp, rest // self.pp

    def cp_rank(self, rank: int) -> int:
        """Global rank -> its position in its CP group."""
        return (rank // self.tp) % self.cp

    def rank(self, tp_rank: int, pp_rank: int, dp_rank: int, cp_rank: int = 0) -> int:
        """(tp_rank, pp_rank, dp_rank, cp_rank) -> global rank."""
        return tp_rank + self.tp * (cp_rank + self.cp * (pp_rank + self.pp * dp_rank))

    def _groups(self, axis: str) -> list[list[int]]:
        """Every group along `axis` (the ranks that differ only there), in a fixed order."""
        sizes = {"tp": self.tp, "cp": self.cp, "pp": self.pp, "dp": self.dp}
        others = [a for a in ("dp", "pp", "cp", "tp") if a != axis]  # slowest first
        out = []
        for fixed in itertools.product(*(range(sizes[a]) for a in others)):
            at = dict(zip(others, fixed, strict=True))
            out.append(
                [
                    self.rank(**{f"{a}_rank": at.get(a, i) for a in sizes})
                    for i in range(sizes[axis])
                ]
            )
        return out

    def tp_groups(self) -> list[list[int]]:
        """Every TP group (consecutive ranks), in a fixed order."""
        return self._groups("tp")

    def cp_groups(self) -> list[list[int]]:
        """Every CP group (one per TP rank of each stage of each replica), in a fixed order."""
        return self._groups("cp")

    def pp_groups(self) -> list[list[int]]:
        """Every pipeline (stage 0 first), in a fixed order."""
        return self._groups("pp")

    def dp_groups(self) -> list[list[int]]:
        """Every set of replicas of one shard, in a fixed order."""
        return self._groups("dp")

    def emb_groups(self) -> list[list[int]]:
        """[first stage, last stage] of every pipeline (empty when pp = 1: nothing to tie)."""
        return [[g[0], g[-1]] for g in self.pp_groups()] if self.pp > 1 else []

    def groups(self) -> dict[str, list[list[int]]]:
        """{'tp': ..., 'pp': ..., 'dp': ..., 'emb': ...} (and 'cp' when cp > 1): every group of
        every kind."""
        out = {
            "tp": self.tp_groups(),
            "pp": self.pp_groups(),
            "dp": self.dp_groups(),
            "emb": self.emb_groups(),
        }
        return out | ({"cp": self.cp_groups()} if self.cp > 1 else {})


def rank_groups(tp: int, pp: int, dp: int) -> dict[str, list[list[int]]]:
    """Every TP, PP, DP and emb group of a (tp, pp, dp) layout, as lists of global ranks."""
    return Layout(tp, pp, dp).groups()


def seed_tp_group(world: int, tp: int, rank: int) -> list[int]:
    """The second seed's 'TP group' for `rank`: ranks with the same tp_rank (a DP group at
    pp = 1; with pp > 1 it also spans stages). Never a TP group."""
    tp_rank = rank % tp
    return [r for r in range(world) if r % tp == tp_rank]


class Mesh:
    """This rank's view of a layout: its coordinates and its TP, PP, DP (and emb) groups.

    Must be constructed on every rank of the world (it calls `dist.new_group` for every group,
    in the same order everywhere). A group of one rank still exists (a size-1 all-reduce is a
    no-op), so code can use every group unconditionally.
    """

    def __init__(self, layout: Layout) -> None:
        layout.check_world(dist.get_world_size())
        self.layout = layout
        self.rank = dist.get_rank()
        self.tp_rank, self.pp_rank, self.dp_rank = layout.coords(self.rank)
        self.cp_rank = layout.cp_rank(self.rank)
        self.groups: dict[str, dist.ProcessGroup] = {}
        self.members: dict[str, list[int]] = {}
        # Gradients travel backwards on their own group (channel), so an activation and a
        # gradient between the same two ranks (pp = 2, interleaved) can never be confused. The
        # interleaved schedule's wrap-around edge (last stage -> first, to the next chunk) gets
        # its own groups too: at pp = 2 it runs opposite to the 0 -> 1 edge, and two ranks
        # sending to each other on one NCCL communicator can each wait for the other forever.
        pp = layout.pp_groups()
        kinds = {"cp": [], **layout.groups(), "pp_grad": pp, "pp_wrap": pp, "pp_grad_wrap": pp}
        for kind in ("tp", "pp", "pp_grad", "pp_wrap", "pp_grad_wrap", "dp", "emb", "cp"):
            for ranks in kinds[kind]:
                g = dist.new_group(ranks)  # collective: every rank, every group, same order
                if self.rank in ranks:
                    name = "pp" if kind.startswith("pp") else kind
                    self.groups[kind] = collectives.name_group(g, name)
                    self.members[kind] = ranks
        for kind in ("emb", "cp"):  # none: no tied copies to sum, no context parallelism
            self.groups.setdefault(kind, None)
            self.members.setdefault(kind, [])

    tp_group = property(lambda self: self.groups["tp"])
    pp_group = property(lambda self: self.groups["pp"])
    dp_group = property(lambda self: self.groups["dp"])
    emb_group = property(lambda self: self.groups["emb"])
    cp_group = property(lambda self: self.groups["cp"])

    def __repr__(self) -> str:
        lay = self.layout
        return (
            f"Mesh(rank {self.rank}: tp {self.tp_rank}/{lay.tp}, pp {self.pp_rank}/{lay.pp}, "
            f"dp {self.dp_rank}/{lay.dp}"
            + (f", cp {self.cp_rank}/{lay.cp}" if lay.cp > 1 else "")
            + ")"
        )


# ---------------------------------------------------------------------------------- pictures


def draw_layout(
    layout: Layout, gpus_per_node: int = 8, highlight: int = 0, ax: Axes | None = None
) -> Axes:
    """Draw the rank grid: one square per rank, grouped into nodes; `highlight`'s groups outlined.

    Columns are tp ranks within a stage (×pp stages), rows are dp replicas. Returns the axes.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    cols, rows = layout.tp * layout.pp, layout.dp
    if ax is None:
        _, ax = plt.subplots(figsize=(min(14, 1.0 + 0.55 * cols), min(9, 1.0 + 0.55 * rows)))
    colors = plt.get_cmap("tab20")
    members = {k: next((g for g in gs if highlight in g), []) for k, gs in layout.groups().items()}
    for r in range(layout.world):
        t, p, d = layout.coords(r)
        x, y = p * layout.tp + t, rows - 1 - d
        node = r // gpus_per_node
        ax.add_patch(Rectangle((x + 0.05, y + 0.05), 0.9, 0.9, color=colors(node % 20), alpha=0.55))
        ax.text(x + 0.5, y + 0.5, str(r), ha="center", va="center", fontsize=7)
    styles = {"tp": ("red", 2.5), "pp": ("blue", 1.8), "dp": ("green", 1.2)}
    for kind, (color, width) in styles.items():
        for r in members[kind]:
            t, p, d = layout.coords(r)
            x, y = p * layout.tp + t, rows - 1 - d
            ax.add_patch(
                Rectangle(
                    (x + 0.05, y + 0.05), 0.9, 0.9, fill=False, edgecolor=color, linewidth=width
                )
            )
    for p in range(1, layout.pp):
        ax.axvline(p * layout.tp, color="black", linewidth=1.5)
    ax.set_xlim(0, cols)
    ax.set_ylim(0, rows)
    ax.set_xticks([p * layout.tp + layout.tp / 2 for p in range(layout.pp)])
    ax.set_xticklabels([f"stage {p}" for p in range(layout.pp)])
    ax.set_yticks([rows - 1 - d + 0.5 for d in range(rows)])
    ax.set_yticklabels([f"dp {d}" for d in range(rows)])
    ax.set_aspect("equal")
    nodes = -(-layout.world // gpus_per_node)
    ax.set_title(
        f"tp={layout.tp} pp={layout.pp} dp={layout.dp}: {layout.world} ranks on {nodes} "
        f"node(s) of {gpus_per_node} (colour = node); rank {highlight}: "
        "red TP, blue PP, green DP",
        fontsize=9,
    )
    return ax


def _default_size(world: int) -> int:
    return 4 if world % 4 == 0 else 1  # the widget's first tp and pp


def show_layout(world: int, gpus_per_node: int, tp: int, pp: int, rank: int) -> None:
    """What `layout_widget` shows for these choices: the grid (`draw_layout`) and the groups of
    `rank`; tp·pp that does not divide world prints that instead."""
    import matplotlib.pyplot as plt

    if world % (tp * pp):
        print(f"tp·pp = {tp * pp} does not divide {world}")
        return
    lay = Layout(tp, pp, world // (tp * pp))
    draw_layout(lay, gpus_per_node, rank)
    plt.show()
    for kind, groups in lay.groups().items():
        mine = next((g for g in groups if rank in g), None)
        print(f"{kind:>3} group of rank {rank}: {mine}")


def layout_static(world: int = 128, gpus_per_node: int = 8) -> None:
    """`layout_widget`'s first picture without widgets (it stays in a saved notebook)."""
    show_layout(world, gpus_per_node, _default_size(world), _default_size(world), 0)


def layout_widget(world: int = 128, gpus_per_node: int = 8) -> ipywidgets.VBox:
    """Pick tp, pp (dp = world / (tp·pp)) and a rank; redraw the grid and print its groups."""
    import ipywidgets as widgets

    divs = divisors(world)
    tp = widgets.Dropdown(options=divs, value=_default_size(world), description="tp")
    pp = widgets.Dropdown(options=divs, value=_default_size(world), description="pp")
    rank = widgets.BoundedIntText(value=0, min=0, max=world - 1, description="rank")
    out = widgets.Output()

    def redraw(_: object = None) -> None:
        with out:
            out.clear_output(wait=True)
            show_layout(world, gpus_per_node, tp.value, pp.value, rank.value)

    for w in (tp, pp, rank):
        w.observe(redraw, names="value")
    redraw()
    return widgets.VBox([widgets.HBox([tp, pp, rank]), out])
