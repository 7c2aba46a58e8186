"""Preemption (lesson 14): SIGTERM to `python -m tpedu train` is passed on to the ranks, every
rank finishes the same step, saves it and stops, the command exits 143 with one line naming the
step and the command that continues; that command's losses equal an uninterrupted run's, bit for
bit. Also: the ranks agree when only one of them is signalled, and no process is left behind.
"""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from argparse import Namespace
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.processes import descendants, signal_sleeping_ranks
from tpedu import checkpoint, launch
from tpedu.cli.commands import _preempted, _resume_command, main
from tpedu.train import checkpoints
from tpedu.train.config import TrainConfig
from tpedu.train.loop import run_loop
from tpedu.train.preempt import EXIT_CODE, Preempted, agree_to_stop, sigterm_flag

STEPS = 40  # ≈ 1.2 s of training at tp 2 here: the signal lands mid-run with a wide margin
SMALL = (
    f"--layers 2 --hidden 32 --heads 4 --seq 32 --batch 4 --steps {STEPS} --eval-every 1 "
    "--eval-batches 1 --save-every 1000"  # no periodic save: the only checkpoint is SIGTERM's
).split()
LINE = re.compile(
    r"tpedu train: stopped by SIGTERM after step (\d+), saved (\S+); "
    r"continue with: python -m tpedu (.+)"
)


pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def _train_until_first_step_then_sigterm(args: list[str], err: Path) -> tuple[int, list[int]]:
    """Start `python -m tpedu train ...`, wait for rank 0's `step     1:` line (a step is done),
    send SIGTERM to the launching process only; return (exit code, the ranks' pids)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # the line arrives when it is printed
    with err.open("w") as stderr:
        p = subprocess.Popen(
            [sys.executable, "-m", "tpedu", *args],
            stdout=subprocess.PIPE,
            stderr=stderr,  # a file: the progress bar can never fill a pipe nobody reads
            text=True,
            env=env,
        )
    watchdog = threading.Timer(120, p.kill)  # a hang ends the read below instead of the suite
    watchdog.start()
    try:
        for line in p.stdout:
            if line.startswith("step     1:"):
                break
        else:
            pytest.fail(f"training ended before its first step: {err.read_text()[-2000:]}")
        ranks = descendants(p.pid)
        p.send_signal(signal.SIGTERM)
        p.stdout.read()
        code = p.wait(timeout=60)
    finally:
        watchdog.cancel()
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stdout.close()
    return code, ranks


@pytest.mark.parametrize(
    "layout", [["--tp", "2"], ["--tp", "1", "--pp", "2"]], ids=["tp2", "tp1-pp2"]
)
def test_sigterm_saves_the_step_every_rank_finished_and_resuming_is_exact(layout, tmp_path):
    ckpt, summary = tmp_path / "ckpt", tmp_path / "summary.json"
    args = ["train", *layout, *SMALL, "--ckpt-dir", str(ckpt), "--json", str(summary)]
    start = time.monotonic()
    code, ranks = _train_until_first_step_then_sigterm(args, tmp_path / "err")
    took = time.monotonic() - start
    err = (tmp_path / "err").read_text()
    assert code == EXIT_CODE == 143, err[-3000:]
    assert len(ranks) >= 2, "the ranks were not found while training"
    assert not [pid for pid in ranks if Path(f"/proc/{pid}").exists()], "a rank survived"

    line = err.strip().splitlines()[-1]
    m = LINE.fullmatch(line)
    assert m, line
    step = int(m.group(1))
    assert 2 <= step < STEPS, f"{line} (took {took:.1f} s)"  # SIGTERM came after step 1's line
    assert not summary.exists()  # stopped, not finished

    # The one checkpoint: step `step`, complete (a shard file from every rank, sizes and
    # checksums as the index says), and `latest` points at it.
    step_dir = ckpt / checkpoint.step_name(step)
    assert Path(m.group(2)) == step_dir
    assert sorted(p.name for p in ckpt.iterdir()) == [checkpoint.LATEST, step_dir.name]
    assert (ckpt / checkpoint.LATEST).read_text().strip() == step_dir.name
    resolved, index = checkpoint.check_files(ckpt, verify=True)
    assert resolved == step_dir and index["step"] == step
    assert len(index["files"]) == 2  # tp 2: one per TP rank; pp 2: one per stage

    # The printed command continues the run; its losses are an uninterrupted run's, exactly.
    again = shlex.split(m.group(3))
    assert again[-2:] == ["--resume", str(ckpt)]
    assert main(again) == 0
    resumed = json.loads(summary.read_text())
    uninterrupted = ["--ckpt-dir", str(tmp_path / "ref"), "--json", str(tmp_path / "ref.json")]
    assert main(["train", *layout, *SMALL, *uninterrupted]) == 0
    ref = json.loads((tmp_path / "ref.json").read_text())
    assert len(resumed["losses"]) == STEPS - step
    assert resumed["losses"] == ref["losses"][step:]
    assert resumed["history"] == [h for h in ref["history"] if h["step"] > step]


def _signal_one_rank(signalled: int, at: int, ckpt_dir: str | None) -> dict:
    """run_loop with stand-in steps; rank `signalled` sends itself SIGTERM during step `at`."""
    saves: list[tuple[int, str | None]] = []

    def step(k: int) -> tuple[float, float]:
        if k == at and dist.get_rank() == signalled:
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01 * dist.get_rank())  # ranks out of step with each other
        return float(k), 1.0

    def save(k: int) -> object:
        path = checkpoints.save_if_due(cfg, k, None, None)
        saves.append((k, None if path is None else str(path)))
        return path

    cfg = TrainConfig(steps=10, eval_every=0, progress=False, ckpt_dir=ckpt_dir, save_every=4)
    before = signal.getsignal(signal.SIGTERM)
    try:
        run_loop(cfg, 0, "test", step, evaluate=lambda: 0.0, save=save)
    except Preempted as e:
        stopped = {"step": e.step, "path": e.path, "message": str(e)}
    else:
        stopped = None
    return {
        "stopped": stopped,
        "saves": saves,
        "handler_restored": signal.getsignal(signal.SIGTERM) == before,
    }


@pytest.mark.parametrize(
    ("signalled", "at", "calls", "written"),
    [
        (0, 2, [1, 2, 3, 3], [3]),  # 3 is not due (save_every 4): saved by a second, forced call
        (3, 5, [1, 2, 3, 4, 5, 6, 6], [4, 6]),  # 4: the periodic save
        (2, 3, [1, 2, 3, 4], [4]),  # 4 is due anyway: saved once
    ],
)
def test_every_rank_stops_after_the_step_in_which_any_rank_got_sigterm(
    signalled, at, calls, written, tmp_path, monkeypatch
):
    """4 ranks, one of them signalled during step `at`: every rank stops after that step and
    saves checkpoint `at` + 1 (checkpoint.save is a stand-in here: no model)."""
    monkeypatch.setattr(checkpoints, "save", lambda root, m, o, k, **kw: Path(root) / f"s{k}")
    stop = at + 1
    for r in launch(_signal_one_rank, 4, signalled, at, str(tmp_path)):
        assert r["handler_restored"]
        assert r["stopped"] == {
            "step": stop,
            "path": str(tmp_path / f"s{stop}"),
            "message": f"stopped by SIGTERM after step {stop}: saved {tmp_path / f's{stop}'}",
        }
        assert [k for k, _ in r["saves"]] == calls
        assert [k for k, path in r["saves"] if path] == written


def test_without_a_ckpt_dir_the_ranks_still_stop_together_and_say_nothing_was_saved():
    results = launch(_signal_one_rank, 2, 1, 3, None)
    for r in results:
        assert r["stopped"] == {
            "step": 4,
            "path": None,
            "message": "stopped by SIGTERM after step 4: nothing was saved (no ckpt_dir)",
        }


def _flag_and_agree() -> tuple[bool, bool]:
    with sigterm_flag() as flag:
        if dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # sets the flag; the process lives on
        return flag.raised, agree_to_stop(flag)


def test_the_flag_is_per_rank_and_the_agreement_is_global():
    assert launch(_flag_and_agree, 3) == [(False, True), (True, True), (False, True)]


def test_the_cli_line_and_the_resume_command(capsys):
    args = Namespace(ckpt_dir="runs/my ckpt")
    argv = ["train", "--tp", "2", "--resume", "old", "--steps", "9", "--res=older"]
    assert _preempted(Preempted(7, "runs/my ckpt/step_00000007"), args, argv) == 143
    assert capsys.readouterr().err == (
        "tpedu train: stopped by SIGTERM after step 7, saved runs/my ckpt/step_00000007; "
        "continue with: python -m tpedu train --tp 2 --steps 9 --resume 'runs/my ckpt'\n"
    )
    assert _resume_command(["train"], "d") == "python -m tpedu train --resume d"
    assert _preempted(Preempted(3, None), Namespace(ckpt_dir=None), ["train"]) == 143
    assert capsys.readouterr().err == (
        "tpedu train: stopped by SIGTERM after step 3; nothing could be saved (no --ckpt-dir): "
        "add --ckpt-dir DIR to be able to resume\n"
    )


def test_a_worker_without_a_handler_ends_by_sigterm_and_nothing_is_left(tmp_path):
    """SIGTERM to a script's launching process reaches the ranks as SIGTERM (not a kill): a
    worker that does not handle it ends by it, and the launch reports that."""
    out, pids = signal_sleeping_ranks(tmp_path, signal.SIGTERM, "tpedu.RankError", "e")
    assert "was killed by signal SIGTERM" in out, out
    assert not [pid for pid in pids if Path(f"/proc/{pid}").exists()], "a rank survived"
