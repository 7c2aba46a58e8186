"""Every command a stub, a hint, the README's grading section, a lesson or the grader's own table
tells the learner to type works as written.

Commands are read from the text itself (backticks, code blocks, indented lines), so a new one is
checked without a change here:

- `python -m tpedu.course.grading ...`: run through the grader's `main` (exit code 0); grading
  itself is replaced by a stand-in that records which exercises were asked for (one real run, on
  solutions/, shows the command end to end);
- `make grade ...` (and any other `make X`): `make -n` must know the target, and the grading
  command it expands to is run as above;
- `tpedu.grading.hint(...)`, `hint(...)`, `from tpedu.grading import hint`: run in one fresh
  interpreter that has done nothing but `import tpedu`;
- `python -m tpedu <command> ...`: parsed by tpedu's own argument parser.
"""

import json
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from tpedu.course import grading

ROOT = grading.ROOT
GRADER = "python -m tpedu.course.grading"
COMMAND = re.compile(
    r"(python -m tpedu(?:\.course\.grading)?\b[^`\n#;()]*"
    r"|(?:from tpedu\.grading import hint; )?(?:tpedu\.grading\.)?hint\(['\"]\w+['\"], \d\))"
    r"|(?:`|^    )(make [a-z-]+(?: [A-Z]+=(?:\"[^\"]*\"|[^\s`;,)]+))?)",  # code, not prose
    re.MULTILINE,
)


def _indent_fences(text: str) -> str:
    """Markdown with each fenced code block's lines indented by 4 spaces, as a code line is in
    a docstring: a `make` at the start of a code line is a command, in prose it is a verb."""
    return re.sub(
        r"^```[^\n]*\n(.*?)^```", lambda m: re.sub(r"^", "    ", m.group(1), flags=re.M), text,
        flags=re.M | re.S,
    )  # fmt: skip


def _grading_section() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index("## Exercises and grading")
    return text[start : text.index("\n## ", start + 1)]


def _notebook_markdown() -> list[tuple[str, str]]:
    found = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        found += [(path.name, "".join(c["source"])) for c in cells if c["cell_type"] == "markdown"]
    return found


def sources() -> list[tuple[str, str]]:
    """(where, text) of everything that tells the learner what to type."""
    files = sorted(ROOT.glob("exercises/*.py")) + sorted(ROOT.glob("exercises/hints/*.md"))
    found = [(p.name, p.read_text(encoding="utf-8")) for p in files]
    found.append(("README.md, Exercises and grading", _grading_section()))
    found += _notebook_markdown()
    scores = [grading.Score("l04_parallel_linear", 1, 2, 0, [("test_x", "AssertionError: x")])]
    found.append(("grading.table", grading.table(scores)))
    return found


def commands() -> dict[str, list[str]]:
    """Each command found, with where it was found."""
    found: dict[str, list[str]] = {}
    for where, text in sources():
        for match in COMMAND.finditer(_indent_fences(text)):
            command = (match.group(1) or match.group(2)).strip().rstrip(".,:")

            found.setdefault(command, []).append(where)
    return found


def test_the_commands_are_found():
    """The extraction itself: the stubs', hints', README's and table's commands are all seen."""
    found = commands()
    assert f"{GRADER} hint l04 1" in found  # a hint file
    assert "make grade EX=l04" in found and f"{GRADER} l04" in found  # a stub, the table
    assert "tpedu.grading.hint('l04', 1)" in found  # a stub's NotImplementedError message
    assert "make grade" in found and 'hint("l03", 1)' in found  # the README and lesson 03
    assert any(c.startswith("python -m tpedu train") for c in found)  # a lesson's code block
    assert sum(map(len, found.values())) > 60


def _grader_args(command: str) -> list[str]:
    return shlex.split(command)[3:]


def test_every_grading_command_runs(monkeypatch, capsys):
    asked = []

    def fake_grade(kind="exercises", quiet=True, names=None):
        asked.append((kind, names))
        return [grading.Score(n, 1, 0) for n in names or grading.exercise_names()]

    monkeypatch.setattr(grading, "grade", fake_grade)
    ran = 0
    for command, where in commands().items():
        if not command.startswith(GRADER):
            continue
        rc = grading.main(_grader_args(command))
        out = capsys.readouterr()
        assert rc == 0, f"{command!r} (in {where[0]}) exits {rc}: {out.err}"
        ran += 1
    assert ran >= 20 and asked
    assert all(names is None or set(names) <= set(grading.exercise_names()) for _, names in asked)


def test_one_grading_command_end_to_end():
    """What the stand-in above skips: the grader itself, on the reference of one fast exercise."""
    p = subprocess.run(
        [sys.executable, "-m", "tpedu.course.grading", "solutions", "l01"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert re.search(r"^l01_matmul_split +(\d+) +\1 +done$", p.stdout, re.MULTILINE), p.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_every_make_command_is_a_target_and_grade_expands_to_the_grader(monkeypatch, capsys):
    monkeypatch.setattr(grading, "grade", lambda kind, quiet=True, names=None: [])
    for command, where in commands().items():
        if not command.startswith("make "):
            continue
        p = subprocess.run(
            # PYTHON given: make skips its search for an interpreter (seconds per call)
            ["make", "-n", "PYTHON=python3", *shlex.split(command)[1:]],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert p.returncode == 0, f"{command!r} (in {where[0]}): {p.stderr}"
        if command.startswith("make grade"):
            line = next(x for x in p.stdout.splitlines() if "tpedu.course.grading" in x)
            args = shlex.split(line.partition("tpedu.course.grading")[2])
            assert grading.main(args) == 0, f"{command!r} runs {line!r}: {capsys.readouterr()}"
            ex = re.search(r"EX=(\S+)", command)
            assert args == ["exercises", *([ex.group(1).strip('"')] if ex else [])], line


def test_every_hint_call_runs_after_import_tpedu():
    calls = [c for c in commands() if "hint(" in c]
    first = sorted(calls, key=lambda c: not c.startswith("tpedu."))  # before any other import
    lines = ["import tpedu"]
    for call in first:
        plain = call.startswith(("tpedu.", "from "))
        lines.append(call if plain else "from tpedu.grading import hint; " + call)
    p = subprocess.run(
        [sys.executable, "-c", "\n".join(lines)], cwd=ROOT, capture_output=True, text=True
    )
    assert p.returncode == 0, "\n".join(lines) + "\n" + p.stderr
    assert len(calls) >= 20  # every stub's message asks for a hint this way


def test_every_tpedu_command_parses():
    from tpedu.cli.parser import build_parser

    parser = build_parser()
    for command, where in commands().items():
        if not command.startswith("python -m tpedu ") or command.startswith(GRADER):
            continue
        argv = shlex.split(command)[3:]
        if len(argv) == 1:  # a command named in prose: it must exist
            argv.append("--help")
        elif argv[-1].startswith("--") and not parses(parser, argv):
            argv.append("VALUE")  # a flag named in prose (`train --resume`): it must exist
        assert parses(parser, argv), f"{command!r} (in {where[0]}) does not parse"


def parses(parser, argv):
    try:
        parser.parse_args(argv)
    except SystemExit as e:
        return e.code == 0  # --help
    return True
