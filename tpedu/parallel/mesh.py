"""Lesson 13: the device mesh: which global ranks form each TP, CP, PP and DP group.

A layout (tp, pp, dp) puts world = tp·pp·dp ranks on a grid; context parallelism adds a fourth
axis, cp (default 1). `AXES` names the axes in rank order, TP fastest, then CP, PP, DP:

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
    ep   expert parallelism, carved from DP (as Megatron-core and torchtitan do), when ep > 1:
         ep consecutive DP ranks of one DP group (dp_rank = ep_rank + ep · edp_rank) hold
         different experts and trade tokens with all-to-all; attention stays replicated
    edp  the ranks of one DP group with the same ep_rank: replicas of the same experts, whose
         gradients are reduced over it (and only over it)
    dp_cp, edp_cp  with cp > 1: a dp (edp) group and the CP ranks of its members. A gradient is
         summed over every rank that holds the same elements and saw other tokens: the
         replicas, and the CP ranks, which saw other positions of the same sequences. So DP's
         one bucketed reduction (and ZeRO's sharding) runs over dp·cp, as picotron and
         Megatron-core do, not a second per-parameter sum over CP. At cp = 1 they are dp, edp.

`torch.distributed.new_group` is collective over the WHOLE world: every rank must create every
group, in the same order, even the groups it is not in. `Mesh` does exactly that.

The second seed builds its "TP group" as `[r for r in range(world) if r % tp == tp_rank]`: those
are the ranks with the same tp_rank, i.e. a DP group (at pp = 1), not a TP group. `seed_tp_group`
reproduces it so lesson 13 can show the difference.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist

from tpedu.comm import collectives
from tpedu.comm.placement import Placements, sharded_on
from tpedu.tp.sharding import divisors

if TYPE_CHECKING:
    import ipywidgets
    from matplotlib.axes import Axes


@dataclass(frozen=True)
class Axis:
    """One axis of the rank grid, and what its group does."""

    name: str
    checkpoint: bool  # its ranks hold different tensors: checkpoint files are named by it
    optional: bool  # no group at size 1 (the model then runs without it); else always one
    group: str  # what the ranks of one group share


# The one description of the grid, in rank order (fastest first): groups, coordinates, the
# Mesh, checkpoint file names, the dry run's group names and the CLI's layout flags follow it.
AXES = (
    Axis("tp", True, False, "one pipeline stage of one replica, its matmuls split"),
    Axis("cp", False, True, "one stage's sequence chunks: gradients summed"),
    Axis("pp", True, False, "one pipeline, stage 0 -> stage pp-1"),
    Axis("dp", True, False, "replicas of the same shards: gradients averaged"),
)
AXIS_NAMES = tuple(a.name for a in AXES)
CHECKPOINT_AXES = tuple(a.name for a in AXES if a.checkpoint)
# The tracer's name of a group kind, where it is not the kind: the pipeline's channels are all
# "pp"; the gradient reduction over dp·cp is DP's, with the CP ranks folded in.
TRACED_AS = {
    "pp_grad": "pp",
    "pp_wrap": "pp",
    "pp_grad_wrap": "pp",
    "dp_cp": "dp",
    "edp_cp": "edp",
}


def gradient_group(placements: Placements) -> str:
    """The mesh group a parameter's gradient is summed over after backward: the ranks that hold
    the same elements and saw other tokens. "dp_cp": every replica, and the CP ranks, which saw
    other positions of the same sequences; "edp_cp" for a parameter split over ep: ep is carved
    from dp, so only the replicas of the same experts hold its elements."""
    return "edp_cp" if sharded_on(placements, "ep") else "dp_cp"


@dataclass(frozen=True)
class Layout:
    """A (tp, pp, dp) layout (and cp) of tp·cp·pp·dp ranks, ordered as `AXES`: TP varies
    fastest, then CP, PP, DP."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1  # expert-parallel ranks within each DP group: not an axis of its own

    def __post_init__(self) -> None:
        for name in (*AXIS_NAMES, "ep"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.dp % self.ep:
            raise ValueError(
                f"ep = {self.ep} does not divide dp = {self.dp}: expert parallelism is carved "
                f"from the DP ranks; choose ep among {', '.join(map(str, divisors(self.dp)))}"
            )

    def __repr__(self) -> str:
        shown = {"tp": self.tp, "pp": self.pp, "dp": self.dp, "cp": self.cp}
        return f"Layout({', '.join(f'{k}={v}' for k, v in (shown | self.carved).items())})"

    @property
    def carved(self) -> dict[str, int]:
        """{"ep": ep} when the DP ranks are carved into EP groups (ep > 1), else {}: carved
        from dp, ep is news only when used."""
        return {"ep": self.ep} if self.ep > 1 else {}

    @property
    def sizes(self) -> dict[str, int]:
        """{axis: size} in rank order (fastest first)."""
        return {name: getattr(self, name) for name in AXIS_NAMES}

    @property
    def reduce_ranks(self) -> int:
        """The ranks of a dp_cp group: those a replicated parameter's gradient is summed over
        (dp·cp), and the number of ZeRO's shards."""
        return self.dp * self.cp

    @property
    def world(self) -> int:
        return math.prod(self.sizes.values())

    def check_world(self, world: int) -> None:
        """Raise a ValueError if this layout does not use exactly `world` ranks."""
        if self.world != world:
            used = {a: n for a, n in self.sizes.items() if n > 1 or a in ("tp", "pp", "dp")}
            raise ValueError(
                f"{'·'.join(used)} = {'·'.join(map(str, used.values()))} = {self.world} does "
                f"not match the world size {world}; choose sizes whose product is {world} "
                f"(each a divisor of it: {', '.join(map(str, divisors(world)))})"
            )

    def coords(self, rank: int) -> dict[str, int]:
        """Global rank -> {axis: its index along that axis}, in rank order."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside [0, {self.world})")
        out = {}
        for name, size in self.sizes.items():
            rank, out[name] = divmod(rank, size)
        return out

    def expert_coords(self, rank: int) -> dict[str, int]:
        """Global rank -> {"ep": its place in its EP group, "edp": which replica of those
        experts it holds}: ep is carved from dp, dp index = ep + self.ep · edp."""
        edp, ep = divmod(self.coords(rank)["dp"], self.ep)
        return {"ep": ep, "edp": edp}

    def copy_axes(self, zero: bool = False) -> dict[str, int]:
        """{axis: size} of the axes beyond TP along which this layout copies a parameter's
        reduced gradient (what TPGPT.norm_weight divides by): cp and dp, the ranks of its
        dp_cp group (zero=True leaves them out: ZeRO shards over that group, each rank holds
        its own piece); ep, the part of dp an expert is split over."""
        return {"ep": self.ep} | ({} if zero else {"cp": self.cp, "dp": self.dp})

    def rank(self, **coords: int) -> int:
        """{axis: index} -> global rank (an axis left out: index 0)."""
        unknown = set(coords) - set(AXIS_NAMES)
        if unknown:
            raise ValueError(f"unknown axes {sorted(unknown)}; the axes are {AXIS_NAMES}")
        rank, stride = 0, 1
        for name, size in self.sizes.items():
            rank += coords.get(name, 0) * stride
            stride *= size
        return rank

    def axis_groups(self, axis: str) -> list[list[int]]:
        """Every group along `axis` (the ranks that differ only there), in a fixed order:
        tp groups are consecutive ranks, a pp group is one pipeline (stage 0 first)."""
        sizes = self.sizes
        others = [a for a in reversed(AXIS_NAMES) if a != axis]  # slowest first
        return [
            [
                self.rank(**dict(zip(others, fixed, strict=True)), **{axis: i})
                for i in range(sizes[axis])
            ]
            for fixed in itertools.product(*(range(sizes[a]) for a in others))
        ]

    def emb_groups(self) -> list[list[int]]:
        """[first stage, last stage] of every pipeline (empty when pp = 1: nothing to tie)."""
        return [[g[0], g[-1]] for g in self.axis_groups("pp")] if self.pp > 1 else []

    def ep_groups(self) -> list[list[int]]:
        """Expert-parallel groups: each DP group cut into runs of ep consecutive members."""
        return [
            g[i : i + self.ep] for g in self.axis_groups("dp") for i in range(0, self.dp, self.ep)
        ]

    def edp_groups(self) -> list[list[int]]:
        """Expert-data-parallel groups: the members of each DP group with the same ep_rank."""
        return [g[e :: self.ep] for g in self.axis_groups("dp") for e in range(self.ep)]

    def dp_cp_groups(self) -> list[list[int]]:
        """The ranks of one stage position (tp_rank, pp_rank) over every cp and dp index."""
        at: dict[tuple[int, int], list[int]] = {}
        for r in range(self.world):
            c = self.coords(r)
            at.setdefault((c["pp"], c["tp"]), []).append(r)
        return list(at.values())

    def edp_cp_groups(self) -> list[list[int]]:
        """The members of each dp_cp group with the same ep_rank."""
        return [
            [r for r in g if self.expert_coords(r)["ep"] == e]
            for g in self.dp_cp_groups()
            for e in range(self.ep)
        ]

    def group_names(self) -> tuple[str, ...]:
        """The groups this layout has, in rank order, then "emb", then "ep" and "edp" when
        ep > 1, then "dp_cp" (and "edp_cp") when cp > 1: an optional axis (cp) only at size > 1."""
        axes = tuple(a.name for a in AXES if not a.optional or self.sizes[a.name] > 1)
        folded = (("dp_cp",) + (("edp_cp",) if self.ep > 1 else ())) if self.cp > 1 else ()
        return axes + ("emb",) + (("ep", "edp") if self.ep > 1 else ()) + folded

    def present(self, kind: str) -> str:
        """The kind of group that stands for `kind` in this layout: a folded group absent here
        is its unfolded one (dp_cp at cp 1 is dp; edp at ep 1 is dp)."""
        if kind.endswith("_cp") and self.cp == 1:
            kind = kind.removesuffix("_cp")
        if kind.startswith("edp") and self.ep == 1:
            kind = kind.removeprefix("e")
        return kind

    def group_of(self, kind: str, rank: int) -> list[int]:
        """The members of `rank`'s group of `kind` (`present(kind)` in this layout)."""
        return next(g for g in self.groups_of(self.present(kind)) if rank in g)

    def groups_of(self, kind: str) -> list[list[int]]:
        """Every group of one kind: an axis's, or a group derived from them."""
        derived = {
            "emb": self.emb_groups,
            "ep": self.ep_groups,
            "edp": self.edp_groups,
            "dp_cp": self.dp_cp_groups,
            "edp_cp": self.edp_cp_groups,
        }
        return derived[kind]() if kind in derived else self.axis_groups(kind)

    def groups(self) -> dict[str, list[list[int]]]:
        """{name: every group of that kind} for each of `group_names()`."""
        return {name: self.groups_of(name) for name in self.group_names()}


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
        self.coords = layout.coords(self.rank)
        self.groups: dict[str, dist.ProcessGroup | None] = {}
        self.members: dict[str, list[int]] = {}
        # Gradients travel backwards on their own group (channel), so an activation and a
        # gradient between the same two ranks (pp = 2, interleaved) can never be confused. The
        # interleaved schedule's wrap-around edge (last stage -> first, to the next chunk) gets
        # its own groups too: at pp = 2 it runs opposite to the 0 -> 1 edge, and two ranks
        # sending to each other on one NCCL communicator can each wait for the other forever.
        kinds = {}
        for name, ranks in layout.groups().items():
            kinds[name] = ranks
            if name == "pp":
                kinds |= {"pp_grad": ranks, "pp_wrap": ranks, "pp_grad_wrap": ranks}
        for kind, groups in kinds.items():
            for ranks in groups:
                g = dist.new_group(ranks)  # collective: every rank, every group, same order
                if self.rank in ranks:
                    self.groups[kind] = collectives.name_group(g, TRACED_AS.get(kind, kind))
                    self.members[kind] = ranks
        for kind in [*AXIS_NAMES, "emb"]:  # none: an optional axis of size 1, no tied copies
            self.groups.setdefault(kind, None)
            self.members.setdefault(kind, [])
        for kind in ("edp", "dp_cp", "edp_cp"):  # absent at ep 1 or cp 1: what stands for it
            self.groups.setdefault(kind, self.groups[layout.present(kind)])
            self.members.setdefault(kind, self.members[layout.present(kind)])

    tp_rank = property(lambda self: self.coords["tp"])
    cp_rank = property(lambda self: self.coords["cp"])
    pp_rank = property(lambda self: self.coords["pp"])
    dp_rank = property(lambda self: self.coords["dp"])
    tp_group = property(lambda self: self.groups["tp"])
    cp_group = property(lambda self: self.groups["cp"])
    pp_group = property(lambda self: self.groups["pp"])
    dp_group = property(lambda self: self.groups["dp"])
    reduce_group = property(lambda self: self.groups["dp_cp"])  # DataParallel's and ZeRO's
    emb_group = property(lambda self: self.groups["emb"])
    edp_group = property(lambda self: self.groups["edp"])

    @property
    def ep_group(self) -> dist.ProcessGroup:
        """The expert-parallel group; at ep = 1 a group of this rank alone, created when first
        asked for (by this rank only: no collective, nothing for a model without experts)."""
        if "ep" not in self.groups:
            self.groups["ep"], self.members["ep"] = collectives.own_group("ep"), [self.rank]
        return self.groups["ep"]

    ep_rank = property(lambda self: self.layout.expert_coords(self.rank)["ep"])

    @property
    def first_of_stage(self) -> bool:
        """Whether this rank is the first of those that run one stage of one replica together
        (every axis but pp and dp at index 0): they hold the same activations and loss."""
        return not any(i for a, i in self.coords.items() if a not in ("pp", "dp"))

    def __repr__(self) -> str:
        return f"Mesh(rank {self.rank}: {describe_coords(self.layout, self.rank)})"


def describe_coords(layout: Layout, rank: int) -> str:
    """ "tp 1/2, pp 0/2, dp 1/2" (and cp, at size > 1; and "ep 1/2", its place in its EP
    group, at ep > 1): where `rank` sits in `layout`."""
    names = [n for n in layout.group_names() if n in AXIS_NAMES]
    coords = layout.coords(rank)
    parts = [f"{n} {coords[n]}/{layout.sizes[n]}" for n in names]
    if layout.ep > 1:  # carved from dp, not an axis of the grid
        parts.append(f"ep {layout.expert_coords(rank)['ep']}/{layout.ep}")
    return ", ".join(parts)


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
        x, y = _cell(layout, r)
        node = r // gpus_per_node
        ax.add_patch(Rectangle((x + 0.05, y + 0.05), 0.9, 0.9, color=colors(node % 20), alpha=0.55))
        ax.text(x + 0.5, y + 0.5, str(r), ha="center", va="center", fontsize=7)
    styles = {"tp": ("red", 2.5), "pp": ("blue", 1.8), "dp": ("green", 1.2)}
    for kind, (color, width) in styles.items():
        for r in members[kind]:
            x, y = _cell(layout, r)
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


def _cell(layout: Layout, rank: int) -> tuple[int, int]:
    """(column, row) of `rank` in `draw_layout`'s grid (cp = 1)."""
    c = layout.coords(rank)
    return c["pp"] * layout.tp + c["tp"], layout.dp - 1 - c["dp"]


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
