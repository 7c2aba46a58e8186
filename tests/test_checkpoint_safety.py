"""Replacing a directory never leaves nothing behind (a crash keeps the previous checkpoint or
model loadable), and a dense model directory is checked before it is imported.

One process, no ranks: checkpoints are written offline with write_sharded. A crash is simulated
by making os.rename / shutil.rmtree fail, or stop everything after it ("killed"), at each step.
"""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

from tpedu import checkpoint
from tpedu.checkpoint.files import CheckpointError
from tpedu.model.config import GPTConfig
from tpedu.model.dense import DenseGPT

CONFIG = GPTConfig.gpt2_like(41, seq_len=8, n_layers=2, hidden=16, n_heads=2)


class Killed(BaseException):
    """The process dies here: nothing after this runs (not even cleanup)."""


def weights(seed):
    torch.manual_seed(seed)
    return DenseGPT(CONFIG).state_dict()


def assert_loads(path, want):
    _, got, _ = checkpoint.read_dense(path)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("crash", ["rename fails", "killed between renames", "killed in rmtree"])
def test_resaving_the_latest_step_never_leaves_latest_pointing_at_nothing(
    tmp_path, monkeypatch, crash
):
    root = tmp_path / "ck"
    first, second = weights(0), weights(1)
    checkpoint.write_sharded(root, CONFIG, first, 5)
    real_rename, real_rmtree = os.rename, shutil.rmtree
    renames = []

    def rename(src, dst):
        renames.append(src)
        if crash == "rename fails" and os.path.basename(src).startswith(".tmp-"):
            raise OSError(28, "No space left on device")
        if crash == "killed between renames" and len(renames) > 1:
            raise Killed
        real_rename(src, dst)

    def rmtree(path, *args, **kwargs):  # deletes one file, then the process dies
        if crash == "killed in rmtree" and (path / checkpoint.INDEX).exists():
            (path / checkpoint.INDEX).unlink()
            raise Killed
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    with pytest.raises((OSError, Killed)):
        checkpoint.write_sharded(root, CONFIG, second, 5)
    monkeypatch.undo()
    assert (root / "latest").read_text().strip() == "step_00000005"
    # the previous checkpoint, or (killed after the new one was in place) the new one
    assert_loads(root, second if crash == "killed in rmtree" else first)


def test_resaving_a_step_replaces_it_and_leaves_nothing_aside(tmp_path):
    root = tmp_path / "ck"
    checkpoint.write_sharded(root, CONFIG, weights(0), 5)
    checkpoint.write_sharded(root, CONFIG, weights(1), 5)
    assert {p.name for p in root.iterdir()} == {"latest", "step_00000005"}
    assert_loads(root, weights(1))


def test_a_failed_export_keeps_the_previous_export(tmp_path, monkeypatch):
    ck = checkpoint.write_sharded(tmp_path / "ck", CONFIG, weights(0), 5)
    dense = checkpoint.export_dense(ck, tmp_path / "dense")
    before = checkpoint.read_model_dir(dense)[1]
    real_rename = os.rename

    def rename(src, dst):
        if os.path.basename(src).startswith(".tmp-"):
            raise OSError(28, "No space left on device")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError):
        checkpoint.export_dense(ck, dense)
    monkeypatch.undo()
    after = checkpoint.read_model_dir(dense)[1]
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_failed_hf_export_keeps_the_previous_one(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    import safetensors.torch

    ck = checkpoint.write_sharded(tmp_path / "ck", CONFIG, weights(0), 5)
    out = checkpoint.export_hf(ck, tmp_path / "hf")
    wider = GPTConfig(**{**CONFIG.to_dict(), "n_layers": 3})
    torch.manual_seed(0)
    ck3 = checkpoint.write_sharded(tmp_path / "ck3", wider, DenseGPT(wider).state_dict(), 5)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with pytest.raises(OSError):
        checkpoint.export_hf(ck3, out)
    monkeypatch.undo()  # config.json is not the 3-layer model's next to the 2-layer weights
    assert json.loads((out / "config.json").read_text())["n_layer"] == 2
    assert checkpoint.export_hf(ck3, out) == out
    assert json.loads((out / "config.json").read_text())["n_layer"] == 3


def test_exports_refuse_to_replace_a_directory_that_is_not_a_model(tmp_path):
    ck = checkpoint.write_sharded(tmp_path / "ck", CONFIG, weights(0), 5)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    for export in (checkpoint.export_dense, checkpoint.export_hf):
        with pytest.raises(CheckpointError, match="notes exists and is not a model directory"):
            export(ck, tmp_path / "notes")
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"


# ---------------------------------------------------------------- import_dense checks its input


def dense_dir(path, state=None, meta=None):
    path.mkdir()
    save_file(weights(0) if state is None else state, path / "model.safetensors")
    meta = {"model": CONFIG.to_dict(), "format": "tpedu-dense-1"} if meta is None else meta
    (path / "config.json").write_text(json.dumps(meta))
    return path


def test_import_dense_round_trips(tmp_path):
    ck = checkpoint.import_dense(dense_dir(tmp_path / "d"), tmp_path / "ck", tp=2)
    assert_loads(ck, weights(0))


def test_import_dense_reads_what_export_dense_and_save_model_write(tmp_path):
    ck = checkpoint.write_sharded(tmp_path / "ck", CONFIG, weights(0), 5)
    dense = checkpoint.export_dense(ck, tmp_path / "dense")
    meta = json.loads((dense / "config.json").read_text())
    assert meta["format"] == checkpoint.DENSE_FORMAT == "tpedu-dense-1"
    assert_loads(checkpoint.import_dense(dense, tmp_path / "back"), weights(0))


def _drop(state, key):
    return {k: v for k, v in state.items() if k != key}


@pytest.mark.parametrize(
    "how, message",
    [
        ("hf", r"field 'format' is None, expected 'tpedu-dense-1'.*Hugging Face config"),
        ("no model", r"config.json has no field 'model'"),
        ("bad model", r"field 'model' is not a valid GPTConfig .*hidden_size"),
        ("missing", r"does not hold the tensors .*1 missing: blocks.1.mlp.fc2.weight"),
        ("extra", r"does not hold the tensors .*1 unexpected: lm_head.weight"),
        (
            "shape",
            r"1 with the wrong shape: pos_emb.weight \[4, 16\] \(config.json gives \[8, 16\]\)",
        ),
        ("json", r"config.json is not valid JSON"),
    ],
)
def test_import_dense_names_what_is_wrong(tmp_path, how, message):
    state, meta = weights(0), {"model": CONFIG.to_dict(), "format": "tpedu-dense-1"}
    if how == "hf":
        meta = {"model_type": "gpt2", "vocab_size": 41, "n_layer": 2}
    elif how == "no model":
        del meta["model"]
    elif how == "bad model":
        meta["model"] = {**meta["model"], "hidden_size": 16}
    elif how == "missing":
        state = _drop(state, "blocks.1.mlp.fc2.weight")
    elif how == "extra":
        state = {**state, "lm_head.weight": state["tok_emb.weight"].clone()}
    elif how == "shape":
        state = {**state, "pos_emb.weight": state["pos_emb.weight"][:4].clone()}
    path = dense_dir(tmp_path / "d", state, meta)
    if how == "json":
        (path / "config.json").write_text("{ not json")
    with pytest.raises(CheckpointError, match=message):
        checkpoint.import_dense(path, tmp_path / "ck")
    assert not (tmp_path / "ck" / "latest").exists()  # nothing was written
