"""The suite's own helpers: leftovers are killed, reaped and named; the kernel probe knows when the
lower kernels did not take effect; the load runner stops its busy processes."""

import ast
import subprocess
import sys
from pathlib import Path

from tests import kernels, load
from tests.processes import children, kill_leftovers


def test_a_leftover_is_killed_reaped_and_named():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)  # leftover"])
    lines = kill_leftovers()
    assert len(lines) == 1 and f"pid {p.pid}" in lines[0] and "# leftover" in lines[0], lines
    assert children() == [] and not Path(f"/proc/{p.pid}").exists()
    p.returncode = -9  # reaped by kill_leftovers: Popen must not wait for it again


def test_the_kernel_probe_reads_what_the_libraries_report():
    found = kernels.report()
    assert found["torch"] in {"DEFAULT", "VSX", "ZVECTOR", "SVE256", "AVX2", "AVX512"}


def test_the_lower_kernels_are_refused_when_one_library_ignored_them():
    low = {"torch": "DEFAULT", "mkl": "Intel(R) Architecture", "onednn": "Intel SSE4.1"}
    assert kernels.low_problems(low) == []
    assert kernels.low_problems({**low, "torch": "AVX2"}) == [
        "torch runs AVX2 kernels, not DEFAULT"
    ]
    avx = "Intel(R) Advanced Vector Extensions 2 (Intel(R) AVX2) enabled"
    assert kernels.low_problems({**low, "mkl": avx}) == [f"MKL runs its code for {avx}"]
    assert kernels.low_problems({**low, "onednn": "Intel AVX-512"}) == ["oneDNN runs Intel AVX-512"]
    assert kernels.low_problems({**low, "mkl": None, "onednn": None}) == []  # an ARM build


def test_the_load_runner_returns_the_command_code_and_stops_its_hogs(capsys):
    assert load.main(["--hogs", "2", "--", sys.executable, "-c", "raise SystemExit(3)"]) == 3
    assert children() == []
    assert "2 CPU-bound processes beside" in capsys.readouterr().out


def test_no_test_file_imports_another():
    """What test files share lives in tests/helpers.py (or conftest.py, for fixtures): a test
    file imported by another runs its module-level set-up twice and ties the two together."""
    tests = Path(__file__).parent
    found = []
    for path in sorted(tests.rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                if any(part.startswith("test_") for part in node.module.split(".")):
                    found.append(f"{path.relative_to(tests)}:{node.lineno} imports {node.module}")
    assert not found, "\n".join(found)
