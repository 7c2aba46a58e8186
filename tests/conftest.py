import os

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
