"""Every committed notebook is executed with its outputs stored (else nbval compares nothing),
and the README's lesson map lists every notebook."""

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def test_there_are_lessons():
    assert len(NOTEBOOKS) >= 3


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_committed_executed(path):
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    code = [c for c in cells if c["cell_type"] == "code" and "".join(c["source"]).strip()]
    assert code, "a lesson without code"
    unexecuted = [i for i, c in enumerate(code) if c.get("execution_count") is None]
    assert not unexecuted, f"code cells {unexecuted} have no stored execution: run `make notebooks`"
    counts = [c["execution_count"] for c in code]
    assert counts == list(range(1, len(code) + 1)), "cells were not run top to bottom in one go"
    assert sum(len(c.get("outputs", [])) for c in code) > 0
    errors = [o for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, "a stored output is an error"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_readme_lesson_map_lists_notebook(path):
    assert f"notebooks/{path.name}" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_notebook_kernels_listen_on_unix_sockets_not_tcp_ports():
    """The kernel nbval starts for a notebook binds no TCP port that a rank's connection could
    take first (the root conftest.py says why), and still runs code."""
    from nbval.kernel import CURRENT_ENV_KERNEL_NAME, RunningKernel

    kernel = RunningKernel(CURRENT_ENV_KERNEL_NAME, str(ROOT / "notebooks"))
    try:
        info = kernel.km.get_connection_info()
        assert info["transport"] == "ipc", info["transport"]
        assert len(f"{info['ip']}-{info['hb_port']}") < 100, "a Unix socket path this long fails"
        reply = kernel.kc.execute("x = 6 * 7", user_expressions={"x": "x"}, reply=True, timeout=60)
        assert reply["content"]["user_expressions"]["x"]["data"]["text/plain"] == "42"
        assert all(Path(f"{info['ip']}-{info[p]}").exists() for p in ("shell_port", "iopub_port"))
    finally:
        kernel.stop()
