"""Reference for exercises/l15_bug_hunt.py."""

# the references live in tpedu/tp/ (operators, vocab_parallel, attention) and tpedu/parallel/
# (mesh, pipeline/schedules)
from tpedu.parallel.mesh import Layout
from tpedu.parallel.pipeline.schedules import one_f_one_b
from tpedu.tp.attention import local_heads
from tpedu.tp.operators import copy_to_tp_region
from tpedu.tp.vocab_parallel import _mask_padding as mask_padding
from tpedu.tp.vocab_parallel import vocab_parallel_argmax


def kv_heads_of_rank(n_heads: int, n_kv_heads: int, tp: int, rank: int) -> list[int]:
    """tpedu.tp.attention.local_heads' KV half."""
    return local_heads(n_heads, n_kv_heads, tp, rank)[1]


def tp_groups(world: int, tp: int, pp: int = 1) -> list[list[int]]:
    """tpedu.parallel.mesh.Layout.tp_groups, in order of the first rank."""
    return sorted(Layout(tp=tp, pp=pp, dp=world // (tp * pp)).tp_groups())


__all__ = [
    "copy_to_tp_region",
    "kv_heads_of_rank",
    "mask_padding",
    "one_f_one_b",
    "tp_groups",
    "vocab_parallel_argmax",
]
