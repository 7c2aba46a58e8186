"""Context parallelism inside the mesh: CP × DP, CP × PP, TP × CP × DP (and with ZeRO-3) train
like one process, step by step (float64, tolerance F64 as tests/test_train_3d.py argues); a
checkpoint saved at cp 2 resumes at cp 1; the mesh's groups and rank order."""

import dataclasses

import pytest

from tests.helpers import CFG, F64, V, check, data, f64
from tpedu import launch
from tpedu.model.config import GPTConfig
from tpedu.parallel.config import ParallelConfig
from tpedu.parallel.mesh import Layout
from tpedu.train.loop import train

# seq 8 splits into 2·cp = 4 zig-zag chunks at cp 2; Llama-style: RoPE at each chunk's positions
GPT2 = GPTConfig.gpt2_like(V, seq_len=8, n_layers=2, hidden=16, n_heads=2)
LLAMA = GPTConfig.llama_like(V, seq_len=8, n_layers=2, hidden=16, n_heads=2, n_kv_heads=1)


@pytest.fixture(scope="module")
def one_process():
    tr, va = data()
    return {c.norm: launch(f64, 1, train, c, CFG, tr, va)[0] for c in (GPT2, LLAMA)}


def run(config, cfg=CFG, **kw):
    tr, va = data()
    parallel = ParallelConfig(**kw)
    return launch(f64, parallel.world, train, config, cfg, tr, va, parallel=parallel)


@pytest.mark.parametrize(
    "config, kw",
    [
        (GPT2, {"cp": 2, "dp": 2}),
        (GPT2, {"cp": 2, "pp": 2}),
        (GPT2, {"cp": 2, "dp": 2, "cp_strategy": "ulysses", "cp_layout": "contiguous"}),
        (LLAMA, {"tp": 2, "cp": 2, "dp": 2, "zero": 3}),
    ],
    ids=["cp2-dp2", "cp2-pp2", "ulysses-cp2-dp2", "tp2-cp2-dp2-zero3"],
)
def test_context_parallel_in_the_mesh_trains_like_one_process(one_process, config, kw):
    results = run(config, **kw)
    assert all(r["losses"] == results[0]["losses"] for r in results)
    check(results[0], one_process[config.norm], str(kw), rel=F64)
    assert results[0]["cp"] == kw["cp"]


def test_checkpoint_saved_with_cp_resumes_without(tmp_path):
    """CP does not change the stored tensors: saved at cp 2 × dp 2 (only CP rank 0 of each
    replica writes: the files are named by tp, pp, dp; the two replicas share the writing),
    resumed by one process like the straight run."""
    five = dataclasses.replace(CFG, steps=5, eval_every=5)
    straight = run(GPT2, five)[0]["losses"]
    run(GPT2, dataclasses.replace(five, ckpt_dir=str(tmp_path), save_every=3), cp=2, dp=2)
    resumed = run(GPT2, dataclasses.replace(five, resume=str(tmp_path / "step_00000003")))
    assert resumed[0]["losses"] == pytest.approx(straight[3:], rel=F64)
    files = sorted(p.name for p in (tmp_path / "step_00000003").glob("*.safetensors"))
    assert files == ["tp0-pp0-dp0.safetensors", "tp0-pp0-dp1.safetensors"]


def test_mesh_order_is_tp_then_cp_then_pp_then_dp():
    lay = Layout(tp=2, pp=2, dp=2, cp=2)
    assert lay.world == 16
    assert lay.axis_groups("tp")[0] == [0, 1] and lay.axis_groups("cp")[0] == [0, 2]
    assert lay.axis_groups("pp")[0] == [0, 4] and lay.axis_groups("dp")[0] == [0, 8]
    assert lay.coords(13) == {"tp": 1, "cp": 0, "pp": 1, "dp": 1}  # 13 = 1 + 2·(0 + 2·(1 + 2·1))
    for r in range(16):
        assert lay.rank(**lay.coords(r)) == r
    assert lay.group_names() == ("tp", "cp", "pp", "dp", "emb", "dp_cp")
    assert Layout(2, 2, 2).groups() == {  # cp = 1: the 3D mesh as before
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "pp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "emb": [[0, 2], [1, 3], [4, 6], [5, 7]],
    }
