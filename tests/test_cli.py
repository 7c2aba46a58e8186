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
    p = run("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            "-m", "tpedu", "hello")  # fmt: skip
    assert p.returncode == 0, p.stderr
    for r in range(2):
        assert f"rank {r} of 2 on gloo: all_reduce(rank) = 1 (expected 1) ✓" in p.stdout


def test_bad_arguments_are_one_line_errors():
    p = run("-m", "tpedu", "hello", "--nprocs", "0")
    assert p.returncode == 2
    assert p.stderr.strip() == "tpedu: error: --nprocs must be at least 1, got 0"
    assert "Traceback" not in p.stderr
