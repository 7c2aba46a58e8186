import os
import subprocess

import pytest

# Exercise tests read TPEDU_IMPL through tpedu.course.grading.implementation; default to the reference.
os.environ.setdefault("TPEDU_IMPL", "solutions")
# The suite runs its ranks on gloo on every machine, GPU nodes included: its tests build CPU
# tensors and some check gloo's own behaviour, and the notebooks' stored outputs come from CPU
# ranks (nbval's kernels inherit this). TPEDU_BACKEND=nccl in the environment overrides it.
os.environ.setdefault("TPEDU_BACKEND", "gloo")


@pytest.fixture(autouse=True)
def _one_thread():
    """The test process itself uses one thread, like the ranks it forks (no oversubscription)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def no_leftover_processes():
    """After the test: no child process is left, zombies included. A leftover is killed and
    reaped before the test fails with its command line, so it cannot fail the next test."""
    from tests.processes import kill_leftovers

    yield
    left = kill_leftovers()
    assert not left, "the test left processes behind (now killed):\n" + "\n".join(left)


def pytest_report_header(config):
    """The CPU kernels this run uses: stored notebook outputs must not depend on them."""
    from tests.kernels import report

    try:
        found = report()
    except (OSError, subprocess.SubprocessError) as e:  # a header must not stop the run
        return f"CPU kernels: unknown (the probe failed: {e})"
    return "CPU kernels: " + ", ".join(f"{k} {v}" for k, v in found.items() if v)


@pytest.fixture
def no_launch(monkeypatch):
    """Starting ranks raises Launched: a refused run never gets there, an accepted one does."""
    from tests.helpers import Launched
    from tpedu.cli import commands

    def launch_refused(*args, **kwargs):
        raise Launched

    monkeypatch.setattr(commands, "run", launch_refused)
