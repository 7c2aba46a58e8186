"""Measurements of context parallelism (tpedu.cp.balance, tpedu.cp.traffic) against the code
they describe: the causal work per rank counted from chunk_positions == the closed forms and ==
what RingAttention actually multiplies out; the bytes the tracer records for ring and Ulysses
attention inside the GPT == the formulas, exactly. No timed assertions."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import tpedu.cp.ring as ring_module
from tpedu import launch
from tpedu.comm.cost_model import AlphaBeta
from tpedu.comm.tracer import CommTracer
from tpedu.cp import balance, traffic
from tpedu.cp.context import ContextParallel
from tpedu.cp.ring import chunk_positions, ring_attention, split_sequence
from tpedu.model import TPGPT, DenseGPT, GPTConfig
from tpedu.model.options import RunOptions


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_counted_pairs_equal_the_closed_form(cp, layout):
    for s in (2 * cp, 8 * cp, 24 * cp):
        counted = [balance.causal_pairs(s, cp, r, layout) for r in range(cp)]
        assert counted == [balance.causal_pairs_formula(s, cp, r, layout) for r in range(cp)]
        assert sum(counted) == s * (s + 1) // 2  # every causal pair once, on its query's rank
        blocks = [balance.computed_blocks(s, cp, r, layout) for r in range(cp)]
        assert blocks == ([cp] * cp if layout == "zigzag" else list(range(1, cp + 1)))
        if layout == "zigzag":
            assert len(set(counted)) == 1


def test_zigzag_balance_numbers_at_cp_2_and_4():
    s = 64
    assert [balance.causal_pairs(s, 2, r, "contiguous") for r in range(2)] == [528, 1552]
    assert [balance.causal_pairs(s, 2, r, "zigzag") for r in range(2)] == [1040, 1040]
    assert [balance.causal_pairs(s, 4, r, "contiguous") for r in range(4)] == [136, 392, 648, 904]
    assert [balance.causal_pairs(s, 4, r, "zigzag") for r in range(4)] == [520] * 4
    assert balance.attention_flops(s, 4, 3, "contiguous", 2, 4, 8) == 4 * 2 * 4 * 8 * 904
    assert balance.attention_flops(s, 4, 0, "zigzag", 2, 4, 8, computed=True) == 4 * 2 * 4 * 8 * (
        4 * 16 * 16
    )


def _blocks_ring_attention_computes(s: int, layout: str) -> list[tuple[int, int]]:
    """(owner, kept pairs) of every block RingAttention.forward computes on this rank, in ring
    order; the owner is read off the keys, whose first feature is their global position."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    positions = torch.stack([chunk_positions(s, cp, r, layout) for r in range(cp)])
    first = {int(p[0]): r for r, p in enumerate(positions)}
    seen, original = [], ring_module.block_scores

    def spy(q, k, mask, scale):
        seen.append((first[int(k[0, 0, 0, 0])], int(mask.sum())))
        return original(q, k, mask, scale)

    q, k, v = (torch.randn(1, 2, s // cp, 4) for _ in range(3))
    k[..., 0] = positions[rank].double()
    ring_module.block_scores = spy
    try:
        ring_attention(q, k, v, positions, fused=False)  # the written-out blocks
    finally:
        ring_module.block_scores = original
    return seen


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_the_schedule_is_what_ring_attention_computes(layout):
    s, cp = 32, 4
    schedule = balance.ring_schedule(s, cp, layout)
    for rank, seen in enumerate(launch(_blocks_ring_attention_computes, cp, s, layout)):
        assert seen == [(owner, n) for owner, n in schedule[rank] if n > 0], rank


CONFIG = GPTConfig.llama_like(37, seq_len=16, n_layers=2, hidden=16, n_heads=4, n_kv_heads=2)


def _traced_gpt(tp: int, strategy: str, recompute: str = "none"):
    world, rank = dist.get_world_size(), dist.get_rank()
    cp = world // tp
    tp_groups = [dist.new_group(list(range(c * tp, (c + 1) * tp))) for c in range(cp)]
    cp_groups = [dist.new_group(list(range(t, world, tp))) for t in range(tp)]
    torch.manual_seed(0)
    model = TPGPT(
        DenseGPT(CONFIG).double(),
        tp_groups[rank // tp],
        options=RunOptions(
            context=ContextParallel(cp_groups[rank % tp], strategy), recompute=recompute
        ),
    )
    g = torch.Generator().manual_seed(1)
    ids, tgt = (torch.randint(0, 37, (2, 16), generator=g) for _ in range(2))
    with CommTracer() as trace:
        model(model.local_sequence(ids), model.local_sequence(tgt)).backward()
    op = "send" if strategy == "ring" else "all_to_all"
    return {
        ph: (trace.count(op, phase=ph), trace.bytes(op, phase=ph)) for ph in ("forward", "backward")
    }


@pytest.mark.parametrize(
    ("tp", "world", "recompute"), [(1, 2, "none"), (1, 4, "none"), (2, 4, "none"), (1, 4, "full")]
)
def test_traced_ring_bytes_equal_the_formula(tp, world, recompute):
    cp = world // tp
    want = traffic.ring_messages(
        2, CONFIG.kv_heads // tp, 16, cp, 4, 8, CONFIG.n_layers, recompute == "full"
    )
    for got in launch(_traced_gpt, world, tp, "ring", recompute):
        assert got == want, (got, want)


def test_traced_ulysses_bytes_equal_the_formula():
    want = traffic.ulysses_messages(2, 4, 2, 16, 2, 4, 8, CONFIG.n_layers)
    assert want["forward"][0] == 4 * CONFIG.n_layers
    for got in launch(_traced_gpt, 2, 1, "ulysses"):
        assert got == want, (got, want)


def test_the_alpha_beta_predictions_count_messages_and_bytes():
    latency, per_byte = AlphaBeta(1.0, 0.0), AlphaBeta(0.0, 1.0)
    assert traffic.predict_ring_seconds(latency, 100, 4) == 6  # 2(cp − 1) messages
    assert traffic.predict_ring_seconds(per_byte, 100, 4) == 600
    assert traffic.predict_ulysses_seconds(latency, 80, 40, 4) == 12  # 4 all-to-alls × 3 steps
    assert traffic.predict_ulysses_seconds(per_byte, 80, 40, 4) == pytest.approx(180)
    assert traffic.ring_messages(2, 2, 16, 1, 4, 8) == {"forward": (0, 0), "backward": (0, 0)}


def _timings():
    cp = dist.get_world_size()
    q = split_sequence(torch.randn(1, 4, 32, 8), cp, dist.get_rank())
    k = v = q[:, :2].contiguous()
    return traffic.time_ring_exchange(k, v, repeats=2), traffic.time_ulysses_exchange(
        q, k, v, repeats=2
    )


def test_timers_run_and_agree_across_ranks():
    a, b = launch(_timings, 2)
    assert a == b and min(a) > 0  # each is the slowest rank's median, reported on every rank
    assert balance.time_rank(32, 2, 1, "zigzag", repeats=1) > 0
