"""Reference for exercises/l13_groups.py: the process groups of a (tp, pp, dp) layout."""

from __future__ import annotations


def rank_groups(tp: int, pp: int, dp: int) -> dict[str, list[list[int]]]:
    def rank(t: int, p: int, d: int) -> int:
        return t + tp * (p + pp * d)  # TP varies fastest

    # Each group: one coordinate varies (innermost), the other two are fixed (outer loops).
    tp_groups = [[rank(t, p, d) for t in range(tp)] for d in range(dp) for p in range(pp)]
    pp_groups = [[rank(t, p, d) for p in range(pp)] for d in range(dp) for t in range(tp)]
    dp_groups = [[rank(t, p, d) for d in range(dp)] for p in range(pp) for t in range(tp)]
    emb = [[g[0], g[-1]] for g in pp_groups] if pp > 1 else []  # first and last stage
    return {"tp": tp_groups, "pp": pp_groups, "dp": dp_groups, "emb": emb}
