"""The package map in tpedu/__init__.py's docstring names every module of the tree, and no module
that is not there: a reader finds each one from the map."""

import re
from pathlib import Path

import tpedu

ROOT = Path(tpedu.__file__).resolve().parent
LINE = re.compile(r"^(?P<indent>(?:    )+)(?P<name>[A-Za-z_][\w]*)(?P<package>/)?(?:\s+|$)")


def mapped() -> set[str]:
    """Module paths ("tp/layers", "parallel/pipeline/runtime") the map lists, by indentation."""
    path: list[str] = []
    found: set[str] = set()
    for line in (tpedu.__doc__ or "").splitlines():
        m = LINE.match(line)
        if not m:
            continue
        depth = len(m["indent"]) // 4 - 1
        path = [*path[:depth], m["name"]]
        if not m["package"]:
            found.add("/".join(path))
    return found


def on_disk() -> set[str]:
    """Module paths of the tree (a package's __init__ is the package itself, listed with a /)."""
    return {
        str(p.relative_to(ROOT).with_suffix(""))
        for p in ROOT.rglob("*.py")
        if p.name != "__init__.py"
    }


def test_the_package_map_lists_every_module_and_only_those():
    listed, there = mapped(), on_disk()
    assert listed, "no map found in tpedu/__init__.py's docstring"
    assert not there - listed, f"modules missing from the map: {sorted(there - listed)}"
    assert not listed - there, f"the map names modules that do not exist: {sorted(listed - there)}"


def test_the_map_reader_sees_nesting():
    assert {"launcher", "tp/layers", "parallel/pipeline/runtime", "__main__"} <= mapped()
