"""Checkpoints and model directories written by tpedu 0.1 (tests/data/v0_1: a 2-layer Llama-style
model at tp 2, one AdamW step) still load: a learner's saved work is never stranded."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tpedu import checkpoint, launch
from tpedu.model import TPGPT, DenseGPT

DATA = Path(__file__).parent / "data" / "v0_1"


def _load(tp_dir: str) -> dict[str, torch.Tensor]:
    config = checkpoint.read_config(tp_dir)
    model = TPGPT(DenseGPT(config))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    index = checkpoint.load(tp_dir, model, opt)
    assert index["step"] == 1
    assert all(len(s) == 3 for s in opt.state.values())  # step, exp_avg, exp_avg_sq
    return model.gather_state_dict()


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_a_v0_1_checkpoint_loads_at_any_tp_and_equals_its_model_directory(tp):
    config, dense = checkpoint.read_model_dir(DATA / "model")
    assert config.n_kv_heads == 2 and not hasattr(config, "extra")
    got = launch(_load, tp, str(DATA / "ckpt"))[0]
    assert set(got) == set(dense)
    for name, t in dense.items():
        assert torch.equal(got[name], t), name


def test_a_v0_1_checkpoint_reshards_offline(tmp_path):
    out = checkpoint.reshard(DATA / "ckpt", tmp_path / "tp4", tp=4)
    _, tensors, _ = checkpoint.read_dense(out)
    _, before, _ = checkpoint.read_dense(DATA / "ckpt")
    assert set(tensors) == set(before)
    assert all(torch.equal(tensors[k], before[k]) for k in before)


def test_a_v0_1_index_gives_its_parallel_config_and_a_reshard_writes_the_new_format(tmp_path):
    """tpedu 0.1 kept the run-time fields inside "model": read_parallel takes them from there
    and from the layout; a reshard stores them apart, under the new format."""
    old = checkpoint.read_parallel(DATA / "ckpt")
    assert (old.tp, old.pp, old.dp, old.zero, old.chunks) == (2, 1, 1, 0, 1)
    assert (old.sequence_parallel, old.recompute, old.stage_split) == (False, "none", "even")
    out = checkpoint.reshard(DATA / "ckpt", tmp_path / "tp4", tp=4)
    _, index = checkpoint.read_index(out)
    assert index["format"] == checkpoint.FORMAT == "tpedu-sharded-2"
    assert "sequence_parallel" not in index["model"] and "stage_split" not in index["model"]
    assert checkpoint.read_parallel(out) == dataclasses.replace(old, tp=4)
