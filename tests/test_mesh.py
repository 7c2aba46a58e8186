"""The rank grid's one description (`mesh.AXES`): coordinates, groups, group names and
checkpoint file names all follow it."""

import itertools

import pytest

from tpedu.checkpoint.index import shard_file
from tpedu.parallel.config import ParallelConfig
from tpedu.parallel.mesh import AXES, AXIS_NAMES, CHECKPOINT_AXES, Layout, describe_coords

LAYOUTS = [Layout(), Layout(3, 1, 1), Layout(2, 3, 2), Layout(tp=2, pp=2, dp=3, cp=2)]


def test_the_axes_in_rank_order():
    assert AXIS_NAMES == ("tp", "cp", "pp", "dp")  # TP fastest: a TP group sits in one node
    assert CHECKPOINT_AXES == ("tp", "pp", "dp")  # CP ranks hold the same tensors
    assert [a.name for a in AXES if a.optional] == ["cp"]


@pytest.mark.parametrize("lay", LAYOUTS, ids=str)
def test_coordinates_follow_the_rank_formula(lay):
    seen = set()
    for r in range(lay.world):
        c = lay.coords(r)
        assert list(c) == list(AXIS_NAMES)
        assert r == c["tp"] + lay.tp * (c["cp"] + lay.cp * (c["pp"] + lay.pp * c["dp"]))
        assert lay.rank(**c) == r
        seen.add(tuple(c.values()))
    assert len(seen) == lay.world
    with pytest.raises(ValueError, match="outside"):
        lay.coords(lay.world)
    with pytest.raises(ValueError, match="unknown axes"):
        lay.rank(ep=0)


@pytest.mark.parametrize("lay", LAYOUTS, ids=str)
def test_each_axis_groups_the_ranks_that_differ_only_there(lay):
    for axis in AXIS_NAMES:
        groups = lay.axis_groups(axis)
        assert sorted(itertools.chain(*groups)) == list(range(lay.world))  # a partition
        for g in groups:
            assert len(g) == lay.sizes[axis]
            coords = [lay.coords(r) for r in g]
            assert [c[axis] for c in coords] == list(range(lay.sizes[axis]))
            for other in AXIS_NAMES:
                if other != axis:
                    assert len({c[other] for c in coords}) == 1


def test_group_names_and_groups():
    assert Layout(2, 2, 2).group_names() == ("tp", "pp", "dp", "emb")  # cp 1: no CP group
    folded = ("tp", "cp", "pp", "dp", "emb", "dp_cp")  # cp 2: the gradients' dp·cp group
    assert Layout(2, 1, 1, cp=2).group_names() == folded
    assert list(Layout(2, 1, 1, cp=2).groups()) == list(folded)
    assert Layout(2, 1, 1).groups()["emb"] == []  # one stage: nothing tied to sum
    assert Layout(1, 3, 1).groups()["emb"] == [[0, 2]]


@pytest.mark.parametrize("lay", [Layout(2, 2, 2, cp=2), Layout(1, 1, 4, cp=3, ep=2)])
def test_the_gradient_groups_fold_cp_into_dp(lay):
    """dp_cp: the ranks of one (tp, pp) position over every cp and dp index, the union of the
    DP groups of one CP group's members; edp_cp: those of one ep_rank. Each tiles the world."""
    groups = lay.groups()
    dp_of = {r: g for g in groups["dp"] for r in g}
    for kind, size in (("dp_cp", lay.dp * lay.cp), ("edp_cp", lay.dp // lay.ep * lay.cp)):
        got = groups.get(kind, groups["dp_cp"])  # ep 1: edp_cp is dp_cp
        assert sorted(r for g in got for r in g) == list(range(lay.world))
        assert all(len(g) == (size if kind in groups else lay.dp * lay.cp) for g in got)
        for g in got:
            assert len({(lay.coords(r)["tp"], lay.coords(r)["pp"]) for r in g}) == 1
    for g in groups["dp_cp"]:
        cps = next(c for c in groups["cp"] if g[0] in c)
        assert sorted(r for c in cps for r in dp_of[c]) == g
    for g in groups.get("edp_cp", []):
        assert len({lay.expert_coords(r)["ep"] for r in g}) == 1
    assert "dp_cp" not in Layout(2, 2, 2).group_names()  # cp 1: the DP group is it


def test_checkpoint_files_are_named_by_the_checkpoint_axes():
    lay = Layout(tp=2, pp=2, dp=2, cp=2)
    assert shard_file(lay.coords(lay.rank(tp=1, cp=1, pp=0, dp=1))) == "tp1-pp0-dp1.safetensors"
    names = {shard_file(lay.coords(r)) for r in range(lay.world)}
    assert len(names) == lay.world // lay.cp  # the CP ranks of one shard share its name


def test_sizes_errors_and_the_parallel_config():
    assert Layout(2, 3, 4, cp=5).sizes == {"tp": 2, "cp": 5, "pp": 3, "dp": 4}
    assert ParallelConfig(tp=2, pp=3, dp=4, cp=5).layout == Layout(2, 3, 4, cp=5)
    with pytest.raises(ValueError, match="cp must be a positive integer, got 0"):
        ParallelConfig(cp=0)
    with pytest.raises(ValueError, match=r"tp·cp·pp·dp = 2·2·1·1 = 4 does not match the world"):
        Layout(2, cp=2).check_world(8)
    with pytest.raises(ValueError, match=r"^tp·pp·dp = 2·1·1 = 2 does not match the world"):
        Layout(2).check_world(4)


@pytest.mark.parametrize(
    "lay", [Layout(dp=4, ep=2), Layout(2, 2, 4, ep=4), Layout(2, 1, 6, 2, ep=3)]
)
def test_expert_groups_are_carved_from_the_dp_groups(lay):
    """ep groups: runs of ep consecutive members of one DP group (dp_rank = ep_rank +
    ep · edp_rank); edp groups: a DP group's members with the same ep_rank. Together they
    tile every DP group exactly: each rank in one ep group and one edp group, both inside
    its DP group; the world is unchanged."""
    assert lay.world == lay.tp * lay.cp * lay.pp * lay.dp
    names = lay.group_names()
    assert names[names.index("emb") + 1 :][:2] == ("ep", "edp")
    groups = lay.groups()
    dp_of = {r: g for g in groups["dp"] for r in g}
    for kind, size in (("ep", lay.ep), ("edp", lay.dp // lay.ep)):
        assert sorted(r for g in groups[kind] for r in g) == list(range(lay.world))
        assert all(len(g) == size and set(g) <= set(dp_of[g[0]]) for g in groups[kind])
    for g in groups["ep"]:
        assert [lay.coords(r)["dp"] % lay.ep for r in g] == list(range(lay.ep))
        assert len({lay.coords(r)["dp"] // lay.ep for r in g}) == 1
    for g in groups["edp"]:
        assert len({lay.coords(r)["dp"] % lay.ep for r in g}) == 1
    assert "ep" not in Layout(dp=4).group_names()
    with pytest.raises(ValueError, match="ep = 3 does not divide dp = 4"):
        Layout(dp=4, ep=3)


def test_expert_coords_carve_ep_from_dp():
    """dp index = ep + ep_size · edp: consecutive DP ranks form an EP group (different experts),
    every ep-th holds the same experts (an edp group)."""
    layout = Layout(tp=2, dp=4, ep=2)
    got = [layout.expert_coords(layout.rank(tp=1, dp=d)) for d in range(4)]
    assert got == [
        {"ep": 0, "edp": 0},
        {"ep": 1, "edp": 0},
        {"ep": 0, "edp": 1},
        {"ep": 1, "edp": 1},
    ]
    assert [layout.expert_coords(r) for r in range(2)] == [{"ep": 0, "edp": 0}] * 2  # tp 0, 1
    assert {tuple(g) for g in layout.ep_groups()} == {(0, 2), (4, 6), (1, 3), (5, 7)}


def test_ep_is_named_wherever_the_layout_is_when_it_is_used():
    from tpedu.train.loop import describe

    assert describe(ParallelConfig(tp=2, dp=4, ep=2)) == "tp=2 dp=4 ep=2"
    assert describe(ParallelConfig(tp=2, cp=2)) == "tp=2 cp=2"
    assert repr(Layout(dp=4, ep=2)).endswith("ep=2)") and "ep" not in repr(Layout(dp=4))
    assert describe_coords(Layout(dp=4, ep=2), 3) == "tp 0/1, pp 0/1, dp 3/4, ep 1/2"
