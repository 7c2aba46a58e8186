"""Rank clocks: the recorder logs what the ranks did, the replay is exact on logs whose answer
is known (pipeline bubbles, a lone all-reduce, a hidden async all-reduce), and bad input is a
one-line error."""

import time

import pytest
import torch
import torch.distributed as dist

from tests.helpers import Builder, pipeline_logs
from tpedu import launch
from tpedu.analysis.clock import links, replay
from tpedu.analysis.clock.events import recorded_events, replayed_events
from tpedu.comm import collectives as C
from tpedu.comm import recorder
from tpedu.comm.cost_model import AlphaBeta
from tpedu.comm.recorder import Comm, Compute, Mark, RankLog, Wait
from tpedu.parallel.pipeline.schedules import Event, action_parts, schedule


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (3, 1)])
def test_pipeline_bubble_is_the_formula_with_free_links(kind, p, m):
    f, b = 0.001, 0.002
    t = replay.replay(pipeline_logs(kind, p, m, f, b), "free")
    assert t.step == pytest.approx((m + p - 1) * (f + b), rel=1e-12)
    assert t.bubble == pytest.approx((p - 1) / (m + p - 1), rel=1e-12)
    assert t.exposed == 0 and t.hidden == 0


def test_pipeline_links_add_the_transfers():
    # GPipe, p 2, m 1: F0 -> send -> F1, B1 -> send -> B0; two transfers on the critical path
    net = AlphaBeta(1e-4, 1e-9)
    t = replay.replay(pipeline_logs("gpipe", 2, 1, 0.001, 0.002, 10_000), net)
    hop = 1e-4 + 10_000 * 1e-9
    assert t.step == pytest.approx(2 * (0.001 + 0.002) + 2 * hop, rel=1e-12)
    # each rank waits through both transfers: the one it receives and the one it sends
    assert t.exposed == pytest.approx(2 * hop)


@pytest.mark.parametrize("ranks", [2, 4])
def test_ring_all_reduce_alone_is_its_alpha_beta_time(ranks):
    net = links.link("nvlink")
    logs = []
    for r in range(ranks):
        b = Builder(r)
        b.comm("all_reduce", range(ranks), 1 << 24)
        logs.append(b.log)
    t = replay.replay(logs, net)
    expected = net.predict("all_reduce", 1 << 24, ranks)
    assert expected > 0 and t.step == pytest.approx(expected, rel=1e-12)
    assert t.exposed == pytest.approx(expected) and t.hidden == 0 and t.bubble == 0


def test_collective_starts_when_its_last_member_issues_it():
    net = AlphaBeta(1e-3, 0.0)
    logs = []
    for r, work in enumerate([0.010, 0.004]):
        b = Builder(r)
        b.compute(work)
        b.comm("all_reduce", (0, 1), 8)
        logs.append(b.log)
    t = replay.replay(logs, net)
    assert t.step == pytest.approx(0.010 + 2e-3)  # 2(t-1) = 2 ring steps of α
    assert t.idle_per_rank == pytest.approx([0.0, 0.006])  # rank 1 waits for rank 0


@pytest.mark.parametrize("compute,hidden", [(0.010, True), (0.001, False)])
def test_async_all_reduce_beside_compute(compute, hidden):
    net = AlphaBeta(1e-3, 0.0)
    cost = net.predict("all_reduce", 8, 2)
    logs = []
    for r in range(2):
        b = Builder(r)
        i = b.comm("all_reduce", (0, 1), 8, blocking=False)
        b.compute(compute)
        b.wait(i)
        logs.append(b.log)
    t = replay.replay(logs, net)
    assert t.step == pytest.approx(max(compute, cost))
    if hidden:  # shorter than the compute beside it: fully hidden
        assert t.hidden == pytest.approx(cost) and t.exposed == 0
    else:
        assert t.exposed == pytest.approx(cost - compute)
        assert t.hidden == pytest.approx(compute)


def test_async_calls_queue_on_the_lane_and_factor_scales_compute():
    net = AlphaBeta(1e-3, 0.0)  # each all-reduce of 2 ranks: 2 ms
    logs = []
    for r in range(2):
        b = Builder(r)
        i = b.comm("all_reduce", (0, 1), 8, blocking=False)
        j = b.comm("all_reduce", (0, 1), 8, blocking=False)
        b.compute(0.001)
        b.wait(i)
        b.wait(j)
        logs.append(b.log)
    assert replay.replay(logs, net).step == pytest.approx(0.004)  # one after the other
    assert replay.replay(logs, net, factor=10).step == pytest.approx(0.010)


def test_receive_ends_no_earlier_than_its_send():
    a, b = Builder(0), Builder(1)
    a.compute(0.005)
    a.comm("send", (0, 1), 8, peer=1)
    b.comm("recv", (0, 1), 8, peer=0)
    b.compute(0.001)
    t = replay.replay([a.log, b.log], AlphaBeta(1e-3, 0.0))
    assert t.step == pytest.approx(0.005 + 1e-3 + 0.001)


def test_bad_input_is_one_line_errors():
    with pytest.raises(ValueError, match="unknown link 'nvlnk'; use one of free, loopback"):
        links.link("nvlnk")
    logs = pipeline_logs("gpipe", 2, 2, 1.0, 1.0)
    logs[1].run = "other"
    with pytest.raises(ValueError, match="different runs .*record every rank in one run"):
        replay.replay(logs)
    with pytest.raises(ValueError, match="same rank"):
        replay.replay([logs[0], logs[0]])
    a, b = Builder(0), Builder(1)
    a.comm("all_reduce", (0, 1), 8)
    b.comm("all_gather", (0, 1), 8)
    with pytest.raises(ValueError, match="do not match"):
        replay.replay([a.log, b.log])
    a, b = Builder(0), Builder(1)
    a.comm("all_reduce", (0, 1), 8)
    with pytest.raises(ValueError, match="rank 0 waits for all_reduce on ranks \\[0, 1\\]"):
        replay.replay([a.log, b.log])
    with pytest.raises(ValueError, match="unknown device"):
        links.device_factor(1e9, 1.0, "H200")


def _recorded():
    rank = dist.get_rank()
    x = torch.arange(4.0) + rank
    plain = C.all_reduce(x.clone())  # not recording
    with recorder.Recorder(recorder.run_id()) as rec:
        y = C.all_reduce(x.clone())
        time.sleep(0.05)  # wall time without CPU time: the span's cpu leaves it out
        torch.randn(300, 300) @ torch.randn(300, 300)  # a compute span with CPU time
        work = C.all_reduce(z := x.clone(), async_op=True)
        work.wait()
        work.wait()  # a second wait is logged once
        buf = torch.empty(4)
        if rank == 0:
            C.isend(x.clone(), 1).wait()
        else:
            C.recv(buf, 0)
    logs = recorder.gather(rec.log)
    return plain, y, z, logs


def test_recorder_logs_every_call_in_order():
    results = launch(_recorded, 2)
    for plain, y, z, _ in results:
        assert torch.equal(plain, y) and torch.equal(plain, z)  # recording changes nothing
    logs = results[0][3]
    assert [log.rank for log in logs] == [0, 1] and logs[0].run == logs[1].run
    for r, log in enumerate(logs):
        comms = log.comms()
        assert [(c.op, c.blocking, c.seq) for c in comms] == [
            ("all_reduce", True, 0),
            ("all_reduce", False, 1),
            ("send" if r == 0 else "recv", r == 1, 0),
        ]
        assert comms[0].group == (0, 1) and comms[0].nbytes == 16
        assert comms[2].peer == 1 - r
        waits = [s for s in log.spans if isinstance(s, Wait)]
        assert [log.spans[w.comm] for w in waits] == comms[1 : 3 - r]
        big = max((s for s in log.spans if isinstance(s, Compute)), key=lambda s: s.cpu)
        assert big.cpu > 0 and big.wall_end - big.wall_start - big.cpu >= 0.04  # the sleep
    t = replay.replay(logs, "loopback")
    assert t.step > 0 and len({s.rank for s in t.spans}) == 2
    assert replay.measured(logs) > 0


def test_not_recording_is_the_plain_call():
    assert not recorder.on()
    with pytest.raises(RuntimeError, match="already recording"), recorder.Recorder():
        with recorder.Recorder():
            pass


class _Stage(torch.nn.Module):
    def __init__(self, last: bool) -> None:
        super().__init__()
        self.lin, self.last = torch.nn.Linear(8, 8), last

    def forward(self, x, targets=None, step=0):
        y = self.lin(x)
        return ((y - targets) ** 2).mean() if self.last else y


def _pipeline_recorded(kind: str, m: int):
    from tpedu.parallel.pipeline import Pipe, run_schedule

    s = dist.get_rank()
    pipe = Pipe(s, [0, 1], dist.new_group([0, 1]), dist.new_group([0, 1]))
    torch.manual_seed(s)
    xs = [torch.randn(2, 3, 8) for _ in range(m)]
    with recorder.Recorder(recorder.run_id()) as rec:
        run_schedule([_Stage(s == 1)], schedule(kind, m, 2, s), pipe, xs, xs, (2, 3, 8))
    return recorder.gather(rec.log)


def test_pipeline_runtime_feeds_the_recorder():
    m = 4
    logs = launch(_pipeline_recorded, 2, "1f1b", m)[0]
    for s, log in enumerate(logs):
        names = [c.name for c in log.spans if isinstance(c, Compute)]
        # every forward and backward is a named compute span, in the schedule's order
        order = [n for n in names if n[0] in "FB" and n[1:].isdigit()]
        assert order == [f"{k}{mb}" for k, mb, _ in map(action_parts, schedule("1f1b", m, 2, s))]
        ops = [(c.op, c.blocking, c.peer) for c in log.comms()]
        sent = "send" if s == 0 else "recv"  # activations 0 -> 1, gradients 1 -> 0
        assert ops.count(("send", False, 1 - s)) == m and ops.count(("recv", False, 1 - s)) == m
        assert ops[0][0] == sent
    t = replay.replay(logs, "free")
    busy = [
        sum(s.end - s.start for s in t.spans if s.rank == r and s.name[0] in "FB") for r in (0, 1)
    ]
    assert t.step >= max(busy) > 0 and 0 < t.bubble < 1


def _overlap_recorded():
    from tpedu.tp.overlap import linear_with_async_grad_all_reduce

    torch.manual_seed(0)
    x = torch.randn(64, 128, requires_grad=True)
    w = torch.randn(128, 128, requires_grad=True)
    with recorder.Recorder(recorder.run_id()) as rec:
        linear_with_async_grad_all_reduce(x, w, None).sum().backward()
    return recorder.gather(rec.log)


def test_tp_overlap_feeds_the_recorder():
    logs = launch(_overlap_recorded, 2)[0]
    for log in logs:
        (comm,) = log.comms()
        assert (comm.op, comm.blocking, comm.nbytes) == ("all_reduce", False, 64 * 128 * 4)
        i = log.spans.index(comm)
        j = next(k for k, s in enumerate(log.spans) if isinstance(s, Wait))
        # issued, then the weight gradient beside it, then the wait
        assert i < j and all(isinstance(s, Compute) for s in log.spans[i + 1 : j])
        assert "weight grad" in [s.name for s in log.spans[i + 1 : j]]
    # on a link fast enough, dL/dW hides it (on the rank that issued last; the other may wait
    # for that rank's issue, which is exposed there)
    t = replay.replay(logs, AlphaBeta(0.0, 1e-12))
    assert max(t.hidden_per_rank) > 0 and min(t.exposed_per_rank) == 0


def test_priced_compute_runs_the_flops_at_the_device_efficiency():
    # 2 s of recorded CPU that hold one second's FLOPs of an H100 at 70 %: factor 1/2
    flops = 989e12 * 0.7
    assert links.device_factor(flops, 2.0, "H100 SXM", 0.7) == pytest.approx(0.5, rel=1e-12)
    b = Builder(0)
    b.compute(2.0)
    t = replay.replay([b.log], "nvlink", links.device_factor(flops, 2.0))
    assert t.step == pytest.approx(1.0, rel=1e-12)
    assert links.link("nvlink") is links.LINKS["nvlink"]


def _dp_recorded():
    from tpedu.parallel.data_parallel import DataParallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    dp = DataParallel(model, bucket_numel=64 * 64 + 64)  # one bucket per layer
    x = torch.randn(32, 64) + dist.get_rank()
    with recorder.Recorder(recorder.run_id()) as rec:
        model(x).square().mean().backward()
        dp.finish()
    return recorder.gather(rec.log)


def test_data_parallel_buckets_feed_the_recorder():
    logs = launch(_dp_recorded, 2)[0]
    for log in logs:
        comms = log.comms()
        # 4 buckets, each an asynchronous all-reduce issued from a backward hook, then waited
        assert [(c.op, c.blocking) for c in comms] == [("all_reduce", False)] * 4
        assert sorted(c.nbytes for c in comms) == [(64 * 64 + 64) * 4] * 4
        waits = [s for s in log.spans if isinstance(s, Wait)]
        assert len(waits) == 4 and log.spans.index(waits[0]) > log.spans.index(comms[-1])
    # the first buckets' all-reduces run beside the rest of backward
    assert replay.replay(logs, AlphaBeta(0.0, 1e-12)).hidden > 0


def test_each_group_prices_on_its_own_link():
    logs = []
    for r in range(2):
        b = Builder(r)
        b.comm("all_reduce", (0, 1), 1 << 20)
        b.log.spans[-1].group_name = "tp"
        b.comm("all_reduce", (0, 1), 1 << 20)
        b.log.spans[-1].group_name = "dp"
        logs.append(b.log)
    nv, ib = links.link("nvlink"), links.link("infiniband")
    t = replay.replay(logs, {"tp": "nvlink", "*": "infiniband"})
    both = nv.predict("all_reduce", 1 << 20, 2) + ib.predict("all_reduce", 1 << 20, 2)
    assert nv.predict("all_reduce", 1 << 20, 2) < ib.predict("all_reduce", 1 << 20, 2)
    assert t.step == pytest.approx(both, rel=1e-12)
    with pytest.raises(ValueError, match="no link for group 'dp': add 'dp' or '\\*'"):
        replay.replay(logs, {"tp": "nvlink"})


def _two_ranks():
    # rank 0 computes 1 s of CPU in 2 s of wall clock, then waits for rank 1 (3 s of CPU in
    # 3.5 s) in one blocking all-reduce; the wall clock ends at 4 s
    logs = []
    for r, (cpu, wall) in enumerate([(1.0, 2.0), (3.0, 3.5)]):
        log = recorder.RankLog(r, "run")
        log.spans.append(Compute("c", 0.0, wall, cpu))
        log.spans.append(recorder.Comm("all_reduce", (0, 1), "dp", 1000, None, 0, True, wall, 4.0))
        logs.append(log)
    return logs


def test_three_clocks_of_a_known_step():
    from tpedu.analysis.clock import clocks
    from tpedu.analysis.whatif import HARDWARE

    net = AlphaBeta(1e-3, 0.0)  # a 2-rank all-reduce: 2 ring steps of α
    peak = HARDWARE["H100 SXM"].peak_flops
    # 4 s of CPU in all, FLOPs of 2 s at 70 % of the peak: priced compute takes half its CPU time
    rows = clocks.three_clocks(_two_ranks(), net, flops=2 * 0.7 * peak, link=net, cores=2)
    got = [(r.clock, r.step, r.compute, r.waiting, r.exposed, r.hidden, r.bubble) for r in rows]
    want = [
        ("measured", 4.0, 2.75, 1.25, None, None, None),
        ("replayed", 3.002, 2.0, 1.002, 0.002, 0.0, 1 / 3.002),
        ("replayed", 3.0, 2.0, 1.0, 0.0, 0.0, 1 / 3),
        ("priced", 1.502, 1.0, 0.502, 0.002, 0.0, 0.5 / 1.502),
    ]
    for g, w in zip(got, want, strict=True):
        assert [x is None for x in g] == [x is None for x in w]
        assert g[0] == w[0]
        assert [x for x in g[1:] if x is not None] == pytest.approx(
            [x for x in w[1:] if x is not None], rel=1e-9, abs=1e-12
        )
    assert [r.what for r in rows] == [
        "wall clock here, 2 ranks on 2 cores",
        "a core per rank, loopback link",
        "a core per rank, free links",
        "H100 SXM: α-β link, 70% of peak",
    ]
    # a factor given is used as it is; neither factor nor FLOPs: no priced row
    priced = clocks.three_clocks(_two_ranks(), net, factor=0.25, link="free", priced="x")[-1]
    assert (priced.what, priced.step) == ("x", pytest.approx(0.75))
    assert [r.clock for r in clocks.three_clocks(_two_ranks(), "free")][-1] == "replayed"


def test_three_clocks_table_labels_every_row():
    from tpedu.analysis.clock import clocks

    rows = clocks.three_clocks(_two_ranks(), "free", factor=0.5, cores=2)
    rows.append(clocks.Row("formula", "equal ranks", step=3.0))
    lines = clocks.table(rows, "dp 2").splitlines()
    assert lines[0].split() == [
        "clock",
        "step",
        "ms",
        "compute",
        "waiting",
        "exposed",
        "hidden",
        "bubble",
    ]
    assert lines[1].startswith("dp 2     measured (wall clock here, 2 ranks on 2 cores)")
    assert lines[1].split()[-3:] == ["4000.000", "2750.000", "1250.000"]  # ms; blanks after
    assert lines[3].split()[-6:] == ["3000.000", "2000.000", "1000.000", "0.000", "0.000", "33.3%"]
    assert lines[4].startswith("         priced (H100 SXM: nvlink, 70% of peak)")
    assert lines[5].split()[-1] == "3000.000" and "formula (equal ranks)" in lines[5]


def test_marks_with_data_and_the_pipeline_events_of_a_log():
    recorder.mark("free", "block 0", 8)  # not recording: nothing, no error
    with recorder.Recorder() as rec:
        recorder.mark("step 0")
        recorder.mark("free", "block 0", 8)
    marks = [s for s in rec.log.spans if isinstance(s, Mark)]
    assert [(m.name, m.what, m.nbytes) for m in marks] == [
        ("step 0", "", 0),
        ("free", "block 0", 8),
    ]
    # a hand-built stage 1: receive, F0 split by a TP all-reduce, send, B0, a buffer freed
    log = RankLog(1, "r")
    log.spans += [
        Compute("compute", 0.0, 1.0, 1.0),
        Comm("recv", (0, 1), "pp", 8, 0, 0, False, 1.0, 1.1),
        Wait(1, 1.1, 2.0),
        Compute("F0", 2.0, 3.0, 1.0),
        Comm("all_reduce", (1, 2), "tp", 8, None, 0, True, 3.0, 3.5),
        Compute("F0", 3.5, 4.0, 0.5),
        Comm("send", (0, 1), "pp", 8, 0, 0, False, 4.0, 4.1),
        Compute("compute", 4.1, 5.0, 0.9),
        Compute("B0.1", 5.0, 6.0, 1.0),
        Mark("free", 6.0, "block 0", 8),
        Compute("compute", 6.0, 7.0, 1.0),
        Wait(6, 7.0, 7.5),  # a send's wait is no receive
    ]
    assert recorded_events(log) == [
        Event(1, "wait", -1, -1, 1.0, 2.0),
        Event(1, "F", 0, 0, 2.0, 4.0),
        Event(1, "B", 0, 1, 5.0, 6.0),
    ]
    assert recorded_events(log, stage=0)[0].stage == 0
    # the replay: F/B spans and waits of each rank; a mark with data is no step boundary
    b = Builder(0)
    b.compute(1.0, "F0")
    b.log.spans.append(Mark("free", 0.0, "block 0", 8))
    b.log.spans.append(Mark("step 1", 0.0))
    b.compute(2.0, "B0")
    t = replay.replay([b.log])
    assert list(t.marks) == ["step 1"]
    assert replayed_events(t) == [Event(0, "F", 0, 0, 0.0, 1.0), Event(0, "B", 0, 0, 1.0, 3.0)]


def test_recorded_events_join_a_forward_split_by_calls():
    """bench_scaling's stages (pipeline and TP): one Event per forward or backward."""
    log = RankLog(0, "r")
    log.spans = [
        Compute("compute", 0.0, 1.0, 1.0),
        Compute("F0", 1.0, 2.0, 1.0),
        Comm("all_reduce", (0, 1), "tp", 4, None, 0, True, 2.0, 3.0),  # inside F0
        Compute("F0", 3.0, 4.0, 1.0),
        Comm("send", (0, 1), "pp", 4, 1, 0, False, 4.0, 5.0),
        Compute("F1.1", 5.0, 6.0, 1.0),
        Compute("B1.1", 6.0, 7.0, 1.0),
        Compute("weight grad", 7.0, 8.0, 1.0),
    ]
    got = [(e.stage, e.kind, e.micro, e.chunk, e.start, e.end) for e in recorded_events(log, 2)]
    assert got == [(2, "F", 0, 0, 1.0, 4.0), (2, "F", 1, 1, 5.0, 6.0), (2, "B", 1, 1, 6.0, 7.0)]
