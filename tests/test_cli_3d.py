"""`python -m tpedu train --tp T --pp P --dp D`: plainly (8 local ranks, through the CLI's
`main` in this process to save an interpreter start) and as a real two-"node" torchrun job on
loopback, both matching the one-process run's losses and gradient norms step by step.

Tolerance 2e-5 relative: float32, sums reordered by micro-batching, DP and TP (see
tests/test_train_3d.py). The losses alone miss an error that scales the whole gradient (a sum
over DP replicas instead of the mean): AdamW divides by √v and clipping rescales, so the updates
do not change. The gradient norm does: `--eval-every 1` records it in the history every step.
"""

import json
import subprocess
import sys

import pytest

from tests.helpers import cli  # the CLI in this process: (exit code, stdout, stderr)
from tpedu.cli.commands import main
from tpedu.launcher import free_port

SMALL = "--layers 2 --hidden 32 --heads 4 --seq 16 --batch 4 --steps 3 --eval-every 1".split()


def read_summary(path):
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("ref") / "s.json"
    assert main(["train", "--tp", "1", *SMALL, "--json", str(path)]) == 0
    return read_summary(path)


def same(got, ref):
    """Every step's loss, gradient norm (before clipping) and validation loss."""
    assert len(got["losses"]) == len(ref["losses"]) == 3
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"], strict=True)):
        assert a == pytest.approx(b, rel=2e-5), f"step {step}: {a} vs one process {b}"
    assert [h["step"] for h in ref["history"]] == [1, 2, 3]
    for h, r in zip(got["history"], ref["history"], strict=True):
        assert h["step"] == r["step"]
        assert h["grad_norm"] == pytest.approx(r["grad_norm"], rel=2e-5), f"{h} vs {r}"
        assert h["val_loss"] == pytest.approx(r["val_loss"], rel=2e-5), f"{h} vs {r}"


def test_train_2x2x2_plainly_on_8_ranks(reference, tmp_path, capfd):
    args = ["train", *"--tp 2 --pp 2 --dp 2".split(), *SMALL, "--stage-split", "flops"]
    code, out, err = cli(capfd, *args, "--json", str(tmp_path / "s.json"))
    assert code == 0, err
    summary = json.loads(out[out.index("{") :])
    assert (summary["tp"], summary["pp"], summary["dp"]) == (2, 2, 2)
    assert summary["stages"] == [[0, 1], [1, 2]]  # 2 blocks on 2 stages: one each, head or not
    assert summary["settings"]["parallel"]["stage_split"] == "flops"
    same(read_summary(tmp_path / "s.json"), reference)


def test_two_node_torchrun_on_loopback(reference, tmp_path):
    """Two torchrun agents (node_rank 0 and 1, one process each: the two pipeline stages) meet
    through a c10d rendezvous on 127.0.0.1, as two machines would."""
    port = free_port()
    procs = []
    for node in (0, 1):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc_per_node",
            "1",
            "--node_rank",
            str(node),
            "--rdzv_backend",
            "c10d",
            "--rdzv_endpoint",
            f"127.0.0.1:{port}",
            "--rdzv_id",
            f"tpedu-{port}",
            "-m",
            "tpedu",
            "train",
            "--tp",
            "1",
            "--pp",
            "2",
            *SMALL,
            "--json",
            str(tmp_path / f"s{node}.json"),
        ]
        procs.append(
            subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    written = [f for f in (tmp_path / "s0.json", tmp_path / "s1.json") if f.exists()]
    assert len(written) == 1  # global rank 0 writes the summary, on whichever node it landed
    same(read_summary(written[0]), reference)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tp", "1", "--dp", "3", *SMALL], "--batch 4 is not divisible by --dp 3"),
        (["--tp", "1", "--pp", "3", *SMALL], "--pp 3: 2 layers cannot be split over 3 stages"),
        (
            ["--tp", "1", "--pp", "2", "--micro-batches", "3", *SMALL],
            "--micro-batches 3 does not divide the per-replica batch 4",
        ),
        (
            ["--tp", "1", "--pp", "2", "--chunks", "2", "--schedule", "interleaved", *SMALL],
            "--pp 2 --chunks 2: 2 layers cannot be split over 4 stages",
        ),
        (
            ["--tp", "1", "--pp", "2", "--chunks", "2", "--layers", "4", *SMALL[2:]],
            "2 chunks per rank need the 'interleaved' schedule",
        ),
        (["--tp", "1", "--dp", "0"], "--dp must be at least 1"),
        (["--tp", "4", "--pp", "4", "--dp", "4"], "tp·pp·dp = 64 is more than 4 ranks per core"),
    ],
)
def test_bad_layouts_are_one_line_errors(args, message, capfd):
    code, _, err = cli(capfd, "train", *args)
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("flags", [["--zero", "3"], ["--zero", "2"], ["--zero1"]])
def test_train_with_zero_stages(reference, tmp_path, capfd, flags):
    """`--zero N` over 2 DP replicas (`--zero1` = `--zero 1`): the one-process run's numbers;
    the summary names the stage."""
    args = ["train", "--dp", "2", *SMALL, *flags, "--json", str(tmp_path / "s.json")]
    code, out, err = cli(capfd, *args)
    assert code == 0, err
    got = read_summary(tmp_path / "s.json")
    same(got, reference)
    assert got["zero"] == (1 if flags == ["--zero1"] else int(flags[1]))


def test_bad_zero_stage_exits_2(capfd):
    code, _, err = cli(capfd, "train", "--dp", "2", *SMALL, "--zero", "4")
    assert code == 2 and "invalid choice: 4" in err
