"""`python -m tpedu generate` with the KV cache (the default), --no-cache, --greedy and a batch of
prompts from --prompts FILE; the context-length limit and bad prompt files as one-line errors.
The CLI runs in this process; the model directory is written directly (random weights)."""

import pytest

from tests.helpers import (
    cli,  # the CLI in this process: (exit code, stdout, stderr)
    launches,
    one_line_error,
    tiny_config,
    write_model_dir,
)
from tpedu import launch
from tpedu.data.corpus import novel_data
from tpedu.serve.generate import Sampling
from tpedu.train.generate import generate


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tok = novel_data("char")[0]
    config = tiny_config(tok.vocab_size)  # seq_len 16
    path = tmp_path_factory.mktemp("gen") / "m"
    state = write_model_dir(path, config, tok)
    return path, config, state, tok


def test_a_batch_of_prompts_prints_each_continuation_on_its_line(model_dir, tmp_path, capfd):
    path, config, state, tok = model_dir
    prompts = ["宝玉", "却说黛玉"]
    (tmp_path / "p.txt").write_text("\n".join(["宝玉", "", "却说黛玉"]) + "\n", encoding="utf-8")
    args = ["generate", "--model", str(path), "--prompts", str(tmp_path / "p.txt")]
    args += ["--max-new-tokens", "6", "--greedy"]
    outputs = []
    for extra in ([], ["--no-cache"]):
        code, out, err = cli(capfd, *args, "--tp", "2", *extra)
        assert code == 0, err
        outputs.append(out.strip().splitlines()[-2:])
    alone = [
        tok.decode(launch(generate, 1, config, state, tok.encode(p), 6, Sampling(greedy=True))[0])
        for p in prompts
    ]
    expected = [text.replace("\n", "⏎") for text in alone]
    assert outputs[0] == outputs[1] == expected  # cache or not, batch or not, tp 2 or 1


def test_one_prompt_samples_the_same_text_with_and_without_the_cache(model_dir, capfd):
    path, _, _, _ = model_dir
    args = ["generate", "--tp", "1", "--model", str(path), "--prompt", "宝玉"]
    args += ["--max-new-tokens", "10", "--seed", "4"]
    texts = []
    for extra in ([], ["--no-cache"]):
        code, out, err = cli(capfd, *args, *extra)
        assert code == 0, err
        texts.append(out.strip().splitlines()[-1])
    assert texts[0] == texts[1] and texts[0].startswith("宝玉") and len(texts[0]) == 12


@pytest.mark.usefixtures("no_launch")
def test_the_context_length_and_bad_prompt_files_are_one_line_errors(model_dir, tmp_path, capfd):
    path, _, _, _ = model_dir
    gen = ["generate", "--tp", "1", "--model", str(path)]
    one_line_error(
        capfd,
        [*gen, "--prompt", "宝玉", "--max-new-tokens", "15"],
        "--max-new-tokens 15: a prompt of 2 tokens + 15 = 17 is more than the model's context "
        "length 16; use --max-new-tokens 14 or less, or --no-cache",
    )
    assert launches(*gen, "--prompt", "宝玉", "--max-new-tokens", "14")
    assert launches(*gen, "--prompt", "宝玉", "--max-new-tokens", "15", "--no-cache")
    one_line_error(
        capfd, [*gen, "--prompt", "宝玉", "--max-new-tokens", "-1"], "must be at least 0"
    )
    (tmp_path / "empty.txt").write_text("\n  \n", encoding="utf-8")
    one_line_error(capfd, [*gen, "--prompts", str(tmp_path / "empty.txt")], "has no prompts")
    one_line_error(capfd, [*gen, "--prompts", str(tmp_path / "nope.txt")], "cannot read it")
    code, _, err = cli(capfd, *gen, "--prompt", "宝玉", "--prompts", str(tmp_path / "e.txt"))
    assert code == 2 and "not allowed with argument" in err
