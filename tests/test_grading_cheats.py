"""Ways of passing without the work, each refused by the grader or the lesson with a clear message.

Every test writes a course of its own in tmp_path (copies of exercises/ and solutions/ with one
file changed) and points the grader at it; the real exercises/ is never touched.

- a helper written while its caller is not: pick runs the learner's helper through the
  reference's caller, so a helper that raises raises (it is not credited without running);
- lesson 04's proof with a column layer that lacks f (no all-reduce of dL/dx in backward): the
  proof fails and names that cause, instead of printing ✓ from tpedu's own layers;
- a file that imports solutions/ (a star import, a wrapper, an assignment): the reference, not
  "yours", in pick's line, in whose() and in the grade;
- lesson 00's ledger with a wrong function: its claim fails, with no ✓ from the reference's;
- lesson 02's ring written without its two phases: the line names only what ran (watch), not
  the reference's phases, which never did;
- lessons 12 and 15 with one wrong piece (buckets from the first parameter, a sum for a mean,
  memory kept after free, a ZeRO stage sharding the wrong part, a ring of N - 1 steps, α and β
  swapped): the claim on it fails and names the cause, with no ✓ from the reference's;
- an exercise solved by tpedu's own twin of it, aliased or wrapped (lesson 02's ring with
  tpedu.comm.ring's, lesson 04's layers with tpedu.tp.layers', lesson 19's with
  tpedu.tp.collective_matmul's ring, ...): the exercise's checks refuse it, naming the tpedu
  function that ran (tests.exercises.refusing).
"""

import importlib
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import tpedu
from tests.exercises import refused
from tpedu.comm.cost_model import AlphaBeta
from tpedu.course import grading, proofs

ROOT = grading.ROOT


@pytest.fixture
def course(tmp_path, monkeypatch):
    """A copy of the course's exercises/ and solutions/ in tmp_path, which the grader uses;
    returns a function that rewrites one exercise file there."""
    for kind in ("exercises", "solutions"):
        shutil.copytree(ROOT / kind, tmp_path / kind, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(grading, "ROOT", tmp_path)
    monkeypatch.setattr(grading, "HINTS", tmp_path / "exercises" / "hints")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in list(sys.modules):
        if name.split(".")[0] in ("exercises", "solutions") or name.startswith("picked_"):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.delenv("TPEDU_IMPL", raising=False)

    def write(name, text):
        (tmp_path / "exercises" / f"{name}.py").write_text(textwrap.dedent(text))
        return tmp_path / "exercises" / f"{name}.py"

    yield write
    for name, module in list(sys.modules.items()):  # monkeypatch then restores the real ones
        if str(getattr(module, "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]
    sys.modules.pop("picked_l04_parallel_linear", None)


def _stub(name):
    return (ROOT / "exercises" / f"{name}.py").read_text(encoding="utf-8")


# ---- a helper written, its caller not


def test_a_written_helper_runs_through_the_references_caller(course, capsys):
    """l18: send_counts written (it raises), dispatch not: dispatch is the reference's, and it
    must call the learner's send_counts, so the learner's error comes out."""
    text = _stub("l18_expert_dispatch")
    head, _, rest = text.partition("def send_counts(")
    body_end = rest.index("\ndef dispatch(")
    mine = (
        "def send_counts(kept_per_expert, ep):\n"
        "    raise RuntimeError('the learner send_counts ran')\n\n"
    )
    course("l18_expert_dispatch", head + mine + rest[body_end:])
    m = grading.pick("l18")
    line = capsys.readouterr().out
    assert "yours: send_counts" in line and "reference: " in line and "dispatch" in line
    assert grading.whose(m, "send_counts") == "yours"
    assert grading.whose(m, "dispatch") == "reference"

    def run():
        kept = torch.tensor([2, 1])
        return m.dispatch(torch.zeros(3, 4), kept)

    with pytest.raises(tpedu.RankError, match="the learner send_counts ran"):
        tpedu.launch(run, 1)


def test_a_written_split_runs_through_the_references_matmul(course, capsys):
    """l01: split_columns written (wrong on purpose), column_parallel_matmul not: the reference's
    matmul uses the learner's split, so its result is wrong, and says so."""
    text = _stub("l01_matmul_split")
    head, _, rest = text.partition("def split_columns(")
    body_end = rest.index("\ndef split_rows(")
    mine = "def split_columns(w, parts):\n    return [w * 0 for _ in range(parts)]\n\n"
    course("l01_matmul_split", head + mine + rest[body_end:])
    m = grading.pick("l01")
    assert "yours: split_columns" in capsys.readouterr().out
    x, w = torch.ones(2, 3), torch.ones(3, 4)
    assert m.column_parallel_matmul(x, w, 2).abs().max() == 0  # the learner's zeros ran
    assert (
        grading.implementation("l01_matmul_split", "solutions")
        .column_parallel_matmul(x, w, 2)
        .equal(x @ w)
    )  # the reference module itself is untouched


# ---- lesson 04's proof runs the learner's layers

_NO_F = """
import torch.nn.functional as F
from tpedu.tp.operators import gather_from_tp_region


def column_parallel_linear(x, weight, bias, group=None, gather_output=False):
    y = F.linear(x, weight, bias)  # no f in front: dL/dx is never summed over the ranks
    return gather_from_tp_region(y, group) if gather_output else y


def row_parallel_linear(x, weight, bias, group=None):
    raise NotImplementedError("l04: write the row-parallel layer")
"""


def test_lesson_04_proof_refuses_a_column_layer_without_f(course, capsys):
    course("l04_parallel_linear", _NO_F)
    m = grading.pick("l04")
    line = capsys.readouterr().out
    assert "yours: column_parallel_linear" in line and "reference: row_parallel_linear" in line
    result = tpedu.launch(proofs.mlp_vs_dense, 2, m, "gelu", 6, 16, 2, 3)[0]
    assert result["calls"] == {"forward": 1, "backward": 0}  # the tracer saw f missing
    with pytest.raises(AssertionError, match="dL/dx.*claim fails.*\n.*f missing"):
        proofs.show_mlp(m, result)
    shown = capsys.readouterr().out
    assert "your column_parallel_linear" in shown and "dL/dx" not in shown  # no ✓ for it


def test_lesson_04_proof_passes_the_reference_and_names_it(monkeypatch, capsys):
    monkeypatch.setenv("TPEDU_IMPL", "solutions")
    m = grading.pick("l04")
    for activation in ("gelu", "swiglu"):
        proofs.show_mlp(m, tpedu.launch(proofs.mlp_vs_dense, 2, m, activation, 6, 16, 2, 3)[0])
    out = capsys.readouterr().out
    assert "the reference's column_parallel_linear, row_parallel_linear:" in out
    assert "your" not in out and out.count("✓") == 16


# ---- solutions/ imported


def _star(name):
    return _stub(name) + f"\nfrom solutions.{name} import *  # noqa\n"


def _wrapper(name):
    return _stub(name) + textwrap.dedent(
        """
        from tpedu.course.grading import implementation


        def column_parallel_linear(*args, **kwargs):
            return implementation("l04_parallel_linear", "solutions").column_parallel_linear(
                *args, **kwargs
            )
        """
    )


def _assigned(name):
    return _stub(name) + textwrap.dedent(
        """
        import importlib

        _ref = importlib.import_module("solu" + "tions.l04_parallel_linear")
        column_parallel_linear = _ref.column_parallel_linear
        row_parallel_linear = _ref.row_parallel_linear
        """
    )


@pytest.mark.parametrize("cheat", [_star, _wrapper, _assigned])
def test_a_file_that_uses_solutions_counts_as_the_reference(course, capsys, monkeypatch, cheat):
    course("l04_parallel_linear", cheat("l04_parallel_linear"))
    m = grading.pick("l04")
    line = capsys.readouterr().out
    assert "yours: none yet" in line, line
    assert "reference: column_parallel_linear, row_parallel_linear" in line
    if cheat is not _assigned:  # named in the line: where the file uses solutions/
        assert "uses solutions/ (line " in line
    else:
        assert "not written in your file" in line
    assert {grading.whose(m, f) for f in ("column_parallel_linear", "row_parallel_linear")} == {
        "reference"
    }
    monkeypatch.setenv("TPEDU_IMPL", "exercises")  # the learner's module as the grader tests it
    e = grading.pick("l04")
    assert grading.whose(e, "column_parallel_linear") == "reference"


def test_a_written_file_is_yours(course, capsys):
    """The other side of the cheats above: the reference's code copied into the exercise file
    (as a learner would write it) counts as the learner's."""
    text = (ROOT / "solutions" / "l04_parallel_linear.py").read_text(encoding="utf-8")
    course("l04_parallel_linear", text)
    m = grading.pick("l04")
    assert capsys.readouterr().out.startswith("l04_parallel_linear: your code runs for every")
    assert grading.whose(m, "row_parallel_linear") == "yours"


_FAKE_TEST = """
from tpedu.course.grading import implementation


def test_the_layers_exist():
    m = implementation("l04_parallel_linear")
    assert callable(m.column_parallel_linear) and callable(m.row_parallel_linear)


def test_they_run():
    import torch
    import tpedu

    m = implementation("l04_parallel_linear")
    w = torch.ones(2, 3, dtype=torch.float64)
    x = torch.ones(1, 3, dtype=torch.float64)
    tpedu.launch(lambda: m.column_parallel_linear(x, w, None), 1)
"""

_DRIVER = """
import os
import sys
from pathlib import Path

from tpedu.course import grading

# One interpreter (torch imported once) grades each course root given after "--", in a child
# forked from here before any course's files were imported: each child imports its own.
cut = sys.argv.index("--")
for root in sys.argv[cut + 1 :]:
    pid = os.fork()
    if pid == 0:
        os.chdir(root)
        grading.ROOT = Path.cwd()
        print(f"==> {root}", flush=True)
        code = grading.main(sys.argv[1:cut])
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if code:
        sys.exit(code)
"""


def _grade_in(roots, *args):
    """The grader's command line (`grading.main(args)`) on each course root in turn, in one
    started interpreter: (the process, {root: what its grade printed})."""
    for tmp in roots:
        (tmp / "tests" / "exercises").mkdir(parents=True, exist_ok=True)
        (tmp / "tests" / "__init__.py").write_text("")
        (tmp / "tests" / "exercises" / "__init__.py").write_text("")
        (tmp / "tests" / "exercises" / "test_l04_parallel_linear.py").write_text(_FAKE_TEST)
    here = str(Path(tpedu.__file__).parents[1])  # the tpedu under test, whatever is installed
    p = subprocess.run(
        [sys.executable, "-c", _DRIVER, *args, "--", *map(str, roots)],
        cwd=roots[0],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": here},
    )
    printed = dict(part.split("\n", 1) for part in p.stdout.split("==> ")[1:])
    return p, {root: printed.get(str(root), "") for root in roots}


def test_grade_gives_no_marks_for_solutions_imported(course, tmp_path):
    course("l04_parallel_linear", _star("l04_parallel_linear"))
    # beside it, a course with the same file written out by hand: both tests pass, and the
    # grade says done
    by_hand = tmp_path / "by_hand"
    for kind in ("exercises", "solutions"):
        shutil.copytree(tmp_path / kind, by_hand / kind)
    text = (ROOT / "solutions" / "l04_parallel_linear.py").read_text(encoding="utf-8")
    (by_hand / "exercises" / "l04_parallel_linear.py").write_text(textwrap.dedent(text))
    p, printed = _grade_in([tmp_path, by_hand], "l04")
    assert p.returncode == 0, p.stderr
    out = printed[tmp_path]
    assert "uses solutions/" in out and "the reference, not yours" in out, p.stdout
    assert "from solutions.l04_parallel_linear import *" in out
    row = next(r for r in out.splitlines() if r.startswith("l04_parallel_linear "))
    assert row.split()[1:3] == ["0", "2"], row  # 0 of 2 passed: what passed was the reference
    out = printed[by_hand]
    row = next(r for r in out.splitlines() if r.startswith("l04_parallel_linear "))
    assert row.split()[1:] == ["2", "2", "done"], p.stdout + p.stderr


# ---- a lesson's check runs on the picked functions and names only what ran


def _written(name, **bodies):
    """The stub of exercise `name` with the functions named in `bodies` written out (their
    whole text, `def` line included); the rest still raise NotImplementedError."""
    import ast

    text = _stub(name)
    lines = text.splitlines(keepends=True)
    spans = {
        n.name: (n.lineno - 1, n.end_lineno)
        for n in ast.parse(text).body
        if isinstance(n, ast.FunctionDef) and n.name in bodies
    }
    assert sorted(spans) == sorted(bodies), spans
    for fn, (start, end) in sorted(spans.items(), key=lambda kv: -kv[1][0]):
        lines[start:end] = [textwrap.dedent(bodies[fn]).strip() + "\n"]
    return "".join(lines)


def _tiny_gpt():
    from tpedu.analysis import memory
    from tpedu.analysis.shape import ModelShape

    return memory.TinyGPT(ModelShape(n_layers=3, hidden=48, n_heads=6, vocab_size=211, seq_len=32))


def test_lesson_00_ledger_refuses_an_embedding_that_ignores_bytes_per_param(course, capsys):
    wrong = "def embedding_bytes(vocab, hidden, bytes_per_param=2):\n    return vocab * hidden * 2"
    course("l00_memory_ledger", _written("l00_memory_ledger", embedding_bytes=wrong))
    m = grading.pick("l00")
    assert "yours: embedding_bytes" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="50k × 4096 embedding.*\n.*bytes_per_param ignored"):
        proofs.ledger(m, _tiny_gpt())
    shown = capsys.readouterr().out
    assert "your embedding_bytes" in shown and "the reference's training_bytes, gpt_params" in shown
    assert "embedding" not in shown.split(":\n", 1)[1]  # no ✓ line for it


def test_lesson_00_ledger_refuses_a_parameter_count_without_the_final_norm(course, capsys):
    solution = (ROOT / "solutions" / "l00_memory_ledger.py").read_text(encoding="utf-8")
    wrong = solution.replace("seq_len * h + norm", "seq_len * h")  # the final LayerNorm left out
    assert wrong != solution
    course("l00_memory_ledger", wrong)
    m = grading.pick("l00")
    with pytest.raises(AssertionError, match="gpt_params 96,480 == the real TinyGPT's 96,576"):
        proofs.ledger(m, _tiny_gpt())
    shown = capsys.readouterr().out
    assert "your training_bytes, embedding_bytes, gpt_params:" in shown
    assert shown.count("✓") == 2


def test_lesson_00_ledger_passes_the_reference_and_names_it(monkeypatch, capsys):
    monkeypatch.setenv("TPEDU_IMPL", "solutions")
    proofs.ledger(grading.pick("l00"), _tiny_gpt())
    out = capsys.readouterr().out
    assert "the reference's training_bytes, embedding_bytes, gpt_params:" in out
    assert "your" not in out and out.count("✓") == 3


_RING = ("ring_all_reduce", "ring_reduce_scatter", "ring_all_gather")


def _ring_worker(m):
    """Lesson 02's cell: the ring all-reduce under watch; what ran, whose, and the sum."""
    import torch.distributed as dist

    x = torch.arange(6, dtype=torch.float64, device=tpedu.device()) * (dist.get_rank() + 1)
    with grading.watch(m, *_RING) as called:
        m.ring_all_reduce(x)
    restored = all(getattr(m, n).__name__ == n and not hasattr(getattr(m, n), "__wrapped__") for n in _RING)  # fmt: skip
    return list(called), grading.ran(m, *called), x.tolist(), restored


def test_lesson_02_names_only_the_ring_pieces_that_ran(course, capsys):
    """ring_all_reduce written without the two phases: the line names it alone, not the
    reference's reduce-scatter and all-gather (which never ran)."""
    mine = """
    def ring_all_reduce(x, group=None):
        dist.all_reduce(x, group=group)  # not a ring: the phases are never called
        return x
    """
    course("l02_ring_allreduce", _written("l02_ring_allreduce", ring_all_reduce=mine))
    m = grading.pick("l02")
    assert "yours: ring_all_reduce" in capsys.readouterr().out
    called, line, total, restored = tpedu.launch(_ring_worker, 2, m)[0]
    assert called == ["ring_all_reduce"] and line == "your ring_all_reduce"
    assert total == [3.0 * k for k in range(6)] and restored


def test_lesson_02_names_a_written_phase_run_through_the_references_ring(course, capsys):
    reference = (ROOT / "solutions" / "l02_ring_allreduce.py").read_text(encoding="utf-8")
    start = reference.index("def ring_reduce_scatter(")
    mine = reference[start : reference.index("\ndef ring_all_gather(")]
    course("l02_ring_allreduce", _written("l02_ring_allreduce", ring_reduce_scatter=mine))
    m = grading.pick("l02")
    capsys.readouterr()
    called, line, total, _ = tpedu.launch(_ring_worker, 2, m)[0]
    assert called == list(_RING)
    assert line == "the reference's ring_all_reduce, ring_all_gather and your ring_reduce_scatter"
    assert total == [3.0 * k for k in range(6)]


def test_lesson_01_names_a_split_only_when_a_matmul_calls_it(course, capsys):
    """The learner's column matmul cuts W itself: split_columns (the reference's) never runs,
    and the line after the checks does not name it; the reference's row matmul calls split_rows."""
    mine = """
    def column_parallel_matmul(x, w, parts, matmul=torch.matmul):
        return torch.cat([matmul(x, b) for b in w.tensor_split(parts, dim=1)], dim=-1)
    """
    course("l01_matmul_split", _written("l01_matmul_split", column_parallel_matmul=mine))
    m = grading.pick("l01")
    capsys.readouterr()
    x, w = torch.ones(2, 3), torch.ones(3, 4)
    pieces = ("column_parallel_matmul", "split_columns", "row_parallel_matmul", "split_rows")
    with grading.watch(m, *pieces) as called:
        assert m.column_parallel_matmul(x, w, 2).equal(x @ w)
        assert m.row_parallel_matmul(x, w, 3).equal(x @ w)
    assert called == ["column_parallel_matmul", "row_parallel_matmul", "split_rows"]
    line = grading.ran(m, *called)
    assert line == "your column_parallel_matmul and the reference's row_parallel_matmul, split_rows"


# ---- lessons 12 and 15: the checks run on the picked pieces, and a wrong one is refused


def _solution_with(name, old, new):
    """The reference of exercise `name` with `old` replaced by `new`: a learner's file, all of
    it written, with one bug."""
    text = (ROOT / "solutions" / f"{name}.py").read_text(encoding="utf-8")
    assert text.count(old) == 1, old
    return text.replace(old, new)


def test_lesson_12_buckets_refuses_buckets_filled_from_the_first_parameter(course, capsys):
    wrong = _solution_with(
        "l12_bucketed_allreduce", "in reversed(range(len(numels)))", "in range(len(numels))"
    )
    course("l12_bucketed_allreduce", wrong)
    m = grading.pick("l12_bucketed_allreduce")
    capsys.readouterr()
    with pytest.raises(
        AssertionError, match=r"assign_buckets.*got \[\[0\], \[1, 2\], \[3\]\]\.\n.*from the first"
    ):
        proofs.buckets(m)
    assert capsys.readouterr().out == "your assign_buckets, all_reduce_bucket:\n"  # no ✓


def test_lesson_12_buckets_refuses_a_sum_for_a_mean(course, capsys):
    wrong = _solution_with("l12_bucketed_allreduce", "flat /= dist.get_world_size(group)", "")
    course("l12_bucketed_allreduce", wrong)
    m = grading.pick("l12_bucketed_allreduce")
    with pytest.raises(AssertionError, match=r"all_reduce_bucket on 2 ranks.*\n.*not divided"):
        proofs.buckets(m)
    assert capsys.readouterr().out.count("✓") == 1  # assign_buckets' claim only


@pytest.mark.parametrize(
    ("old", "new", "refused"),
    [
        ("return out / size", "return out", r"reduce_scatter_mean.*\n.*sum not divided"),
        (
            "self.full.untyped_storage().resize_(0)  # the memory goes",
            "pass  # the memory stays",
            r"LazyParams.*24, 24\).*\n.*kept at rest or after free",
        ),
        (
            "psi * weight_bytes / (dp if stage >= 3 else 1)",
            "psi * weight_bytes / (dp if stage >= 2 else 1)",
            r"ZeRO-0..3.*\n.*shards the wrong part",
        ),
    ],
    ids=["sum", "kept", "stage"],
)
def test_lesson_12_zero_refuses_each_wrong_piece(course, capsys, old, new, refused):
    course("l12_zero", _solution_with("l12_zero", old, new))
    m = grading.pick("l12_zero")
    capsys.readouterr()
    with pytest.raises(AssertionError, match=refused):
        proofs.zero(m)
    assert "your reduce_scatter_mean, LazyParams, zero_bytes_per_rank:" in capsys.readouterr().out


def _records():
    from tpedu.comm.tracer import CommRecord

    ops = [("all_reduce", 2, 4096), ("all_gather", 4, 8192), ("reduce_scatter", 2, 1024)]
    return [CommRecord(op, "tp", n, b // 4, b, 0.0, "forward") for op, n, b in ops]


_LINKS = {"gloo": AlphaBeta(5e-4, 2e-9)}  # lesson 15's CPU box


@pytest.mark.parametrize(
    ("old", "new", "refused"),
    [
        ("steps = 2 * (ranks - 1)", "steps = ranks - 1", r"ring all-reduce.*\n.*N - 1 steps"),
        (
            '"all_reduce": lambda n: (2 * (n - 1),',
            '"all_reduce": lambda n: (n - 1,',
            r"gloo.*\n.*another's steps",
        ),  # fmt: skip
        (
            "return float(alpha), float(beta)",
            "return float(beta), float(alpha)",
            r"fit.*\n.*swapped",
        ),  # fmt: skip
    ],
    ids=["ring", "step", "fit"],
)
def test_lesson_15_alpha_beta_refuses_each_wrong_piece(course, capsys, old, new, refused):
    course("l15_alpha_beta", _solution_with("l15_alpha_beta", old, new))
    m = grading.pick("l15_alpha_beta")
    capsys.readouterr()
    with pytest.raises(AssertionError, match=refused):
        proofs.alpha_beta(m, _records(), _LINKS)
    out = capsys.readouterr().out
    assert out.startswith("your ring_all_reduce_seconds, step_comm_seconds, fit_alpha_beta:\n")


def test_lessons_12_and_15_pass_the_reference_and_name_it(monkeypatch, capsys):
    monkeypatch.setenv("TPEDU_IMPL", "solutions")
    proofs.buckets(grading.pick("l12_bucketed_allreduce"))
    proofs.zero(grading.pick("l12_zero"))
    proofs.alpha_beta(grading.pick("l15_alpha_beta"), _records(), _LINKS)
    out = capsys.readouterr().out
    assert "the reference's assign_buckets, all_reduce_bucket:" in out
    assert "the reference's reduce_scatter_mean, LazyParams, zero_bytes_per_rank:" in out
    assert "the reference's ring_all_reduce_seconds, step_comm_seconds, fit_alpha_beta:" in out
    assert "your" not in out and out.count("✓") == 2 + 3 + 3


# ---- tpedu's own twin of an exercise, aliased or wrapped, is not the learner's


def _stub_with(name, text):
    """The stub of exercise `name` with `text` after it: what it defines replaces the stub's."""
    return _stub(name) + textwrap.dedent(text)


def _twins():
    """(exercise, the learner's file: its stub with some functions replaced by tpedu's own
    twins, the graded test to run, its arguments, the twin whose refusal it must report)."""
    from tpedu.analysis import activation_memory, memory
    from tpedu.comm import cost_model, ring
    from tpedu.cp import ring as cp_ring
    from tpedu.model import gpt, state
    from tpedu.moe import dispatch
    from tpedu.parallel import data_parallel, mesh, zero
    from tpedu.parallel.pipeline import schedules
    from tpedu.tp import (
        attention,
        collective_matmul,
        embedding,
        layers,
        matmul_split,
        operators,
        overlap,
        vocab_parallel,
    )
    from tpedu.tp import sequence_parallel as sp

    return {
        "l00": (
            "l00_memory_ledger",
            _stub_with(
                "l00_memory_ledger",
                """
                from tpedu.analysis.memory import embedding_bytes, training_bytes
                from tpedu.analysis.shape import gpt_params
                """,
            ),
            "test_training_bytes_seed_and_real_adamw",
            (),
            memory.training_bytes,
        ),
        "l01": (
            "l01_matmul_split",
            _stub_with(
                "l01_matmul_split",
                """
                from tpedu.tp import matmul_split


                def column_parallel_matmul(x, w, parts, matmul=torch.matmul):
                    return matmul_split.column_parallel_matmul(x, w, parts, matmul)
                """,
            ),
            "test_integer_valued_matrices_are_exact",
            (),
            matmul_split.column_parallel_matmul,
        ),
        "l02": (
            "l02_ring_allreduce",
            _stub_with(
                "l02_ring_allreduce",
                "from tpedu.comm.ring import ring_all_gather, ring_all_reduce, ring_reduce_scatter\n",
            ),
            "test_ring_all_reduce_on_subgroup",
            (),
            ring.ring_all_reduce,
        ),
        "l03": (
            "l03_conjugate_ops",
            _stub_with(
                "l03_conjugate_ops",
                "from tpedu.tp.operators import CopyToTPRegion, ReduceFromTPRegion\n",
            ),
            "test_copy_forward_identity_backward_all_reduce",
            (),
            operators.CopyToTPRegion.forward,
        ),
        "l04": (
            "l04_parallel_linear",
            _stub_with(
                "l04_parallel_linear",
                "from tpedu.tp.layers import column_parallel_linear, row_parallel_linear\n",
            ),
            "test_column_forward",
            (),
            layers.column_parallel_linear,
        ),
        "l04-async": (
            "l04_parallel_linear",
            _stub_with(
                "l04_parallel_linear",
                """
                from tpedu.tp.overlap import linear_with_async_grad_all_reduce


                def column_parallel_linear(x, weight, bias, group=None, gather_output=False):
                    return linear_with_async_grad_all_reduce(x, weight, bias, group)
                """,
            ),
            "test_column_forward",
            (),
            overlap.LinearWithAsyncGradAllreduce.forward,
        ),
        "l05": (
            "l05_qkv_split",
            _stub_with(
                "l05_qkv_split",
                """
                from tpedu.tp import attention


                def local_heads(n_heads, n_kv_heads, tp, rank):
                    return attention.local_heads(n_heads, n_kv_heads, tp, rank)
                """,
            ),
            "test_local_heads",
            (),
            attention.local_heads,
        ),
        "l06": (
            "l06_vocab_parallel_ce",
            _stub_with("l06_vocab_parallel_ce", "from tpedu.tp.embedding import vocab_range\n"),
            "test_vocab_range",
            (),
            embedding.vocab_range,
        ),
        "l06-loss": (
            "l06_vocab_parallel_ce",
            _stub_with(
                "l06_vocab_parallel_ce",
                """
                from tpedu.tp import vocab_parallel


                def vocab_parallel_cross_entropy(shard, target, vocab, group=None, ignore=-100):
                    f = vocab_parallel._VocabParallelCrossEntropy
                    return f.apply(shard, target, vocab, group, ignore)
                """,
            ),
            "test_ignore_index",
            (),
            vocab_parallel._VocabParallelCrossEntropy.forward,
        ),
        "l07": (
            "l07_tp_block",
            _stub_with("l07_tp_block", "from tpedu.model.gpt import TPBlock\n"),
            "test_communication_contract_and_sharding",
            (),
            gpt.TPBlock.__init__,
        ),
        "l08": (
            "l08_sp_ops",
            _stub_with(
                "l08_sp_ops", "from tpedu.tp.sequence_parallel import scatter_to_sp_region\n"
            ),
            "test_scatter_keeps_own_chunk_and_gathers_grads",
            (),
            sp.scatter_to_sp_region,
        ),
        "l09": (
            "l09_context_parallel",
            _stub_with("l09_context_parallel", "from tpedu.cp.ring import merge_partials\n"),
            "test_merge_of_two_key_sets_equals_softmax_over_their_union",
            (),
            cp_ring.merge_partials,
        ),
        "l10": (
            "l10_activation_ledger",
            _stub_with(
                "l10_activation_ledger",
                "from tpedu.analysis.activation_memory import saved_bytes\n",
            ),
            "test_counter_counts_activations_not_parameters",
            (),
            activation_memory.saved_bytes,
        ),
        "l10-formula": (
            "l10_activation_ledger",
            _stub_with(
                "l10_activation_ledger",
                "from tpedu.analysis.memory import activation_bytes_per_layer\n",
            ),
            "test_formula_rows",
            ("selective",),
            memory.activation_bytes_per_layer,
        ),
        "l11": (
            "l11_one_f_one_b",
            _stub_with(
                "l11_one_f_one_b", "from tpedu.parallel.pipeline.schedules import one_f_one_b\n"
            ),
            "test_matches_the_worked_example",
            (),
            schedules.one_f_one_b,
        ),
        "l12-buckets": (
            "l12_bucketed_allreduce",
            _stub_with(
                "l12_bucketed_allreduce",
                "from tpedu.parallel.data_parallel import all_reduce_bucket, assign_buckets\n",
            ),
            "test_worked_example_and_edge_cases",
            (),
            data_parallel.assign_buckets,
        ),
        "l12-zero": (
            "l12_zero",
            _solution_with(
                "l12_zero",
                "return self.full.untyped_storage().nbytes()",
                "from tpedu.parallel.zero import held_bytes\n\n        return held_bytes([self.full])",
            ),
            "test_lazy_params_gather_whole_and_hold_nothing_after_free",
            (1,),
            zero.held_bytes,
        ),
        "l13": (
            "l13_groups",
            _stub_with("l13_groups", "from tpedu.parallel.mesh import rank_groups\n"),
            "test_worked_example",
            (),
            mesh.rank_groups,
        ),
        "l14": (
            "l14_reshard",
            _stub_with(
                "l14_reshard", "from tpedu.model.state import merge_column, merge_qkv, merge_row\n"
            ),
            "test_merge_column",
            (),
            state.merge_column,
        ),
        "l15": (
            "l15_alpha_beta",
            _stub_with(
                "l15_alpha_beta",
                """
                from tpedu.comm.cost_model import AlphaBeta


                def ring_all_reduce_seconds(nbytes, ranks, alpha, beta):
                    return AlphaBeta(alpha, beta).predict("all_reduce", nbytes, ranks)
                """,
            ),
            "test_ring_all_reduce_by_hand",
            (),
            cost_model.AlphaBeta.predict,
        ),
        "l15-fit": (
            "l15_alpha_beta",
            _stub_with(
                "l15_alpha_beta",
                """
                from tpedu.comm.cost_model import Sample, fit


                def fit_alpha_beta(sizes, seconds):
                    ab = fit([Sample("send", int(n), 2, s) for n, s in zip(sizes, seconds)])
                    return ab.alpha, ab.beta
                """,
            ),
            "test_fit_weighs_relative_error_like_the_cost_model",
            (),
            cost_model.fit,
        ),
        "l17": (
            "l17_kv_decode",
            _stub_with(
                "l17_kv_decode",
                """
                from types import SimpleNamespace

                from tpedu.tp.attention import ParallelAttention


                def decode_attention(q, k, v, cache_k, cache_v, length):
                    cache_k[:, :, length], cache_v[:, :, length] = k[:, :, 0], v[:, :, 0]
                    keys, values = cache_k[:, :, : length + 1], cache_v[:, :, : length + 1]
                    core = ParallelAttention._cached_core
                    return core(SimpleNamespace(fused=True), q, keys, values, None), cache_k, cache_v
                """,
            ),
            "test_decoding_token_by_token_equals_causal_attention",
            (4, 2, 2),
            attention.ParallelAttention._cached_core,
        ),
        "l18": (
            "l18_expert_dispatch",
            _solution_with(
                "l18_expert_dispatch",
                "collectives.all_to_all(kept_per_expert.reshape(ep, -1), group)",
                "exchange_counts(kept_per_expert, group)",
            ).replace("import all_to_all_tokens\n", "import all_to_all_tokens, exchange_counts\n"),
            "test_dispatch_sends_each_row_to_its_experts_rank",
            (2,),
            dispatch.exchange_counts,
        ),
        "l19-wrapper": (
            "l19_ring_allgather_matmul",
            _stub_with(
                "l19_ring_allgather_matmul",
                """
                from tpedu.tp.collective_matmul import ring_all_gather_linear


                def ring_all_gather_matmul(x, weight, group=None):
                    return ring_all_gather_linear(x, [weight], [None], group)[0]
                """,
            ),
            "test_ring_equals_the_gathered_matmul",
            (),
            collective_matmul.RingAllGatherLinear.forward,
        ),
        "l19-its-ring": (
            "l19_ring_allgather_matmul",
            _stub_with(
                "l19_ring_allgather_matmul",
                """
                import torch.nn.functional as F

                from tpedu.tp import collective_matmul as cm


                def ring_all_gather_matmul(x, weight, group=None):
                    return cm.ring_gather_apply(x, group, lambda c: [F.linear(c, weight)])[0]
                """,
            ),
            "test_ring_sends_one_shard_right_each_step",
            (),
            collective_matmul.ring_gather_apply,
        ),
    }


TWINS = _twins()


@pytest.mark.parametrize("case", list(TWINS))
def test_tpedus_own_twin_of_an_exercise_is_refused(course, monkeypatch, case):
    """The learner's file aliases or wraps tpedu's own twin of the exercise: the graded test
    fails, naming the tpedu function that ran. (The stubs' other functions still raise
    NotImplementedError; the test chosen needs only the ones replaced.)"""
    name, mine, test, args, twin = TWINS[case]
    course(name, mine)
    monkeypatch.setenv("TPEDU_IMPL", "exercises")
    graded = importlib.import_module(f"tests.exercises.test_{name}")
    if hasattr(graded, "results"):  # l18 keeps each launch's outcome: not this file's
        graded.results.cache_clear()
    try:
        with pytest.raises(Exception, match=re.escape(refused(twin))):
            getattr(graded, test)(*args)
    finally:
        if hasattr(graded, "results"):
            graded.results.cache_clear()
