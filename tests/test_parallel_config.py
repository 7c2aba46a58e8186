"""ParallelConfig: how a model runs, apart from what it is. Each field is refused by name when
it cannot be run; `check(config)` refuses a model the layout cannot hold; a checkpoint stores it
beside the model config and loads under any other ParallelConfig."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tpedu import checkpoint, launch
from tpedu.cp.context import ContextParallel
from tpedu.model import TPGPT, DenseGPT, GPTConfig
from tpedu.model.options import RunOptions
from tpedu.parallel.config import ParallelConfig

CONFIG = GPTConfig.gpt2_like(37, seq_len=12, n_layers=2, hidden=16, n_heads=4)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tp": 0}, "tp must be a positive integer"),
        ({"schedule": "zigzag"}, "schedule must be one of"),
        ({"stage_split": "fast"}, "stage_split must be one of"),
        ({"recompute": "half"}, "recompute must be one of"),
        ({"zero": 4}, "zero must be one of"),
        ({"micro_batches": 0}, "micro_batches must be at least 1"),
        ({"pp": 2, "chunks": 2}, "need the 'interleaved' schedule"),
    ],
)
def test_bad_fields_are_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**fields)


def test_check_refuses_what_the_model_cannot_run():
    with pytest.raises(ValueError, match="4 heads are not divisible by tp=3"):
        ParallelConfig(tp=3).check(CONFIG)
    with pytest.raises(ValueError, match="2 layers cannot be split over 3 stages"):
        ParallelConfig(pp=3).check(CONFIG)
    with pytest.raises(ValueError, match="2 layers cannot be split over 4 stages"):
        ParallelConfig(pp=2, schedule="interleaved", chunks=2).check(CONFIG)
    with pytest.raises(ValueError, match="s = 10 is not divisible by tp=4"):
        ParallelConfig(tp=4, sequence_parallel=True).check(dataclasses.replace(CONFIG, seq_len=10))
    ParallelConfig(tp=4, pp=2, sequence_parallel=True).check(CONFIG)  # fine


def test_the_round_trip():
    p = ParallelConfig(2, 2, 2, schedule="gpipe", zero=1, overlap_comm=True)
    assert ParallelConfig.from_dict(p.to_dict()) == p
    assert p.world == 8 and p.layout.world == 8
    assert p.model_options() == RunOptions(overlap_comm=True)  # no mesh: no CP group
    cp = ParallelConfig(2, cp=2, cp_layout="contiguous", recompute="full").model_options()
    assert cp == RunOptions(recompute="full") and cp.context is None
    with pytest.raises(ValueError, match="cp_strategy must be one of"):
        ContextParallel(None, strategy="star")
    with pytest.raises(ValueError, match="cp_layout must be one of"):
        ContextParallel(None, layout="spiral")
    with pytest.raises(ValueError, match=r"unknown ParallelConfig fields \['tensor'\]"):
        ParallelConfig.from_dict({"tensor": 2})


def test_the_model_config_holds_no_run_time_field():
    """What changes with the layout is not part of what the model is."""
    names = {f.name for f in dataclasses.fields(GPTConfig)}
    run_time = {f.name for f in dataclasses.fields(ParallelConfig)}
    assert not names & run_time, names & run_time
    assert not names & {"fused_attention", "extra"}


def _save_sp(root: str) -> None:
    torch.manual_seed(0)
    parallel = ParallelConfig(tp=2, sequence_parallel=True, recompute="selective")
    model = TPGPT(DenseGPT(CONFIG), options=parallel.model_options())
    checkpoint.save(root, model, None, 3, parallel=parallel)


def _load_plain(root: str) -> dict[str, torch.Tensor]:
    model = TPGPT(DenseGPT(CONFIG))  # no sequence parallelism, no recompute, another tp
    checkpoint.load(root, model)
    return model.gather_state_dict()


def test_a_checkpoint_stores_its_parallel_config_and_loads_under_another(tmp_path):
    launch(_save_sp, 2, str(tmp_path))
    saved = checkpoint.read_parallel(tmp_path)
    assert saved == ParallelConfig(tp=2, sequence_parallel=True, recompute="selective")
    _, index = checkpoint.read_index(tmp_path)
    assert index["model"] == CONFIG.to_dict() and index["parallel"] == saved.to_dict()
    torch.manual_seed(0)
    want = DenseGPT(CONFIG).state_dict()
    for got in launch(_load_plain, 4, str(tmp_path)) + launch(_load_plain, 1, str(tmp_path)):
        assert all(torch.equal(got[k], want[k]) for k in want)


def _save_mismatched(root: str) -> None:
    checkpoint.save(root, TPGPT(DenseGPT(CONFIG)), None, 1, parallel=ParallelConfig(tp=4))


def test_save_refuses_a_parallel_config_that_is_not_the_models(tmp_path):
    with pytest.raises(
        Exception,
        match=r"parallel says Layout\(tp=4, .* the ranks run Layout\(tp=2, pp=1, dp=1, cp=1\)",
    ):
        launch(_save_mismatched, 2, str(tmp_path))


def test_a_dense_export_needs_every_expert_on_one_rank():
    """train's `out` (--out) at ep > 1 is refused before anything is built, naming the fix."""
    ParallelConfig(dp=2).check_dense_export()
    with pytest.raises(ValueError, match=r"^ep = 2: .*tpedu reshard CKPT --to dense --out DIR"):
        ParallelConfig(dp=2, ep=2).check_dense_export()
