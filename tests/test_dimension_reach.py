"""How far a parallel dimension reaches: the modules outside its own package that name it.

A new dimension should cost few edits outside its package: the mesh, the parallel config, where
the model wires its module, the CLI and the dry run's predictions. This lists, for expert
parallelism (tpedu/moe/) and context parallelism (tpedu/cp/), every other module with an
identifier that names the dimension (`ep`, `ep_group`, `edp`, `cp_rank`, ...; prose does not
count), and fails when a module joins the list: say where the parameter lives instead (its
placements, tpedu.comm.placement) or, if the module must know the dimension, add it here.
"""

import ast
import re
from pathlib import Path

import pytest

import tpedu

ROOT = Path(tpedu.__file__).resolve().parent
DIMENSIONS = {
    "ep": ("moe", re.compile(r"(^|_)e?d?ep(_|$)|(^|_)edp(_|$)")),
    "cp": ("cp", re.compile(r"(^|_)cp(_|$)")),
}
# The modules that name each dimension today, and why they must know it.
KNOWN = {
    "ep": {
        "parallel/mesh.py": "ep is an axis carved from dp: its groups",
        "parallel/config.py": "the layout's sizes and their checks",
        "model/options.py": "the run options carry the EP group",
        "model/gpt.py": "where the model wires its MoE layer",
        "cli/checks.py": "the CLI's one-line errors before any rank starts",
        "course/bugzoo.py": "the zoo's EP bugs",
        "course/zoo_training.py": "the zoo's EP run",
        "analysis/dryrun/measure.py": "the dry run's fake ranks",
        "analysis/dryrun/moe.py": "the dry run's MoE predictions",
        "analysis/dryrun/predict_memory.py": "the dry run's memory prediction",
        "analysis/dryrun/predict_traffic.py": "the dry run's traffic prediction",
        "analysis/dryrun/table.py": "the dry run's table",
    },
    "cp": {
        "parallel/mesh.py": "cp is an axis: its groups",
        "parallel/config.py": "the layout's sizes and their checks",
        "model/gpt.py": "where the model wires CP attention",
        "cli/checks.py": "the CLI's one-line errors before any rank starts",
        "course/bugzoo.py": "the zoo's CP bugs",
        "course/zoo_training.py": "the zoo's CP run, against TP's",
        "course/hunt_checks.py": "the hunt's CP case",
        "analysis/whatif.py": "the cluster what-if prices CP's ring",
        "analysis/dryrun/measure.py": "the dry run's fake ranks",
        "analysis/dryrun/moe.py": "the dry run's MoE predictions",
        "analysis/dryrun/predict_memory.py": "the dry run's memory prediction",
        "analysis/dryrun/predict_traffic.py": "the dry run's traffic prediction",
        "analysis/dryrun/table.py": "the dry run's table",
    },
}


def identifiers(tree: ast.AST) -> set[str]:
    """Every name a module defines or uses: variables, attributes, arguments, keywords, and
    strings that are a name alone (a mesh axis as a key, `groups["ep"]`; not prose)."""
    docstrings = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and n.body
        and isinstance(n.body[0], ast.Expr)
    }
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings:
            if n.value.isidentifier():
                out.add(n.value)
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, ast.arg):
            out.add(n.arg)
        elif isinstance(n, ast.keyword) and n.arg:
            out.add(n.arg)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
    return out


def reach(dimension: str) -> dict[str, list[str]]:
    """{module outside the dimension's package: the identifiers in it that name the dimension}."""
    home, pattern = DIMENSIONS[dimension]
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] == home:
            continue
        named = sorted(i for i in identifiers(ast.parse(path.read_text())) if pattern.search(i))
        if named:
            out[rel.as_posix()] = named
    return out


@pytest.mark.parametrize("dimension", sorted(DIMENSIONS))
def test_no_module_learns_a_dimension_unannounced(dimension):
    found = reach(dimension)
    new = {m: names for m, names in found.items() if m not in KNOWN[dimension]}
    assert not new, (
        f"{dimension} is now named outside tpedu/{DIMENSIONS[dimension][0]}/ in {new}: read the "
        "parameter's placements instead, or add the module to KNOWN with why it must know it"
    )
    gone = set(KNOWN[dimension]) - set(found)
    assert not gone, f"{sorted(gone)} no longer name {dimension}: take them out of KNOWN"
    print(f"{dimension}: {len(found)} modules outside its package name it")


def test_the_pattern_sees_names_and_not_prose():
    tree = ast.parse(
        "def f(ep_group, cp=2):\n    '''ep and cp in prose'''\n"
        "    return mesh.edp, groups['ep'], 'cp and ep in a message'"
    )
    named = {d: {i for i in identifiers(tree) if DIMENSIONS[d][1].search(i)} for d in DIMENSIONS}
    assert named == {"ep": {"ep_group", "edp", "ep"}, "cp": {"cp"}}
    assert not DIMENSIONS["cp"][1].search("step") and not DIMENSIONS["ep"][1].search("deep")
