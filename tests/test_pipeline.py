"""Pipeline parallelism: partitioning, the three schedules (on the ideal clock and in real runs),
gradients equal to the non-pipelined model's, and a hang that ends in a clear error.

Tolerance: float64; a pipelined step computes each micro-batch's loss separately and sums
loss/m, so sums are reordered (≈1e-16 relative each); 1e-10 catches any real error (≥1e-3).
"""

import pytest
import torch

from tpedu import launch
from tpedu.analysis.clock.events import recorded_events
from tpedu.comm import recorder
from tpedu.launcher import LaunchTimeout, RankError
from tpedu.model.config import GPTConfig
from tpedu.model.dense import DenseGPT
from tpedu.parallel.config import ParallelConfig
from tpedu.parallel.mesh import Layout, Mesh
from tpedu.parallel.pipeline.runtime import (
    Pipe,
    StepOptions,
    build_stage_chunks,
    run_schedule,
    sync_tied_grads,
)
from tpedu.parallel.pipeline.schedules import (
    action_parts,
    bubble_formula,
    bubble_fraction,
    head_cost,
    partition,
    peak_in_flight,
    schedule,
    simulate,
    stage_layers,
)


def test_partition_balances_and_gives_extras_to_the_middle():
    assert partition(7, 3) == [range(0, 2), range(2, 5), range(5, 7)]
    assert partition(6, 4) == [range(0, 1), range(1, 3), range(3, 5), range(5, 6)]
    assert partition(5, 1) == [range(0, 5)]
    for n, p in [(9, 4), (13, 5), (3, 3)]:
        parts = partition(n, p)
        assert [r.start for r in parts[1:]] == [r.stop for r in parts[:-1]]
        assert parts[0].start == 0 and parts[-1].stop == n
        assert max(map(len, parts)) - min(map(len, parts)) <= 1
    with pytest.raises(ValueError, match="3 layers cannot be split over 4 stages"):
        partition(3, 4)


def test_partition_with_a_head_cost_minimises_the_busiest_stage():
    """head_cost counts the last stage's head and loss in blocks: that stage gets fewer blocks."""
    assert partition(4, 2, 2.5) == [range(0, 3), range(3, 4)]  # 3 and 3.5 blocks of work
    assert partition(8, 4, 3.0) == [range(0, 2), range(2, 5), range(5, 7), range(7, 8)]
    assert partition(7, 3, 1.0) == partition(7, 3)  # ties keep the most blocks on the last stage
    assert partition(4, 4, 9.0) == partition(4, 4)  # every stage needs one block
    for n, p, h in [(9, 4, 0.7), (13, 5, 2.2), (16, 3, 4.0)]:
        parts = partition(n, p, h)
        cost = max(len(r) + h * (i == p - 1) for i, r in enumerate(parts))
        # no split with another last-stage size does better (brute force over all of them)
        for last in range(1, n - p + 2):
            rest = n - last
            assert cost <= max(-(-rest // (p - 1)), last + h) + 1e-12, (n, p, h, parts)
        assert [r.start for r in parts[1:]] == [r.stop for r in parts[:-1]]


def test_head_cost_is_the_flop_ratio_and_stage_split_uses_it():
    c = GPTConfig(8192, seq_len=256, n_layers=4, hidden=256, n_heads=8)
    block = 2 * 256 * (3 * 256 + 256 + 2 * 1024) + 2 * 256 * 256  # qkv, out, fc1, fc2; attention
    assert head_cost(c) == pytest.approx(2 * 256 * 8192 / block)
    swiglu = GPTConfig.llama_like(8192, seq_len=256, n_layers=4, hidden=256, n_heads=8)
    block = 2 * 256 * (256 + 2 * 2 * 32 + 256 + 3 * 1024) + 2 * 256 * 256  # GQA: 2 kv heads
    assert head_cost(swiglu) == pytest.approx(2 * 256 * 8192 / block)
    assert stage_layers(c, 2) == [range(0, 2), range(2, 4)]
    assert stage_layers(c, 2, "flops") == [range(0, 3), range(3, 4)]
    with pytest.raises(ValueError, match="stage_split must be 'even' or 'flops'"):
        stage_layers(c, 2, "fast")
    with pytest.raises(ValueError, match="stage_split must be one of"):
        ParallelConfig(pp=2, stage_split="fast")


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 3, 4, 8])
def test_schedules_on_the_ideal_clock(p, m):
    for kind in ("gpipe", "1f1b"):
        scheds = [schedule(kind, m, p, s) for s in range(p)]
        for s, acts in enumerate(scheds):
            assert sorted(acts) == sorted(
                [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
            )
            assert all(acts.index(("F", i)) < acts.index(("B", i)) for i in range(m))
            expected_peak = m if kind == "gpipe" else min(m, p - s)
            assert peak_in_flight(acts) == expected_peak, (kind, s)
        # equal F and B costs: exactly the textbook bubble (the same for GPipe and 1F1B)
        assert bubble_fraction(simulate(scheds)) == pytest.approx(bubble_formula(m, p), abs=1e-12)
    for v in (2, 3):
        if m % p:
            with pytest.raises(ValueError, match="divisible by the number of stages"):
                schedule("interleaved", m, p, 0, v)
            continue
        scheds = [schedule("interleaved", m, p, s, v) for s in range(p)]
        for acts in scheds:
            assert len(acts) == 2 * m * v and len(set(acts)) == 2 * m * v
        bubble = bubble_fraction(simulate(scheds))
        assert bubble == pytest.approx(bubble_formula(m, p, v), abs=1e-12)
        if p > 1:
            assert bubble < bubble_formula(m, p)


def test_simulate_detects_a_deadlock():
    bad = [[("F", 0), ("B", 0)], [("B", 0), ("F", 0)]]  # stage 1 backwards before forwarding
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(bad)


CONFIG = GPTConfig.gpt2_like(37, seq_len=8, n_layers=4, hidden=16, n_heads=2)
UNTIED = GPTConfig.llama_like(37, seq_len=8, n_layers=4, hidden=16, n_heads=2, n_kv_heads=2)


def micro(config, m, b=2, s=7):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, config.vocab_size, (m * b, s), generator=g)
    tgt = torch.randint(0, config.vocab_size, (m * b, s), generator=g)
    return ids, tgt


def dense_grads(config, m):
    torch.manual_seed(0)
    dense = DenseGPT(config).double()
    ids, tgt = micro(config, m)
    loss = dense(ids, tgt)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in dense.named_parameters()}


def pipelined(config, layout, kind, m, chunks=1, b=2, s=7):
    """Worker body: one pipelined step, recorded; returns (loss or None, stage grads, actions,
    the step's Events from the rank clock, peak in flight)."""
    mesh = Mesh(layout)
    torch.manual_seed(0)
    dense = DenseGPT(config).double()
    models = [
        c.double()
        for c in build_stage_chunks(dense, mesh.tp_group, mesh.pp_rank, layout.pp, chunks)
    ]
    ids, tgt = micro(config, m, b, s)
    acts = schedule(kind, m, layout.pp, mesh.pp_rank, chunks)
    with recorder.Recorder() as rec:
        res = run_schedule(
            models,
            acts,
            Pipe.from_mesh(mesh),
            list(ids.chunk(m)),
            list(tgt.chunk(m)),
            (b, s, config.hidden),
            torch.float64,
        )
    sync_tied_grads(models, mesh.emb_group)
    for c in models:
        c.sync_grads()
    grads = {}
    for c in models:
        grads.update(c.gather_state_dict(grads=True))
    loss = None if res.loss is None else res.loss.item()
    return loss, grads, acts, recorded_events(rec.log, mesh.pp_rank), res.peak_in_flight


def check_against_dense(results, config, m, layout):
    """results: one per rank, in rank order; every last-stage rank (and only those) has the loss."""
    ref_loss, ref = dense_grads(config, m)
    seen = {}
    for rank, (loss, grads, *_) in enumerate(results):
        last = layout.coords(rank)["pp"] == layout.pp - 1
        assert (loss is not None) == last, (rank, loss)
        if last:
            assert loss == pytest.approx(ref_loss, rel=1e-12)
        for name, g in grads.items():
            diff = (g - ref[name]).abs().max().item()
            assert diff <= 1e-10 * ref[name].abs().max().item() + 1e-14, (name, diff)
            seen[name] = True
    assert set(seen) == set(ref), set(ref) - set(seen)


PP2 = Layout(1, 2, 1)


def test_every_schedule_gives_the_dense_gradients_at_pp2():
    def worker():
        out = {}
        for config in (CONFIG, UNTIED):
            for kind, chunks, m in [("gpipe", 1, 3), ("1f1b", 1, 3), ("interleaved", 2, 4)]:
                out[(config.norm, kind)] = pipelined(config, PP2, kind, m, chunks)
        return out

    results = launch(worker, 2)
    for config in (CONFIG, UNTIED):
        for kind, m in [("gpipe", 3), ("1f1b", 3), ("interleaved", 4)]:
            check_against_dense([r[(config.norm, kind)] for r in results], config, m, PP2)
    # the real runs on the rank clock: the schedule's order, every forward before its backward,
    # a wait per receive (activations into stage 1, gradients into stage 0), in-flight bounds
    for kind, m in [("gpipe", 3), ("1f1b", 3), ("interleaved", 4)]:
        for stage, r in enumerate(results):
            *_, acts, events, peak = r[(CONFIG.norm, kind)]
            done = [(e.kind, e.micro, e.chunk) for e in events if e.kind in ("F", "B")]
            assert done == [action_parts(a) for a in acts], (kind, stage, done)
            assert all(done.index(("F", i, 0)) < done.index(("B", i, 0)) for i in range(m))
            waits = [e for e in events if e.kind == "wait"]
            chunks = 2 if kind == "interleaved" else 1
            # each chunk receives an activation and a gradient per micro-batch, but the first
            # virtual stage no activation and the last no gradient: 2v - 1 per micro-batch
            assert len(waits) == (2 * chunks - 1) * m, (kind, stage, len(waits))
            if kind != "interleaved":
                assert peak == (m if kind == "gpipe" else min(m, 2 - stage))


def test_pipeline_with_tp_and_four_stages():
    runs = {  # key: (layout, schedule, micro-batches, chunks)
        "tp2pp2": (Layout(2, 2, 1), "1f1b", 5, 1),
        "pp4": (Layout(1, 4, 1), "1f1b", 6, 1),
        "pp4-gpipe": (Layout(1, 4, 1), "gpipe", 2, 1),
        "pp1-interleaved": (Layout(2, 1, 2), "interleaved", 2, 2),
    }

    def worker():
        return {key: pipelined(CONFIG, lay, kind, m, c) for key, (lay, kind, m, c) in runs.items()}

    results = launch(worker, 4)
    for key, (lay, _, m, _) in runs.items():
        check_against_dense([r[key] for r in results], CONFIG, m, lay)
    peaks = [r["pp4"][-1] for r in results]
    assert peaks == [4, 3, 2, 1]  # 1F1B: p - s activations in flight, not m = 6


def test_a_mismatched_pipeline_ends_in_a_clear_error():
    def worker():
        mesh = Mesh(Layout(1, 2, 1))
        torch.manual_seed(0)
        models = build_stage_chunks(DenseGPT(CONFIG), mesh.tp_group, mesh.pp_rank, 2)
        ids, tgt = micro(CONFIG, 2)
        acts = schedule("1f1b", 2 + mesh.pp_rank, 2, mesh.pp_rank)  # stage 1 expects 3 mbs
        ins = list(ids.chunk(2)) + [ids[:2]]
        run_schedule(
            models,
            acts,
            Pipe.from_mesh(mesh),
            ins,
            list(tgt.chunk(2)) + [tgt[:2]],
            (2, 7, CONFIG.hidden),
            options=StepOptions(recv_timeout=1.0),
        )

    with pytest.raises((LaunchTimeout, RankError), match="gave up waiting for the activation"):
        launch(worker, 2, timeout=20)


def _edge_groups(config, layout):
    """Which group each point-to-point send of an interleaved step used: {(kind, to): name}."""
    from tpedu.comm import collectives
    from tpedu.parallel.pipeline import runtime

    mesh = Mesh(layout)
    names = {id(mesh.groups[k]): k for k in ("pp", "pp_grad", "pp_wrap", "pp_grad_wrap")}
    seen = set()
    real = collectives.isend

    def isend(x, dst, group=None):
        seen.add((dst, names[id(group)]))
        return real(x, dst, group)

    torch.manual_seed(0)
    models = build_stage_chunks(DenseGPT(config), mesh.tp_group, mesh.pp_rank, 2, 2)
    ids, tgt = micro(config, 2, 2, 7)
    acts = schedule("interleaved", 2, 2, mesh.pp_rank, 2)
    runtime.collectives.isend = isend
    try:
        pipe = Pipe.from_mesh(mesh)
        run_schedule(models, acts, pipe, list(ids.chunk(2)), list(tgt.chunk(2)), (2, 7, 16))
    finally:
        runtime.collectives.isend = real
    return sorted(seen)


def test_the_interleaved_wrap_around_edge_has_its_own_groups():
    """pp 2, 2 chunks: stage 0 -> 1 carries activations on "pp", and 1 -> 0 (to chunk 1) on
    "pp_wrap"; gradients go 1 -> 0 on "pp_grad" and 0 -> 1 (back to chunk 0) on
    "pp_grad_wrap". One NCCL communicator carrying both directions between the same two ranks
    can deadlock; gloo cannot show the hang, so the test checks the groups."""
    deep = GPTConfig.gpt2_like(37, seq_len=7, n_layers=4, hidden=16, n_heads=2)
    stage0, stage1 = launch(_edge_groups, 2, deep, Layout(1, 2, 1))
    assert stage0 == [(1, "pp"), (1, "pp_grad_wrap")]
    assert stage1 == [(0, "pp_grad"), (0, "pp_wrap")]
