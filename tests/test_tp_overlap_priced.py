"""Pricing a recorded TP step on an H100 node (tpedu.analysis.clock.tp_overlap, lesson 19): the
layer's FLOPs are the shape module's, hand-built logs price to the α-β and FLOPs arithmetic
exactly (the CPU inside a call dropped, each rank its own factor, bytes scaled), and a real
recording of every way prices as lesson 19 says: the same compute, n times the messages, less
exposed communication with chunks and with the ring."""

import pytest

from tests.helpers import Builder
from tpedu import launch
from tpedu.analysis.clock import links
from tpedu.analysis.clock import tp_overlap as T
from tpedu.analysis.shape import ModelShape
from tpedu.analysis.whatif import H100_SXM
from tpedu.comm.cost_model import AlphaBeta
from tpedu.model.config import GPTConfig

NET = AlphaBeta(1e-5, 1e-10)
PEAK = H100_SXM.peak_flops * 0.7


def test_layer_flops_is_one_layer_of_the_shape_modules_count():
    h, s, b = 512, 1024, 3
    one, two = (ModelShape(hidden=h, seq_len=s, n_layers=n, n_heads=8) for n in (1, 2))
    want = (two.flops_per_token() - one.flops_per_token()) * b * s
    assert T.layer_flops(h, s, b) == want


def _logs(cpu, nbytes, chunks=1, call_cpu=0.0):
    """Two ranks: per chunk, compute then an all-reduce (blocking when chunks == 1, else
    issued async and all waited at the end); rank 1's CPU is twice rank 0's (a noisy core)."""
    logs = []
    for rank in (0, 1):
        log, issued = Builder(rank), []
        for _ in range(chunks):
            log.compute(cpu * (rank + 1) / chunks)
            i = log.comm("all_reduce", (0, 1), nbytes // chunks, blocking=chunks == 1)
            log.log.spans[i].cpu = call_cpu  # gloo adding on the CPU: not the device's work
            issued.append(i)
        for i in issued if chunks > 1 else []:
            log.wait(i)
        logs.append(log.log)
    return logs


def test_price_is_the_flops_and_the_alpha_beta_time():
    flops, factor = 2e12, 8.0
    t = T.price(_logs(0.01, 1000, call_cpu=0.5), flops, factor, NET)
    ar = NET.predict("all_reduce", 8000, 2)
    assert t.busy == [pytest.approx(flops / 2 / PEAK, rel=1e-12)] * 2
    assert t.step == pytest.approx(flops / 2 / PEAK + ar, rel=1e-12)
    assert t.exposed == pytest.approx(ar, rel=1e-12) and t.hidden == 0


def test_chunks_hide_all_but_the_last_chunks_all_reduce():
    flops, factor = 4e12, 100.0  # each chunk's compute (0.72 ms) > its all-reduce (0.26 ms)
    t = T.price(_logs(0.01, 100_000, chunks=4), flops, factor, NET)
    ar = NET.predict("all_reduce", 25_000 * factor, 2)
    assert t.step == pytest.approx(flops / 2 / PEAK + ar, rel=1e-12)
    assert t.exposed == pytest.approx(ar, rel=1e-12)
    assert t.hidden == pytest.approx(3 * ar, rel=1e-12)


def _record():
    config = GPTConfig.gpt2_like(37, seq_len=16, n_layers=1, hidden=64, n_heads=4)
    return T.record_block(config, 4, warmup=1), config


def test_recorded_ways_price_as_the_lesson_says():
    logs, config = launch(_record, 2)[0]
    rows = T.priced(logs, config, 4)
    compute = T.layer_flops(4096, 4096) / 2 / PEAK
    for r in rows.values():
        assert r.compute == pytest.approx(compute, rel=1e-9), r.way
    assert [rows[w].messages for w in ("tp", "tp, 2 chunks", "tp, 4 chunks")] == [4, 8, 16]
    # a block's 4 all-reduces, as all-reduces of b·s·h·2 bytes over 2 NVLink ranks
    ar = links.LINKS["nvlink"].predict("all_reduce", 4096 * 4096 * 2, 2)
    assert rows["tp"].exposed == pytest.approx(4 * ar, rel=1e-6) and rows["tp"].hidden == 0
    assert rows["tp, 2 chunks"].exposed < 0.6 * rows["tp"].exposed
    assert rows["tp, 4 chunks"].comm > rows["tp, 2 chunks"].comm > rows["tp"].comm  # α each
    # How much of the ring hides depends on how the recorded CPU time falls between its sends
    # (a 64-wide layer: 0.27-0.65 of SP's exposed time over runs, idle and loaded); that it
    # hides a good part and exposes less than SP does not.
    ring = rows["sp, ring"]
    assert rows["sp"].hidden == 0 and ring.exposed < rows["sp"].exposed
    assert ring.hidden_share > 0.25, ring
    assert "1." in T.table(rows).splitlines()[2]  # a speed-up printed against tp
