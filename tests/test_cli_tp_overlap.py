"""`train --tp-overlap chunks|ring`: the same losses and gradient norms as the run without it, at
(tp 2) / (tp 2, sequence parallel), at (tp 2, pp 2, dp 2) and at (tp 2, dp 2, ZeRO-3); bad
combinations are one-line errors (exit code 2) before any rank starts. With context parallelism
and with experts: tests/test_tp_overlap_cp_moe.py.

Tolerance 1e-6 relative, float32 (eps 1.2e-7): chunked blocks add each weight gradient as n
chunk products and the ring adds its partial sums in its own order (a few ulps per gradient),
and 3 AdamW steps carry that into the losses. Measured on a 2-core CPU: the losses were bitwise
equal, the gradient norms within 6e-8 relative; the ring at tp 2 bitwise equal to the
sequence-parallel run.
"""

import json

import pytest

from tests.helpers import cli  # the CLI in this process: (exit code, stdout, stderr)

TINY = "--layers 2 --hidden 32 --heads 4 --seq 16 --steps 3 --eval-every 1 --dropout 0.1".split()
LAYOUTS = {
    "tp2": ["--tp", "2", "--batch", "4"],
    "tp2-pp2-dp2": "--tp 2 --pp 2 --dp 2 --batch 8 --micro-batches 2".split(),
    "tp2-dp2-zero3": "--tp 2 --dp 2 --zero 3 --batch 8".split(),  # parameters gathered per block
}
RUNS = {  # name: (flags, the run it must match)
    "none": ([], None),
    "sp": (["--sequence-parallel"], "none"),
    "chunks": (["--tp-overlap", "chunks", "--tp-chunks", "2"], "none"),
    "ring": (["--sequence-parallel", "--tp-overlap", "ring"], "sp"),
}


def _train(capfd, path, *args):
    code, _, err = cli(capfd, "train", *args, *TINY, "--json", str(path))
    assert code == 0, err
    return json.loads(path.read_text())


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_overlap_runs_match_the_run_without(layout, tmp_path, capfd):
    got = {}
    for name, (flags, ref) in RUNS.items():
        got[name] = s = _train(capfd, tmp_path / f"{name}.json", *LAYOUTS[layout], *flags)
        if ref is None:
            continue
        r = got[ref]
        assert s["settings"]["parallel"]["tp_overlap"] == (
            name if name in ("chunks", "ring") else "none"
        )
        for step, (a, b) in enumerate(zip(s["losses"], r["losses"], strict=True)):
            assert a == pytest.approx(b, rel=1e-6), f"{layout} {name} step {step}: {a} vs {b}"
        for h, hr in zip(s["history"], r["history"], strict=True):
            assert h["grad_norm"] == pytest.approx(hr["grad_norm"], rel=1e-6), (layout, name)
            assert h["val_loss"] == pytest.approx(hr["val_loss"], rel=1e-6), (layout, name)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tp-overlap", "ring"], "tp_overlap 'ring' decomposes sequence parallelism's"),
        (
            ["--tp-overlap", "chunks", "--sequence-parallel"],
            "tp_overlap 'chunks' splits the all-reduces of plain TP",
        ),
        (
            ["--tp-overlap", "chunks", "--tp-chunks", "3"],
            "--tp-chunks 3 does not divide the micro-batch of 4 sequences",
        ),
        (["--tp-overlap", "chunks", "--tp-chunks", "0"], "tp_chunks must be at least 1"),
    ],
)
def test_bad_overlap_combinations_are_one_line_errors(flags, message, capfd):
    code, out, err = cli(capfd, "train", "--tp", "2", "--batch", "4", *TINY, *flags)
    assert code == 2
    assert err.count("\n") == 1 and message in err, err
