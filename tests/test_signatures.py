"""Short signatures: no function in tpedu/ takes more than MAX_PARAMS parameters (self and cls
not counted, positional and keyword-only both), except the few named in ALLOWED with the reason.
Settings that belong together travel as one object instead (Sampling, ModelShape, a batch).
(test_structure's rule is the softer one beside it: past 8, counting *args and **kwargs too, a
docstring says "Many parameters because".)"""

import ast
from pathlib import Path

import tpedu

ROOT = Path(tpedu.__file__).resolve().parent
MAX_PARAMS = 8

# "module path:qualified name" -> why it may keep a long signature
ALLOWED = {
    "parallel/zero.py:ShardedDataParallel.__init__": "AdamW's own settings beside ZeRO's",
    "moe/dense.py:DenseMoE.__init__": "hyperparameters, as torch.nn modules take them",
    "tp/dense.py:DenseAttention.__init__": "hyperparameters, as torch.nn modules take them",
}


def n_params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Positional and keyword-only parameters, self and cls left out (*args, **kwargs too)."""
    a = fn.args
    return sum(p.arg not in ("self", "cls") for p in (*a.posonlyargs, *a.args, *a.kwonlyargs))


def long_signatures() -> dict[str, int]:
    """{"path:qualified name": parameters} of every function in tpedu/ with more than MAX."""
    found = {}

    def visit(node: ast.AST, prefix: str, path: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef) and n_params(child) > MAX_PARAMS:
                    found[f"{path}:{name}"] = n_params(child)
                visit(child, f"{name}.", path)
            else:
                visit(child, prefix, path)

    for file in sorted(ROOT.rglob("*.py")):
        visit(ast.parse(file.read_text(encoding="utf-8")), "", file.relative_to(ROOT).as_posix())
    return found


def test_no_new_long_signatures():
    long = long_signatures()
    new = {k: v for k, v in long.items() if k not in ALLOWED}
    assert not new, (
        f"more than {MAX_PARAMS} parameters: {new}; pass settings that belong together as one "
        "object (a frozen dataclass), or add the function to ALLOWED with the reason"
    )


def test_the_allowed_list_names_only_long_signatures():
    gone = sorted(set(ALLOWED) - set(long_signatures()))
    assert not gone, f"no longer more than {MAX_PARAMS} parameters: remove {gone} from ALLOWED"


def test_the_count():
    """self is not counted; positional-only, positional and keyword-only are; *a, **k are not."""
    fn = ast.parse("def f(self, a, /, b, *c, d, **e): pass").body[0]
    assert n_params(fn) == 3
