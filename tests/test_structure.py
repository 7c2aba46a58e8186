"""The package's shape: its import graph has no cycles and never imports upward, and every module
says which lesson it belongs to.

The graph is read from the source with `ast` (nothing is imported): every `import` and
`from ... import` in tpedu/**/*.py, at any depth (function-local and `if TYPE_CHECKING:`
imports count), relative names resolved. `from tpedu.x import y` is an import of the module
tpedu.x.y when tpedu/x/y.py (or tpedu/x/y/__init__.py) exists, else of tpedu.x. Importing
tpedu.x.y is not counted as importing the packages above it (Python runs their __init__ first,
but that is not a dependency of the importing module).

Layers, lowest first; a module may import its own layer and those below:

    launcher < comm < tp < cp < model < parallel < data < checkpoint < serve < train < analysis
             < course < grading < cli < __main__

Every sub-package has a layer of its own, so the packages cannot import each other in a circle
either (a test says so separately: a tangle of packages is named as one).

`tpedu/__init__.py` (the package's face) imports only tpedu.launcher and tpedu.comm.device and
counts as the launcher's layer.
A sub-package's __init__.py belongs to that sub-package's layer.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = "tpedu"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

ORDER = (
    "launcher",
    "comm",
    "tp",
    "cp",
    "moe",
    "model",
    "parallel",
    "data",
    "checkpoint",
    "serve",
    "train",
    "analysis",
    "course",
    "grading",
    "cli",
    "__main__",
)
LAYERS = {name: i for i, name in enumerate(ORDER)}
FACE_MAY_IMPORT = {f"{PACKAGE}.launcher", f"{PACKAGE}.comm.device"}

# The first line of every module docstring: the lesson it belongs to, or course infrastructure.
#   "Lesson 03: the conjugate operators ..."
#   "Lessons 01–08: tensor parallelism itself ..."   (a range, with an en dash)
#   "Course infrastructure: run one function on N ranks ..."
DOCSTRING_FIRST_LINE = re.compile(r"^(Lessons? \d\d(–\d\d)?|Course infrastructure): \S")


@dataclass(frozen=True)
class Edge:
    source: str  # importing module
    target: str  # imported module
    file: str  # relative to the directory above the package
    line: int

    def where(self) -> str:
        return f"{self.file}:{self.line}"


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def _resolve_from(node: ast.ImportFrom, name: str, is_package: bool) -> str:
    """The absolute module name `from <level dots><node.module> import ...` refers to."""
    if node.level == 0:
        return node.module or ""
    base = name.split(".") if is_package else name.split(".")[:-1]
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(root: Path = ROOT) -> list[Edge]:
    """Every import of one tpedu module by another (see the module docstring)."""
    known = modules(root)
    edges = []
    for name, path in known.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve_from(node, name, is_package)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in known else base)
            for target in targets:
                if target == root.name or target.startswith(root.name + "."):
                    rel = path.relative_to(root.parent).as_posix()
                    edges.append(Edge(name, target, rel, node.lineno))
    return edges


def layer(name: str) -> int:
    parts = name.split(".")
    if len(parts) == 1:  # the package's face
        return LAYERS["launcher"]
    return LAYERS[parts[1]]


def find_cycles(edges: list[Edge]) -> list[tuple[list[Edge], list[str]]]:
    """(a shortest cycle, as the edges along it; every module of its tangle) for each strongly
    connected component of the graph with a cycle. A tangle may hold more cycles than the one
    shown: break it and run again."""
    graph: dict[str, list[Edge]] = {}
    for e in edges:
        graph.setdefault(e.source, []).append(e)
        graph.setdefault(e.target, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def strongconnect(v: str) -> None:  # Tarjan; the graph is small, recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for e in graph[v]:
            w = e.target
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            components.append(comp)

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)

    cycles = []
    for comp in components:
        members = set(comp)
        start = min(comp)
        if len(comp) == 1 and not any(e.target == start for e in graph[start]):
            continue
        # shortest path start -> ... -> start inside the component (breadth first)
        prev: dict[str, Edge] = {}
        frontier, found = [start], None
        while frontier and found is None:
            nxt = []
            for v in frontier:
                for e in sorted(graph[v], key=lambda e: e.target):
                    if e.target not in members:
                        continue
                    if e.target == start:
                        found = e
                        break
                    if e.target not in prev:
                        prev[e.target] = e
                        nxt.append(e.target)
                if found:
                    break
            frontier = nxt
        path = [found]
        while path[0].source != start:
            path.insert(0, prev[path[0].source])
        cycles.append((path, sorted(members)))
    return cycles


def describe_cycle(cycle: list[Edge], members: list[str]) -> str:
    chain = " -> ".join([cycle[0].source] + [e.target for e in cycle])
    if len(cycle) == 1:
        chain += " (imports itself)"
    others = [m for m in members if m not in {e.source for e in cycle}]
    if others:
        chain += f" (the same tangle also holds {', '.join(others)})"
    return (
        chain + "\n" + "\n".join(f"      {e.where()}: {e.source} imports {e.target}" for e in cycle)
    )


def upward_imports(edges: list[Edge]) -> list[str]:
    bad = []
    for e in edges:
        if e.source == PACKAGE:
            if e.target not in FACE_MAY_IMPORT:
                bad.append(
                    f"{e.where()}: {PACKAGE}/__init__.py imports {e.target}; the "
                    f"package's face may import only {sorted(FACE_MAY_IMPORT)}"
                )
        elif e.target != PACKAGE and e.target.split(".")[1] not in LAYERS:
            continue  # no such module: test_every_import_names_a_module reports it
        elif layer(e.source) < layer(e.target):
            src, dst = e.source.split(".")[1], e.target.split(".")[1]
            bad.append(
                f"{e.where()}: {e.source} ({src}) imports {e.target} ({dst}), a higher layer"
            )
    return bad


def test_every_module_has_a_layer():
    unknown = sorted({n.split(".")[1] for n in modules() if "." in n} - set(LAYERS))
    assert not unknown, f"top-level parts of {PACKAGE}/ with no layer: {unknown}; add to LAYERS"


def test_every_import_names_a_module():
    known = modules()
    bad = [
        f"  {e.where()}: {e.source} imports {e.target}, which is not a module of {PACKAGE}"
        for e in imports()
        if e.target not in known
    ]
    if bad:
        pytest.fail("imports of modules that do not exist:\n" + "\n".join(bad), pytrace=False)


def test_the_graph_is_read():
    """Sanity: the reader sees plain, relative, `from pkg import module` and local imports."""
    edges = {(e.source, e.target) for e in imports()}
    assert (f"{PACKAGE}", f"{PACKAGE}.launcher") in edges
    assert (f"{PACKAGE}.tp.sharding", f"{PACKAGE}.comm.collectives") in edges  # from pkg import mod
    assert any(s == f"{PACKAGE}.cli.commands" for s, _ in edges)


def test_no_import_cycles():
    cycles = find_cycles(imports())
    if cycles:
        text = "\n".join(f"  {describe_cycle(*c)}" for c in cycles)
        pytest.fail(f"{len(cycles)} import cycle(s):\n{text}", pytrace=False)


def package_edges(edges: list[Edge]) -> list[Edge]:
    """The import graph between sub-packages: one edge per module import that crosses two."""
    out = []
    for e in edges:
        src, dst = e.source.split(".")[:2], e.target.split(".")[:2]
        if src != dst and len(src) == len(dst) == 2:
            out.append(Edge(".".join(src), ".".join(dst), e.file, e.line))
    return out


def test_no_package_cycles():
    """Modules can be free of cycles while their packages are not (a.x -> b.y -> a.z)."""
    cycles = find_cycles(package_edges(imports()))
    if cycles:
        text = "\n".join(f"  {describe_cycle(*c)}" for c in cycles)
        pytest.fail(f"{len(cycles)} package cycle(s):\n{text}", pytrace=False)


def test_a_package_cycle_is_found():
    edges = [
        Edge("tpedu.a.x", "tpedu.b.y", "a/x.py", 1),
        Edge("tpedu.b.z", "tpedu.a.w", "b/z.py", 2),
    ]
    assert find_cycles(edges) == []  # no module cycle ...
    ((cycle, members),) = find_cycles(package_edges(edges))  # ... but a package one
    assert members == ["tpedu.a", "tpedu.b"]


def test_no_upward_imports():
    bad = upward_imports(imports())
    if bad:
        text = "\n".join(f"  {b}" for b in bad)
        pytest.fail(
            f"imports against the layer order ({' < '.join(ORDER)}):\n{text}", pytrace=False
        )


def private_uses(root: Path = ROOT) -> list[str]:
    """Every use of another module's private name (`_x`, not dunders): imported by name, or
    read off a tpedu module bound by an import (`collectives._names`)."""
    known = modules(root)
    bad = []
    for path in known.values():
        where = path.relative_to(root.parent).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        module_aliases = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        bad.append(f"{where}:{node.lineno}: imports {node.module}.{alias.name}")
                    if f"{node.module}.{alias.name}" in known:
                        module_aliases.add(alias.asname or alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith(PACKAGE) and alias.asname:
                        module_aliases.add(alias.asname)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in module_aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                bad.append(f"{where}:{node.lineno}: uses {node.value.id}.{node.attr}")
    return bad


def test_no_private_name_is_used_across_modules():
    """A name another module needs is part of its owner's interface: public, documented."""
    bad = private_uses()
    assert not bad, "private names used outside their module:\n" + "\n".join(bad)


def small_tree(root: Path, files: dict[str, str]) -> Path:
    """A made-up package under root: {path inside it: source}; returns its directory."""
    pkg = root / PACKAGE
    for rel, text in files.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    return pkg


def test_private_uses_on_a_small_tree(tmp_path):
    pkg = small_tree(
        tmp_path,
        {
            "comm/__init__.py": "",
            "comm/collectives.py": "_g = _h = 0\n",
            "tp/__init__.py": "",
            "tp/priv.py": "from tpedu.comm.collectives import _g\n"
            "from tpedu.comm import collectives\ncollectives._h\ncollectives.__name__\n",
        },
    )
    assert private_uses(pkg) == [
        "tpedu/tp/priv.py:1: imports tpedu.comm.collectives._g",
        "tpedu/tp/priv.py:3: uses collectives._h",
    ]


def test_reader_on_a_small_tree(tmp_path):
    """The reader and the checks on a made-up package: the failures read as they should."""
    pkg = small_tree(
        tmp_path,
        {
            "__init__.py": "from tpedu.launcher import launch\n",
            "launcher.py": "def launch(): ...\n",
            "comm/__init__.py": "from . import collectives\n",
            "comm/collectives.py": "def f():\n    from tpedu.tp import layers\n",
            "tp/__init__.py": "",
            "tp/layers.py": "from ..comm.collectives import f\nfrom tpedu import tp\n",
        },
    )
    edges = imports(pkg)
    pairs = {(e.source, e.target) for e in edges}
    assert pairs == {
        ("tpedu", "tpedu.launcher"),
        ("tpedu.comm", "tpedu.comm.collectives"),
        ("tpedu.comm.collectives", "tpedu.tp.layers"),
        ("tpedu.tp.layers", "tpedu.comm.collectives"),
        ("tpedu.tp.layers", "tpedu.tp"),
    }
    cycles = find_cycles(edges)
    assert [describe_cycle(*c).splitlines()[0] for c in cycles] == [
        "tpedu.comm.collectives -> tpedu.tp.layers -> tpedu.comm.collectives"
    ]
    assert upward_imports(edges) == [
        "tpedu/comm/collectives.py:2: tpedu.comm.collectives (comm) imports tpedu.tp.layers (tp), "
        "a higher layer"
    ]


LONG = 80  # lines: a function longer than this says why in its docstring ("Long because ...")


def test_a_long_function_says_why():
    bad = []
    for path in modules().values():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > LONG and "Long because" not in (ast.get_docstring(node) or ""):
                    bad.append(
                        f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name}: {lines}"
                    )
    assert not bad, f"functions over {LONG} lines without a reason:\n" + "\n".join(bad)


MANY = 8  # parameters (self and cls not counted): past this, say why ("Many parameters because")


def parameter_count(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = node.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
    return len(names) + (a.vararg is not None) + (a.kwarg is not None)


def test_a_function_with_many_parameters_says_why():
    """Options that belong together travel as one object (RunOptions, TrainStep); a function
    that still takes many says why in its docstring (an __init__: in its class's)."""
    bad = []
    for path in modules().values():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for owner in ast.walk(tree):
            body = getattr(owner, "body", [])
            for node in body if isinstance(body, list) else []:
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                docs = ast.get_docstring(node) or ""
                if node.name == "__init__" and isinstance(owner, ast.ClassDef):
                    docs += ast.get_docstring(owner) or ""
                if parameter_count(node) > MANY and "Many parameters because" not in docs:
                    bad.append(
                        f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name}: "
                        f"{parameter_count(node)}"
                    )
    assert not bad, f"functions with over {MANY} parameters without a reason:\n" + "\n".join(bad)


def test_no_module_is_over_600_lines():
    """A module is one concept, read in one sitting; past 600 lines it is several."""
    sizes = {p: len(p.read_text(encoding="utf-8").splitlines()) for p in modules().values()}
    bad = [f"{p.relative_to(ROOT.parent)}: {n}" for p, n in sizes.items() if n > 600]
    assert not bad, "modules over 600 lines:\n" + "\n".join(bad)


def test_every_module_docstring_names_its_lesson():
    bad = []
    for path in modules().values():
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=False)
        first = (doc or "").lstrip("\n").splitlines()[0] if doc and doc.strip() else "<none>"
        if not DOCSTRING_FIRST_LINE.match(first):
            bad.append(f"  {path.relative_to(ROOT.parent)}: {first[:70]!r}")
    if bad:
        pytest.fail(
            f"{len(bad)} module docstring(s) whose first line does not match "
            f"{DOCSTRING_FIRST_LINE.pattern!r}:\n" + "\n".join(bad),
            pytrace=False,
        )


def test_a_tangle_names_all_its_modules(tmp_path):
    pkg = tmp_path / PACKAGE
    (pkg / "tp").mkdir(parents=True)
    for rel, text in {
        "__init__.py": "",
        "tp/__init__.py": "",
        "tp/a.py": "from tpedu.tp import b\n",
        "tp/b.py": "from . import a, c\n",
        "tp/c.py": "import tpedu.tp.a\n",
    }.items():
        (pkg / rel).write_text(text)
    (cycle, members), *more = find_cycles(imports(pkg))
    assert not more and members == ["tpedu.tp.a", "tpedu.tp.b", "tpedu.tp.c"]
    assert describe_cycle(cycle, members).splitlines() == [
        "tpedu.tp.a -> tpedu.tp.b -> tpedu.tp.a (the same tangle also holds tpedu.tp.c)",
        "      tpedu/tp/a.py:1: tpedu.tp.a imports tpedu.tp.b",
        "      tpedu/tp/b.py:1: tpedu.tp.b imports tpedu.tp.a",
    ]
