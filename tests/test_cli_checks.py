"""The CLI's argument checks (one-line errors before any rank starts), generating with a model
trained with --sequence-parallel, `reshard` of a dense model dir, and --resume layout checks.

The CLI runs in this process (`main`), as in tests/test_cli_3d.py; models and checkpoints are
written directly (no training run) to keep this fast.
"""

import pytest
import torch

from tests.helpers import (  # the CLI in this process: (exit code, stdout, stderr)
    Launched,
    cli,
    launches,
    one_line_error,
    tiny_config,
    write_model_dir,
)
from tpedu import checkpoint, launch
from tpedu.cli.commands import main
from tpedu.data.corpus import novel_data
from tpedu.model.dense import DenseGPT
from tpedu.train.generate import generate

TINY = "--layers 1 --hidden 32 --heads 2 --seq 16 --batch 2 --steps 1".split()


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
    one_line_error(
        capfd,
        ["hello", "--nprocs", "2", "--backend", "nccl"],
        f"--backend nccl needs one GPU per rank: 2 ranks on this machine, {gpus} GPUs visible",
    )


def test_generate_with_a_sequence_parallel_model(tmp_path, capfd):
    """A tpedu 0.1 model directory whose config.json says sequence_parallel: true (a run-time
    field inside the model config): generation ignores it (the growing sequence is not always
    divisible by tp) and samples the same tokens as the model without it."""
    tok = novel_data("char")[0]
    config = tiny_config(tok.vocab_size)
    state = write_model_dir(tmp_path / "sp", config, tok, sequence_parallel=True)
    args = "generate --tp 2 --prompt 宝玉 --max-new-tokens 5".split()
    code, out, err = cli(capfd, *args, "--model", str(tmp_path / "sp"))
    assert code == 0, err
    ids = launch(generate, 1, config, state, tok.encode("宝玉"), 5)[0]
    assert out.strip().splitlines()[-1] == tok.decode(ids)


def test_reshard_a_dense_model_dir_to_hf(tmp_path, capfd):
    transformers = pytest.importorskip("transformers")
    config = tiny_config(37)
    state = write_model_dir(tmp_path / "m", config)
    code, out, err = cli(
        capfd, "reshard", str(tmp_path / "m"), "--to", "hf", "--out", str(tmp_path / "hf")
    )
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
    one_line_error(
        capfd,
        ["reshard", str(tmp_path / "m"), "--to", "dense", "--out", str(tmp_path / "d")],
        "is already a dense model dir",
    )


def write_checkpoint(path, n_layers, vocab_size=37):
    config = tiny_config(vocab_size, n_layers=n_layers)
    torch.manual_seed(0)
    return checkpoint.write_sharded(path, config, DenseGPT(config).state_dict(), 0)


def test_resume_layout_is_checked_on_the_checkpoints_layers(tmp_path, capfd):
    """--pp and --chunks are checked against the checkpoint's n_layers, not --layers."""
    two = write_checkpoint(tmp_path / "two", 2)
    one_line_error(
        capfd,
        [
            "train",
            "--tp",
            "1",
            "--pp",
            "2",
            "--chunks",
            "2",
            "--schedule",
            "interleaved",
            *TINY[2:],
            "--batch",
            "4",
            "--layers",
            "4",
            "--resume",
            str(two),
        ],
        "2 layers cannot be split over 4 stages",
    )
    # A 4-layer checkpoint at --pp 4 (no --layers): the layout passes; the next check is the
    # vocabulary (37 here, so no ranks start).
    four = write_checkpoint(tmp_path / "four", 4)
    one_line_error(
        capfd,
        ["train", "--tp", "1", "--pp", "4", *TINY[4:], "--batch", "4", "--resume", str(four)],
        "has vocab_size 37",
    )


# ---------------------------------------------------- refused before launch: no rank may start


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--lr", "-1"],
            "--lr must be a positive number (the peak learning rate, e.g. 3e-3), got -1",
        ),
        (["--lr", "0"], "--lr must be a positive number"),
        (["--lr", "nan"], "--lr must be a positive number"),
        (["--min-lr", "-0.0001"], "--min-lr must be a number at least 0"),
        (["--min-lr", "0.01"], "--min-lr 0.01 is above --lr 0.003"),
        (["--warmup", "-1"], "--warmup must be at least 0, got -1"),
        (
            ["--weight-decay", "-0.1"],
            "--weight-decay must be a number at least 0 (0: no weight decay), got -0.1",
        ),
        (["--grad-clip", "-1"], "--grad-clip must be a number at least 0 (0: no clipping), got -1"),
        (["--grad-clip", "inf"], "--grad-clip must be a number at least 0"),
        (["--eval-batches", "0"], "--eval-batches must be at least 1, got 0"),
        (["--eval-every", "-1"], "--eval-every must be at least 0, got -1"),
        (["--save-every", "-2"], "--save-every must be at least 0, got -2"),
        (["--chunks", "0"], "--chunks must be at least 1, got 0"),
        (["--tokenizer", "bpe", "--bpe-vocab", "-5"], "--bpe-vocab must be at least 1, got -5"),
        (["--batch", "-3"], "--batch must be at least 1, got -3"),
        (["--steps", "-1"], "--steps must be at least 1, got -1"),
    ],
)
def test_bad_train_numbers_fail_before_ranks_start(args, message, no_launch, capfd):
    one_line_error(capfd, ["train", "--tp", "1", *TINY, *args], message)


def test_good_train_numbers_start_the_ranks(no_launch):
    for args in (
        ["--grad-clip", "0", "--weight-decay", "0", "--warmup", "0", "--min-lr", "0"],
        ["--lr", "1e-3", "--min-lr", "1e-3", "--eval-every", "0", "--eval-batches", "1"],
        ["--tokenizer", "char", "--bpe-vocab", "-5"],
    ):
        assert launches("train", "--tp", "1", *TINY, *args)


def test_train_settings_reach_the_training_loop(monkeypatch):
    from tpedu.cli import commands

    seen = {}

    def record(fn, n, config, cfg, *args, **kwargs):
        seen.update(vars(cfg))
        raise Launched

    monkeypatch.setattr(commands, "run", record)
    with pytest.raises(Launched):
        main(["train", "--tp", "1", *TINY])  # the defaults: as before the flags existed
    assert (
        seen["min_lr"],
        seen["warmup"],
        seen["weight_decay"],
        seen["grad_clip"],
        seen["eval_batches"],
    ) == (pytest.approx(3e-4), 1, 0.1, 1.0, 4)
    with pytest.raises(Launched):
        main(
            [
                "train",
                "--tp",
                "1",
                *TINY,
                "--min-lr",
                "1e-4",
                "--warmup",
                "3",
                "--weight-decay",
                "0.01",
                "--grad-clip",
                "0",
                "--eval-batches",
                "2",
            ]
        )
    assert (
        seen["min_lr"],
        seen["warmup"],
        seen["weight_decay"],
        seen["grad_clip"],
        seen["eval_batches"],
    ) == (1e-4, 3, 0.01, 0.0, 2)


def test_a_prompt_the_tokenizer_cannot_encode_fails_before_ranks_start(tmp_path, no_launch, capfd):
    tok = novel_data("char")[0]
    write_model_dir(tmp_path / "m", tiny_config(tok.vocab_size), tok)
    gen = ["generate", "--tp", "1", "--model", str(tmp_path / "m")]
    one_line_error(
        capfd,
        [*gen, "--prompt", "Hello, world €"],
        "the prompt has 6 characters the model's tokenizer does not know: 'H', 'e', "
        "',', 'w', 'd', '€' (",
    )
    one_line_error(
        capfd,
        [*gen, "--prompt", "宝玉€"],
        "the prompt has 1 character the model's tokenizer does not know: '€' (",
    )
    one_line_error(
        capfd,
        [*gen, "--prompt", "".join(chr(0x10000 + i) for i in range(12))],
        "'\U00010009' and 2 more (",
    )
    assert launches(*gen, "--prompt", "宝玉 ", "--max-new-tokens", "5")  # the novel's characters


def test_a_byte_level_bpe_model_takes_any_prompt(tmp_path, capfd):
    from tpedu.data.tokenizer import BPETokenizer

    tok = BPETokenizer.train("满纸荒唐言，一把辛酸泪。\nHello there\n", 300)
    write_model_dir(tmp_path / "m", tiny_config(tok.vocab_size), tok)
    args = ["generate", "--tp", "1", "--prompt", "Hello, world €", "--max-new-tokens", "2"]
    code, out, err = cli(capfd, *args, "--model", str(tmp_path / "m"))
    assert code == 0, err
    assert "Hello, world €" in out  # the prompt, then what the random model added


def truncate_a_shard(step_dir):
    shard = sorted(step_dir.glob("*.safetensors"))[0]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    return shard


def test_a_truncated_resume_checkpoint_fails_before_ranks_start(tmp_path, no_launch, capfd):
    vocab = novel_data("char")[0].vocab_size  # the checkpoint would otherwise be resumed
    step = write_checkpoint(tmp_path / "ck", 1, vocab)
    resume = ["train", "--tp", "1", *TINY, "--resume", str(tmp_path / "ck")]
    assert launches(*resume)
    shard = truncate_a_shard(step)
    one_line_error(capfd, resume, f"{shard} is truncated or overwritten")


@pytest.fixture
def notes(tmp_path):
    """A directory of someone's files: no model directory."""
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    return tmp_path / "notes"


def test_out_refuses_a_directory_that_is_not_a_model(notes, tmp_path, no_launch, capfd):
    one_line_error(
        capfd,
        ["train", "--tp", "1", *TINY, "--out", str(notes)],
        f"--out {notes} exists and is not a model directory (no config.json)",
    )
    assert (notes / "todo.txt").read_text() == "keep me"
    (tmp_path / "empty").mkdir()
    write_model_dir(tmp_path / "model", tiny_config(37))
    for ok in (tmp_path / "new", tmp_path / "empty", tmp_path / "model"):  # nothing to lose
        assert launches("train", "--tp", "1", *TINY, "--out", str(ok))


@pytest.mark.parametrize("to", ["dense", "hf"])
def test_reshard_exports_refuse_a_directory_that_is_not_a_model(to, notes, tmp_path, capfd):
    ck = write_checkpoint(tmp_path / "ck", 1)
    one_line_error(
        capfd,
        ["reshard", str(ck), "--to", to, "--out", str(notes)],
        f"--out {notes} exists and is not a model directory",
    )
    assert [p.name for p in notes.iterdir()] == ["todo.txt"]


def test_json_must_be_a_writable_file_name(tmp_path, no_launch, capfd):
    one_line_error(
        capfd,
        ["train", "--tp", "1", *TINY, "--json", str(tmp_path)],
        "is a directory; give a file name",
    )
    one_line_error(
        capfd,
        ["train", "--tp", "1", *TINY, "--json", str(tmp_path / "no" / "s.json")],
        f"{tmp_path / 'no'} is not a directory",
    )


@pytest.mark.parametrize(
    ("args", "world", "message"),
    [
        (["--tp", "4"], 2, "--tp 4 does not match torchrun's world size 2; pass --tp 2"),
        (
            ["--tp", "1", "--pp", "2", "--dp", "2"],
            2,
            "--tp 1 × --pp 2 × --dp 2 = 4 ranks does not match torchrun's world size 2",
        ),
    ],
)
def test_a_torchrun_world_size_mismatch_is_one_line_from_rank_0(
    args, world, message, monkeypatch, no_launch, capfd
):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world))
    for rank in range(world):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        code, out, err = cli(capfd, "train", *args, *TINY)
        assert code == 2
        if rank == 0:
            assert message in err and len(err.strip().splitlines()) == 1, err
        else:
            assert err == "" and out == ""  # the error line is rank 0's
