"""`python -m tpedu train` and `generate`: plainly and under torchrun, and their one-line errors.

The module's trained model and the torchrun job start `python -m tpedu` themselves; every other
command runs the CLI's `main` in this process (`here`: its ranks are forked from here, as the
command forks them), which saves an interpreter start (3-5 s with torch) each. The command
line's own entry, exit codes and one-line errors as a started interpreter shows them:
tests/test_cli.py."""

import json
import subprocess
import sys

import pytest

from tests.helpers import cli  # the CLI in this process: (exit code, stdout, stderr)

SMALL = "--layers 1 --hidden 32 --heads 4 --seq 32 --batch 4 --steps 4 --eval-every 2".split()


def tpedu(*args, torchrun=None, timeout=300):
    cmd = [sys.executable]
    if torchrun:
        cmd += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(torchrun)]
    return subprocess.run(
        [*cmd, "-m", "tpedu", *args], capture_output=True, text=True, timeout=timeout
    )


def here(capfd, *args):
    """`python -m tpedu *args`, run in this process: what `tpedu(*args)` returns."""
    code, out, err = cli(capfd, *args)
    return subprocess.CompletedProcess(["tpedu", *args], code, out, err)


def summary_of(stdout):
    return json.loads(stdout[stdout.index("{") :])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("model") / "hlm"
    p = tpedu("train", "--tp", "2", *SMALL, "--out", str(out))
    assert p.returncode == 0, p.stderr
    return out, summary_of(p.stdout)


def test_train_plainly_prints_a_json_summary(trained):
    out, s = trained
    assert s["tp"] == 2 and s["final_val_loss"] > 0 and s["tokens_per_second"] > 0
    assert s["parameters_per_rank"] < s["parameters_total"]
    assert s["settings"]["train"]["steps"] == 4
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "tokenizer.json"}


def test_train_under_torchrun_matches_the_plain_run(trained):
    p = tpedu("train", "--tp", "2", *SMALL, torchrun=2)
    assert p.returncode == 0, p.stderr
    assert summary_of(p.stdout)["final_train_loss"] == trained[1]["final_train_loss"]


def test_generate_continues_the_prompt(trained, capfd):
    out, _ = trained
    runs = [
        here(
            capfd,
            "generate",
            "--tp",
            str(tp),
            "--model",
            str(out),
            "--prompt",
            "宝玉",
            "--max-new-tokens",
            "12",
        )
        for tp in (1, 2)
    ]
    for p in runs:
        assert p.returncode == 0, p.stderr
    texts = [p.stdout.strip().splitlines()[-1] for p in runs]
    assert texts[0].startswith("宝玉") and len(texts[0]) == 14
    assert texts[0] == texts[1]  # the same seed samples the same tokens at tp=1 and tp=2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["train", "--tp", "3", *SMALL],
            "4 heads are not divisible by tp=3; valid tp values: 1, 2, 4",
        ),
        (["train", "--tp", "64"], "--tp 64 is more than 4 ranks per core"),
        (
            ["generate", "--model", "/nonexistent", "--prompt", "宝玉"],
            "/nonexistent/config.json is missing",
        ),
        (["generate", "--model", "/nonexistent", "--prompt", "  "], "--prompt is empty"),
    ],
)
def test_bad_arguments_are_one_line_errors(args, message, capfd):
    p = here(capfd, *args)
    assert p.returncode == 2
    assert message in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert "Traceback" not in p.stderr


def refused(p, message):
    """Exit code 2 and one line on stderr naming the problem, printed before any rank started
    (a rank's output is prefixed `[rank r]`; a failed rank exits 1 with its traceback)."""
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tpedu: error: "), p.stderr
    assert message in lines[0], lines[0]
    assert p.stdout == "" and "[rank" not in p.stderr


def test_a_negative_learning_rate_is_refused_before_ranks_start(capfd):
    refused(
        here(capfd, "train", "--lr", "-1"),
        "--lr must be a positive number (the peak learning rate, e.g. 3e-3), got -1",
    )


def test_a_prompt_with_characters_the_model_does_not_know_is_refused(trained, capfd):
    out, _ = trained
    p = here(capfd, "generate", "--model", str(out), "--prompt", "Hello, world €")
    refused(
        p,
        "the prompt has 6 characters the model's tokenizer does not know: 'H', 'e', ',', "
        "'w', 'd', '€' (",
    )
    assert p.stderr.strip().endswith("use characters from its training text")


def test_a_truncated_checkpoint_is_refused_before_ranks_start(tmp_path, capfd):
    from tpedu import checkpoint
    from tpedu.data.corpus import novel_data
    from tpedu.model.config import GPTConfig
    from tpedu.model.dense import DenseGPT
    from tpedu.parallel.config import ParallelConfig

    config = GPTConfig.gpt2_like(
        novel_data("char")[0].vocab_size, seq_len=16, n_layers=1, hidden=32, n_heads=2
    )
    step = checkpoint.write_sharded(
        tmp_path / "ck", config, DenseGPT(config).state_dict(), 0, ParallelConfig(tp=2)
    )
    shard = sorted(step.glob("*.safetensors"))[-1]
    with open(shard, "r+b") as f:
        f.truncate(100)
    refused(
        here(capfd, "train", "--resume", str(tmp_path / "ck")),
        f"{shard} is truncated or overwritten: 100 bytes",
    )


def test_out_does_not_replace_a_directory_of_other_files(tmp_path, capfd):
    (tmp_path / "todo.txt").write_text("keep me")
    refused(
        here(capfd, "train", *SMALL, "--out", str(tmp_path)),
        f"--out {tmp_path} exists and is not a model directory (no config.json)",
    )
    assert [p.name for p in tmp_path.iterdir()] == ["todo.txt"]
    assert (tmp_path / "todo.txt").read_text() == "keep me"


def test_train_in_bf16_and_fp16_from_the_command_line(trained, capfd):
    """--dtype reaches the loop (the losses move off fp32's, the summary records it); fp16
    reports its loss scale; --grad-reduce low is accepted with --dp."""
    _, fp32 = trained
    for dtype in ("bf16", "fp16"):
        p = here(capfd, "train", "--tp", "2", *SMALL, "--dtype", dtype)
        assert p.returncode == 0, p.stderr
        s = summary_of(p.stdout)
        assert s["settings"]["train"]["dtype"] == dtype
        assert s["final_val_loss"] != fp32["final_val_loss"]
        assert abs(s["final_val_loss"] - fp32["final_val_loss"]) < 0.02 * fp32["final_val_loss"]
        assert ("loss_scale" in s) == (dtype == "fp16")
    p = here(
        capfd, "train", "--tp", "1", "--dp", "2", *SMALL, "--dtype", "bf16", "--grad-reduce", "low"
    )
    assert p.returncode == 0, p.stderr
    assert summary_of(p.stdout)["settings"]["train"]["grad_reduce"] == "low"


def test_train_with_context_parallelism_from_the_command_line(capfd):
    """--cp 2 splits each sequence over 2 ranks (ring attention, zig-zag): the same losses as
    --tp 1 within float32 reordering; what it cannot run yet is refused in one line."""
    args = "--layers 1 --hidden 32 --heads 4 --seq 32 --batch 4 --steps 3 --eval-every 3".split()
    one, two = (here(capfd, "train", *args, *extra) for extra in ([], ["--cp", "2"]))
    assert one.returncode == 0 and two.returncode == 0, two.stderr
    a, b = summary_of(one.stdout), summary_of(two.stdout)
    assert b["cp"] == 2 and b["settings"]["parallel"]["cp"] == 2
    assert b["final_train_loss"] == pytest.approx(a["final_train_loss"], rel=2e-5)
    assert b["final_val_loss"] == pytest.approx(a["final_val_loss"], rel=2e-5)
    refused(
        here(capfd, "train", *args, "--cp", "2", "--sequence-parallel"),
        "context parallelism with sequence parallelism is not supported yet",
    )
    refused(here(capfd, "train", *args, "--cp", "3"), "sequence length 32 is not divisible by 6")
