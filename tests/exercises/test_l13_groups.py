"""Grades exercises/l13_groups.py: TP, PP, DP and embedding groups of a (tp, pp, dp) layout.

Groups are lists of integers: compared exactly, against hand-written layouts and against the
coordinate rule rank = tp_rank + tp·(pp_rank + pp·dp_rank). tpedu's own groups
(tpedu.parallel.mesh) refuse to run while the tests do, so a wrapper or an alias of them fails.
"""

import pytest

from tests.exercises import refusing
from tpedu.course.grading import implementation
from tpedu.parallel.mesh import Layout, rank_groups, seed_tp_group

NAME = "l13_groups"
TWINS = (
    rank_groups,
    Layout.groups,
    Layout.axis_groups,
    Layout.emb_groups,
    Layout.rank,
    Layout.coords,
)


@refusing(*TWINS)
def test_worked_example():
    g = implementation(NAME).rank_groups(2, 2, 1)
    assert g == {
        "tp": [[0, 1], [2, 3]],
        "pp": [[0, 2], [1, 3]],
        "dp": [[0], [1], [2], [3]],
        "emb": [[0, 2], [1, 3]],
    }


@refusing(*TWINS)
def test_2x2x2_by_hand():
    g = implementation(NAME).rank_groups(2, 2, 2)
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["pp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["emb"] == [[0, 2], [1, 3], [4, 6], [5, 7]]


@pytest.mark.parametrize(
    ("tp", "pp", "dp"), [(4, 4, 8), (2, 3, 1), (1, 1, 3), (3, 1, 2), (1, 4, 1)]
)
@refusing(*TWINS)
def test_coordinates_and_partitions(tp, pp, dp):
    g = implementation(NAME).rank_groups(tp, pp, dp)
    world = tp * pp * dp

    def coords(r):
        return r % tp, (r // tp) % pp, r // (tp * pp)

    for kind, size, axis in (("tp", tp, 0), ("pp", pp, 1), ("dp", dp, 2)):
        groups = g[kind]
        assert sorted(r for grp in groups for r in grp) == list(range(world)), kind
        assert all(len(grp) == size for grp in groups), kind
        for grp in groups:
            cs = [coords(r) for r in grp]
            assert [c[axis] for c in cs] == list(range(size)), f"{kind} group {grp} out of order"
            others = {tuple(c[i] for i in range(3) if i != axis) for c in cs}
            assert len(others) == 1, f"{kind} group {grp} mixes coordinates"
    assert g["emb"] == ([[grp[0], grp[-1]] for grp in g["pp"]] if pp > 1 else [])
    assert g["tp"][0] == list(range(tp)), "a TP group must be consecutive ranks (one node)"


@refusing(*TWINS)
def test_is_not_the_seeds_bug():
    # The seed's `r % tp == tp_rank` groups ranks with the SAME tp_rank: a DP group at pp = 1.
    g = implementation(NAME).rank_groups(4, 1, 2)
    assert g["tp"][0] == [0, 1, 2, 3]
    assert seed_tp_group(8, 4, 0) == [0, 4] == g["dp"][0]
