"""Reference for exercises/l11_one_f_one_b.py: the 1F1B schedule."""

from __future__ import annotations


def one_f_one_b(n_micro: int, n_stages: int, stage: int) -> list[tuple[str, int]]:
    warm = min(n_stages - 1 - stage, n_micro)  # fill the stages after this one
    order = [("F", i) for i in range(warm)]
    for i in range(n_micro - warm):  # steady state: one forward, then the oldest backward
        order += [("F", warm + i), ("B", i)]
    return order + [("B", i) for i in range(n_micro - warm, n_micro)]  # drain
