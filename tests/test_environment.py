"""environment.yml (conda users) lists exactly the packages pyproject.toml installs."""

import re
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
