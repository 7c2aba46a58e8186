"""3D training (tp × pp × dp) against one process, step by step; gradient norm over the layout;
saving a pipelined model; bad layouts.

Most runs are float32 like the CLI. Micro-batching, the DP average and the TP all-reduces
reorder sums (≈1e-7 relative each); over 3 AdamW steps the losses and gradient norms stay within
2e-5 relative (the tolerance of tests/test_model.py's tp=1 vs tp=2 training). The losses alone
miss an error that scales the whole gradient (a missing 1/dp): AdamW divides by √v and clipping
rescales, so the updates do not change. The gradient norm does, so it is compared at every step
(eval_every=1 records it in the history). Runs whose saved weights are compared are float64 (F64).
"""

import dataclasses
import json

import pytest
from safetensors.torch import load_file

from tests.helpers import CFG, CONFIG, F64, V, check, data, f64
from tpedu import launch
from tpedu.launcher import RankError
from tpedu.model.config import GPTConfig
from tpedu.parallel.config import ParallelConfig
from tpedu.train.loop import train

UNTIED = GPTConfig.llama_like(V, seq_len=8, n_layers=2, hidden=16, n_heads=2, n_kv_heads=2)


@pytest.fixture(scope="module")
def reference():
    tr, va = data()
    return {c.norm: launch(train, 1, c, CFG, tr, va)[0] for c in (CONFIG, UNTIED)}


def same_weights(a_dir, b_dir, label, rel=F64):
    """The dense weights saved in two model directories, within `rel` of each tensor's max."""
    a, b = (load_file(d / "model.safetensors") for d in (a_dir, b_dir))
    assert set(a) == set(b), label
    for k in a:
        diff = (a[k] - b[k]).abs().max().item()
        assert diff <= rel * b[k].abs().max().item(), f"{label} {k}: max |difference| {diff:.1e}"


def run_3d(layout, config=CONFIG, **kw):
    """train() at layout (tp, pp, dp); kw: the other ParallelConfig fields."""
    tr, va = data()
    parallel = ParallelConfig(*layout, **kw)
    return launch(train, parallel.world, config, CFG, tr, va, parallel=parallel)


def test_3d_2x2x2_matches_one_process(tmp_path):
    """float64: losses, gradient norms and the saved dense weights after 3 steps (F64)."""
    tr, va = data()
    par = ParallelConfig(2, 2, 2)
    results = launch(f64, 8, train, CONFIG, CFG, tr, va, str(tmp_path / "m"), parallel=par)
    ref = launch(f64, 1, train, CONFIG, CFG, tr, va, str(tmp_path / "ref"))[0]
    assert all(r["losses"] == results[0]["losses"] for r in results)  # every rank agrees
    check(results[0], ref, "(2,2,2)", rel=F64)
    assert results[0]["micro_batches"] == 2
    same_weights(tmp_path / "m", tmp_path / "ref", "(2,2,2)")


@pytest.mark.parametrize("layout", [(1, 2, 2), (2, 1, 2), (2, 2, 1)])
def test_smaller_layouts_match_one_process(reference, layout):
    check(run_3d(layout)[0], reference["layernorm"], str(layout))


def test_sequence_parallel_inside_pipeline_stages(reference):
    """SP + PP: each stage runs its blocks on sequence shards and the stages pass [b/m, s/t, H]
    activations; training still equals one process."""
    results = run_3d((2, 2, 1), sequence_parallel=True)
    assert all(r["losses"] == results[0]["losses"] for r in results)
    check(results[0], reference["layernorm"], "(2,2,1) with sequence parallelism")


def test_untied_llama_with_zero1_and_gpipe(reference):
    check(run_3d((1, 2, 2), UNTIED, zero=1, schedule="gpipe")[0], reference["rmsnorm"], "zero1")


def test_bad_layouts_are_clear_errors():
    with pytest.raises(RankError, match="global batch 4 is not divisible by dp=3"):
        run_3d((1, 1, 3))
    with pytest.raises(RankError, match="2 layers cannot be split over 3 stages"):
        run_3d((1, 3, 1))


DEEP = GPTConfig.gpt2_like(V, seq_len=8, n_layers=4, hidden=16, n_heads=2)


def test_interleaved_schedule_matches_one_process(tmp_path):
    """2 chunks per rank on 2 stages (virtual stages 0-3, one block each): training, the gradient
    norm and the gathered dense weights equal one process's (float64); the summary names the
    schedule."""
    tr, va = data()
    ref = launch(f64, 1, train, DEEP, CFG, tr, va, str(tmp_path / "ref"))[0]
    par = ParallelConfig(pp=2, schedule="interleaved", chunks=2)
    results = launch(f64, 2, train, DEEP, CFG, tr, va, str(tmp_path / "m"), parallel=par)
    check(results[0], ref, "interleaved, 2 chunks", rel=F64)
    assert (results[0]["schedule"], results[0]["chunks"], results[0]["micro_batches"]) == (
        "interleaved",
        2,
        4,
    )
    same_weights(tmp_path / "m", tmp_path / "ref", "interleaved")


def test_schedule_errors_name_the_fix():
    """Refused when the ParallelConfig is made, before any rank starts."""
    with pytest.raises(ValueError, match="2 chunks per rank need the 'interleaved' schedule"):
        ParallelConfig(pp=2, chunks=2)
    with pytest.raises(
        ValueError,
        match=r"needs the number of micro-batches \(1\) divisible by the number of stages \(2\)",
    ):
        ParallelConfig(pp=2, schedule="interleaved", chunks=2, micro_batches=1)


def test_interleaved_checkpoint_resumes_at_another_layout(tmp_path):
    """Saved at step 3 by 2 chunks per rank on 2 stages, resumed by one process: the same
    losses as one process training straight through; the index maps layers to their ranks."""
    tr, va = data()
    five = dataclasses.replace(CFG, steps=5, eval_every=5)
    straight = launch(train, 1, DEEP, five, tr, va)[0]
    saving = dataclasses.replace(five, ckpt_dir=str(tmp_path), save_every=3)
    par = ParallelConfig(pp=2, schedule="interleaved", chunks=2)
    launch(train, 2, DEEP, saving, tr, va, parallel=par)
    step3 = str(tmp_path / "step_00000003")
    resumed = launch(train, 1, DEEP, dataclasses.replace(five, resume=step3), tr, va)[0]
    assert resumed["losses"] == pytest.approx(straight["losses"][3:], rel=2e-5)
    index = json.loads((tmp_path / "step_00000003" / "index.json").read_text())
    assert index["layout"]["chunks"] == 2 and index["layout"]["stages"] == [
        [i, i + 1] for i in range(4)
    ]
    stages = [index["tensors"][f"blocks.{i}.attn.qkv.weight"]["stage"] for i in range(4)]
    assert stages == [0, 1, 0, 1], stages  # virtual stage c·pp + s lives on pp rank s


def test_flops_stage_split_trains_like_one_process_and_resumes_anywhere(tmp_path):
    """stage_split="flops": a head worth 10 blocks (vocab 2000, hidden 16) leaves the last stage
    one block ([0:3] [3:4]). Training equals one process (float64); the checkpoint's index
    records the split, and one process resumes from it with the straight run's losses."""
    wide = dataclasses.replace(DEEP, vocab_size=2000)
    tr, va = data()
    five = dataclasses.replace(CFG, steps=5)
    straight = launch(f64, 1, train, wide, five, tr, va, str(tmp_path / "ref"))[0]
    saving = dataclasses.replace(five, ckpt_dir=str(tmp_path), save_every=3)
    flops = ParallelConfig(pp=2, stage_split="flops")
    results = launch(f64, 2, train, wide, saving, tr, va, str(tmp_path / "m"), parallel=flops)
    assert results[0]["stages"] == [[0, 3], [3, 4]]
    check(results[0], straight, "flops split", rel=F64)
    same_weights(tmp_path / "m", tmp_path / "ref", "flops split")  # gathered from the stages
    index = json.loads((tmp_path / "step_00000003" / "index.json").read_text())
    assert index["layout"]["stages"] == [[0, 3], [3, 4]]
    stages = [index["tensors"][f"blocks.{i}.attn.qkv.weight"]["stage"] for i in range(4)]
    assert stages == [0, 0, 0, 1], stages
    assert index["parallel"]["stage_split"] == "flops"
    resume = dataclasses.replace(five, resume=str(tmp_path / "step_00000003"))
    resumed = launch(f64, 1, train, wide, resume, tr, va)[0]  # one process, no split
    assert resumed["losses"] == pytest.approx(straight["losses"][3:], rel=F64)
