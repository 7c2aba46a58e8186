"""`tpedu train --trace FILE` and tpedu.analysis.clock.trace: a Chrome trace / Perfetto JSON
file that follows the Trace Event Format's rules, with both clocks of every rank."""

import json
from collections import defaultdict

import pytest

from tests.helpers import cli, one_line_error, pipeline_logs
from tpedu.analysis.clock import trace
from tpedu.comm.recorder import Mark, RankLog

PHASES = {"X", "B", "E", "i", "I", "M"}
METADATA = {"process_name", "thread_name", "process_sort_index", "thread_sort_index"}


def check_trace_format(doc: dict) -> None:
    """The rules chrome://tracing and Perfetto read a JSON trace by: an object with a
    traceEvents list; every event a known phase with integer pid and tid; metadata events
    named and carrying args; timed events with a non-negative microsecond ts (X: a dur);
    B/E matched per track, and complete events on one track nested, never crossing."""
    assert isinstance(doc, dict) and isinstance(doc["traceEvents"], list)
    assert doc.get("displayTimeUnit", "ms") in ("ms", "ns")
    spans, stacks = defaultdict(list), defaultdict(list)
    for e in doc["traceEvents"]:
        assert e["ph"] in PHASES, e
        assert type(e["pid"]) is int and type(e["tid"]) is int, e
        assert isinstance(e["name"], str) and e["name"], e
        if e["ph"] == "M":
            assert e["name"] in METADATA and isinstance(e["args"], dict), e
            continue
        assert isinstance(e["ts"], int | float) and e["ts"] >= 0, e
        track = (e["pid"], e["tid"])
        if e["ph"] == "X":
            assert isinstance(e["dur"], int | float) and e["dur"] >= 0, e
            spans[track].append((e["ts"], e["ts"] + e["dur"]))
        elif e["ph"] == "B":
            stacks[track].append(e["ts"])
        elif e["ph"] == "E":
            assert stacks[track] and stacks[track].pop() <= e["ts"], e
        else:
            assert e.get("s", "t") in ("g", "p", "t"), e
    assert not any(stacks.values()), "a begin event without its end"
    eps = 1e-3  # timestamps are rounded to the nanosecond
    for track, xs in spans.items():
        open_ends: list[float] = []
        for start, end in sorted(xs, key=lambda s: (s[0], -s[1])):
            while open_ends and open_ends[-1] <= start + eps:
                open_ends.pop()
            assert not open_ends or end <= open_ends[-1] + eps, f"{track}: spans cross"
            open_ends.append(end)


def test_the_format_check_fails_bad_traces():
    good = {"traceEvents": [{"name": "a", "ph": "X", "pid": 0, "tid": 0, "ts": 0, "dur": 5}]}
    check_trace_format(good)
    for bad in (
        {"name": "a", "ph": "X", "pid": 0, "tid": 0, "ts": -1, "dur": 5},
        {"name": "a", "ph": "X", "pid": "0", "tid": 0, "ts": 0, "dur": 5},
        {"name": "a", "ph": "Q", "pid": 0, "tid": 0, "ts": 0},
        {"name": "a", "ph": "B", "pid": 0, "tid": 0, "ts": 0},
        {"name": "a", "ph": "X", "pid": 0, "tid": 0, "ts": 3, "dur": 5},  # crosses the first
    ):
        with pytest.raises(AssertionError):
            check_trace_format({"traceEvents": [*good["traceEvents"], bad]})


def test_write_hand_built_pipeline(tmp_path):
    logs = pipeline_logs("1f1b", 2, 4, 0.001, 0.002)
    for log in logs:  # wall times as if measured: spans one after the other
        t = 0.0
        for s in log.spans:
            if hasattr(s, "wall_start"):
                s.wall_start, s.wall_end = t, t + getattr(s, "cpu", 0.0)
                t = s.wall_end
    timeline = trace.write(tmp_path / "p.json", logs, "free")
    doc = json.loads((tmp_path / "p.json").read_text())
    check_trace_format(doc)
    replayed = [e for e in doc["traceEvents"] if e["pid"] >= trace.REPLAYED and e["ph"] == "X"]
    assert max(e["ts"] + e["dur"] for e in replayed) == pytest.approx(timeline.step * 1e6)
    assert timeline.bubble == pytest.approx(1 / 5)


def test_marks_with_data_keep_it_in_the_trace():
    """A ZeRO buffer's gather / free mark carries the buffer's name and bytes into the trace;
    a plain mark (a step boundary) carries none."""
    log = RankLog(0, "run", [Mark("step 0", 0.0), Mark("gather", 0.5, "block 1", 4096)])
    marks = [e for e in trace.recorded_trace([log]) if e["ph"] == "i"]
    assert [m.get("args") for m in marks] == [None, {"what": "block 1", "bytes": 4096}]
    check_trace_format({"traceEvents": marks})


def test_train_trace_tp2_pp2(tmp_path, capfd):
    path = tmp_path / "t.json"
    small = "--layers 2 --hidden 32 --heads 4 --seq 16 --batch 4 --eval-every 0".split()
    args = ["train", "--tp", "2", "--pp", "2", "--steps", "3", *small]
    code, _, err = cli(capfd, *args, "--trace", str(path), "--json", str(tmp_path / "a.json"))
    assert code == 0, err
    code, _, err = cli(capfd, *args, "--json", str(tmp_path / "b.json"))
    assert code == 0, err
    losses = [json.loads((tmp_path / f).read_text())["losses"] for f in ("a.json", "b.json")]
    assert losses[0] == losses[1]  # recording changes nothing, bit for bit
    doc = json.loads(path.read_text())
    check_trace_format(doc)
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    for r in range(4):
        assert names[r] == f"rank {r} · measured (wall clock here)"
        assert names[trace.REPLAYED + r].startswith(f"rank {r} · replayed (a core per rank")
    events = [e for e in doc["traceEvents"] if e["ph"] != "M"]
    for r in range(4):
        steps = [e["name"] for e in events if e["pid"] == r and e["ph"] == "i"]
        assert steps == ["step 0", "step 1", "step 2"]
        mine = {e["name"] for e in events if e["pid"] == r and e["tid"] == trace.COMM}
        assert "all_reduce" in mine  # tensor parallelism's
        assert {"issue send", "issue recv", "wait recv"} <= mine, mine  # the pipeline's
        for pid in (r, trace.REPLAYED + r):
            assert any(e["pid"] == pid and e["tid"] == trace.COMPUTE for e in events)


@pytest.mark.parametrize(
    "path,message",
    [
        ("/nonexistent/t.json", "--trace /nonexistent/t.json: directory /nonexistent does not"),
        ("/tmp", "--trace /tmp is a directory; give a file name"),
    ],
)
def test_bad_trace_path_is_exit_2(path, message, capfd):
    one_line_error(capfd, ["train", "--tp", "2", "--steps", "1", "--trace", path], message)
