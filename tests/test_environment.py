"""environment.yml (conda users) lists exactly the packages pyproject.toml installs."""

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = set(project["dependencies"]) | set(project["optional-dependencies"]["dev"])
    text = (ROOT / "environment.yml").read_text()
    pip_section = text.split("- pip:", 1)[1]
    listed = {m.group(1).strip() for m in re.finditer(r"^\s+- (\S+)\s*$", pip_section, re.M)}
    assert listed == wanted
    assert re.search(r"^\s+- python=3\.11$", text, re.M)


def test_torch_is_pinned():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "torch==2.13.0" in project["dependencies"]


def make_setup(tmp_path: Path, python: str) -> subprocess.CompletedProcess:
    """`make PYTHON=... setup` in an empty copy of the project's Makefile (nothing installed)."""
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    return subprocess.run(
        ["make", f"PYTHON={python}", "setup"], cwd=tmp_path, capture_output=True, text=True
    )


def test_a_python_that_does_not_run_is_named_as_such(tmp_path):
    """A pyenv shim for a version that is not activated exits 127: that is not 'out of range'."""
    shim = tmp_path / "python3.13"
    shim.write_text("#!/bin/sh\necho 'pyenv: python3.13: command not found' >&2\nexit 127\n")
    shim.chmod(0o755)
    done = make_setup(tmp_path, str(shim))
    assert done.returncode == 2
    assert f"PYTHON={shim} does not run" in done.stderr and "full path" in done.stderr
    assert not (tmp_path / ".venv").exists()


def test_a_python_out_of_range_says_its_version(tmp_path):
    old = tmp_path / "python3.10"
    old.write_text(
        '#!/bin/sh\n[ "$1" = --version ] && echo "Python 3.10.13" && exit 0\n'
        '[ "$2" = pass ] && exit 0\nexit 1\n'
    )
    old.chmod(0o755)
    done = make_setup(tmp_path, str(old))
    assert done.returncode == 2
    assert "needs Python 3.11-3.14 and found" in done.stderr and "Python 3.10.13" in done.stderr
