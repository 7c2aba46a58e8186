"""The CLI's argument checks (one-line errors before any rank starts), generating with a model
trained with --sequence-parallel, `reshard` of a dense model dir, and --resume layout checks.

The CLI runs in this process (`main`), as in tests/test_cli_3d.py; models and checkpoints are
written directly (no training run) to keep this fast.
"""

import json

import pytest
import torch
from safetensors.torch import save_file

from tests.test_cli_3d import tpedu  # runs the CLI in this process: (exit code, stdout, stderr)
from tpedu import checkpoint, launch
from tpedu.model.config import GPTConfig
from tpedu.model.dense import DenseGPT
from tpedu.train.data.corpus import novel_data
from tpedu.train.generate import generate

TINY = ["--layers", "1", "--hidden", "32", "--heads", "2", "--seq", "16", "--batch", "2",
        "--steps", "1"]  # fmt: skip


def one_line_error(capfd, args, message):
    code, _, err = tpedu(capfd, *args)
    assert code == 2, err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err


@pytest.fixture(scope="module")
def a_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("f") / "not_a_dir"
    path.write_text("x")
    return str(path)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train", *TINY, "--heads", "0"], "n_heads = 0 must be a positive"),
        (["train", *TINY, "--dropout", "1.5"], "dropout = 1.5 must be in [0, 1)"),
        (["train", *TINY, "--batch", "0"], "--batch must be at least 1, got 0"),
        (["train", *TINY, "--seq", "0"], "--seq must be at least 1, got 0"),
        (["train", *TINY, "--steps", "0"], "--steps must be at least 1, got 0"),
        (["train", *TINY, "--layers", "0"], "--layers must be at least 1, got 0"),
        (["train", *TINY, "--hidden", "0"], "--hidden must be at least 1, got 0"),
        (
            ["generate", "--model", "/nonexistent", "--prompt", "宝玉", "--top-k", "0"],
            "--top-k 0: must be at least 1",
        ),
        (
            ["generate", "--model", "/nonexistent", "--prompt", "宝玉", "--temperature", "-1"],
            "--temperature -1.0: must be at least 0",
        ),
        (["commbench", "--nprocs", "1"], "--nprocs 1: commbench needs at least 2 ranks"),
        (["commbench", "--repeats", "0"], "--repeats 0: must be at least 1"),
        (["commbench", "--sizes", "4096"], "--sizes needs at least 2 different sizes"),
        (["commbench", "--sizes", "4096", "4096"], "--sizes needs at least 2 different sizes"),
    ],
)
def test_bad_arguments_fail_before_ranks_start(args, message, capfd):
    one_line_error(capfd, args, message)


@pytest.mark.parametrize("flag", ["--out", "--ckpt-dir"])
def test_out_and_ckpt_dir_must_be_directories(flag, a_file, capfd):
    one_line_error(capfd, ["train", *TINY, flag, a_file], f"{a_file} is a file, not a directory")
    one_line_error(capfd, ["train", *TINY, flag, f"{a_file}/sub"], "is a file, not a directory")


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has the GPUs")
def test_nccl_needs_a_gpu_per_rank(capfd):
    gpus = torch.cuda.device_count()
    one_line_error(capfd, ["hello", "--nprocs", "2", "--backend", "nccl"],
                   f"--backend nccl needs one GPU per rank: 2 ranks on this machine, {gpus} "
                   "GPUs visible")  # fmt: skip


def tiny_config(vocab_size, **overrides):
    return GPTConfig.gpt2_like(vocab_size, **{"seq_len": 16, "n_layers": 1, "hidden": 32,
                                              "n_heads": 2, **overrides})  # fmt: skip


def write_model_dir(path, config, tok=None):
    """A dense model directory as `train --out` writes it (random weights, seed 0)."""
    torch.manual_seed(0)
    state = DenseGPT(config).state_dict()
    path.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in state.items()}, path / "model.safetensors")
    meta = {"model": config.to_dict(), "train": {}, "format": "tpedu-dense-1"}
    (path / "config.json").write_text(json.dumps(meta))
    if tok is not None:
        tok.save(path / "tokenizer.json")
    return state


def test_generate_with_a_sequence_parallel_model(tmp_path, capfd):
    """config.json keeps sequence_parallel: true; generation turns it off (the growing sequence
    is not always divisible by tp) and samples the same tokens as the model without it."""
    tok = novel_data("char")[0]
    config = tiny_config(tok.vocab_size, sequence_parallel=True)
    state = write_model_dir(tmp_path / "sp", config, tok)
    code, out, err = tpedu(capfd, "generate", "--tp", "2", "--model", str(tmp_path / "sp"),
                           "--prompt", "宝玉", "--max-new-tokens", "5")  # fmt: skip
    assert code == 0, err
    plain = tiny_config(tok.vocab_size)
    ids = launch(generate, 1, plain, state, tok.encode("宝玉"), 5)[0]
    assert out.strip().splitlines()[-1] == tok.decode(ids)


def test_reshard_a_dense_model_dir_to_hf(tmp_path, capfd):
    transformers = pytest.importorskip("transformers")
    config = tiny_config(37)
    state = write_model_dir(tmp_path / "m", config)
    code, out, err = tpedu(capfd, "reshard", str(tmp_path / "m"), "--to", "hf",
                           "--out", str(tmp_path / "hf"))  # fmt: skip
    assert code == 0, err
    assert {p.name for p in (tmp_path / "hf").iterdir()} == {"config.json", "model.safetensors"}
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").double().eval()
    dense = DenseGPT(config)
    dense.load_state_dict(state)
    ids = torch.randint(0, 37, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (hf(ids).logits - dense.double().eval()(ids)).abs().max().item()
    assert diff < 1e-12, f"max |HF - tpedu| logits = {diff:.1e}"
    capfd.readouterr()  # transformers' loading progress bar
    one_line_error(capfd, ["reshard", str(tmp_path / "m"), "--to", "dense", "--out",
                           str(tmp_path / "d")], "is already a dense model dir")  # fmt: skip


def write_checkpoint(path, n_layers, vocab_size=37):
    config = tiny_config(vocab_size, n_layers=n_layers)
    torch.manual_seed(0)
    return checkpoint.write_sharded(path, config, DenseGPT(config).state_dict(), 0)


def test_resume_layout_is_checked_on_the_checkpoints_layers(tmp_path, capfd):
    """--pp and --chunks are checked against the checkpoint's n_layers, not --layers."""
    two = write_checkpoint(tmp_path / "two", 2)
    one_line_error(capfd, ["train", "--tp", "1", "--pp", "2", "--chunks", "2", "--schedule",
                           "interleaved", *TINY[2:], "--batch", "4", "--layers", "4",
                           "--resume", str(two)],
                   "2 layers cannot be split over 4 stages")  # fmt: skip
    # A 4-layer checkpoint at --pp 4 (no --layers): the layout passes; the next check is the
    # vocabulary (37 here, so no ranks start).
    four = write_checkpoint(tmp_path / "four", 4)
    one_line_error(capfd, ["train", "--tp", "1", "--pp", "4", *TINY[4:], "--batch", "4",
                           "--resume", str(four)], "has vocab_size 37")  # fmt: skip
