"""The GPU check script's code path, on CPU ranks (`--device cpu`): every check runs and passes,
a failing check is a FAIL row and exit code 1, and without CUDA `--device cuda` says so."""

import pytest
import torch

from tpedu.course import gpu_check


def test_every_check_passes_on_cpu_ranks(capsys):
    assert gpu_check.main(["--device", "cpu", "--quick"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines()[2:] if line.strip()]
    assert len(rows) == 10 and all(" ok " in r for r in rows), out


def test_a_failing_check_is_a_fail_row_and_exit_code_1(monkeypatch, capsys):
    def wrong():
        raise AssertionError("worst gradient blocks.0.mlp.fc1.weight differs by 1.0e-01")

    monkeypatch.setattr(gpu_check, "_tp_equals_dense", wrong)
    assert gpu_check.main(["--device", "cpu", "--quick"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "differs by 1.0e-01" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_cuda_it_says_so(capsys):
    assert gpu_check.main([]) == 2
    assert "no CUDA device here" in capsys.readouterr().out
