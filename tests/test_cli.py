"""`python -m tpedu` started plainly (launches its own ranks) and under torchrun (joins)."""

import subprocess
import sys


def run(*args, timeout=120):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout)


def test_hello_launches_its_own_ranks():
    p = run("-m", "tpedu", "hello", "--nprocs", "3")
    assert p.returncode == 0, p.stderr
    lines = [ln for ln in p.stdout.splitlines() if "all_reduce" in ln]
    assert lines == [
        f"[rank {r}] rank {r} of 3 on gloo: all_reduce(rank) = 3 (expected 3) ✓" for r in range(3)
    ]


def test_hello_joins_under_torchrun():
    p = run(
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "tpedu",
        "hello",
    )
    assert p.returncode == 0, p.stderr
    for r in range(2):
        assert f"rank {r} of 2 on gloo: all_reduce(rank) = 1 (expected 1) ✓" in p.stdout


def test_bad_arguments_are_one_line_errors():
    p = run("-m", "tpedu", "hello", "--nprocs", "0")
    assert p.returncode == 2
    assert p.stderr.strip() == "tpedu: error: --nprocs must be at least 1, got 0"
    assert "Traceback" not in p.stderr


def test_a_world_size_mismatch_under_torchrun_is_one_line_from_rank_0():
    """Both processes of a 2-process torchrun job, environment as torchrun sets it: the check
    runs before either joins, rank 0 prints the one line, and both exit 2."""
    import os

    from tpedu.launcher import free_port

    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "TORCHELASTIC_RUN_ID": "test",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tpedu", "train", "--tp", "4", "--steps", "2"],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for r in range(2)
    ]
    try:
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [2, 2], outs
    assert outs[0] == (
        "",
        "tpedu: error: --tp 4 does not match torchrun's world size 2; pass "
        "--tp 2 or start 4 processes\n",
    )
    assert outs[1] == ("", "")
