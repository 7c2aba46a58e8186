import os

import pytest

# Exercise tests read TPEDU_IMPL through tpedu.grading.implementation; default to the reference.
os.environ.setdefault("TPEDU_IMPL", "solutions")


@pytest.fixture(autouse=True)
def _one_thread():
    """The test process itself uses one thread, like the ranks it forks (no oversubscription)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
