"""The GPT with context parallelism == the dense GPT, loss and every gradient, float64: cp 2
alone and cp 2 × tp 2, ring and Ulysses, contiguous and zig-zag, GPT-2- (learned positions) and
Llama-style (RoPE, GQA). Each CP rank feeds its positions of the sequence; the loss is the mean
over the whole sequence on every rank."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from tpedu import launch
from tpedu.cp.context import ContextParallel
from tpedu.cp.gradients import sum_over_cp
from tpedu.cp.ring import split_sequence
from tpedu.model import TPGPT, DenseGPT, GPTConfig
from tpedu.model.options import RunOptions

CONFIGS = {
    "gpt2": GPTConfig.gpt2_like(37, seq_len=16, n_layers=2, hidden=16, n_heads=4),
    "llama": GPTConfig.llama_like(37, seq_len=16, n_layers=2, hidden=16, n_heads=4, n_kv_heads=2),
}


def _cp_vs_dense(name: str, tp: int, strategy: str, layout: str, recompute: str = "none"):
    config = CONFIGS[name]
    world, rank = dist.get_world_size(), dist.get_rank()
    cp = world // tp
    # ranks = tp_rank + tp · cp_rank: TP groups are consecutive, as in the mesh
    tp_groups = [dist.new_group(list(range(c * tp, (c + 1) * tp))) for c in range(cp)]
    cp_groups = [dist.new_group(list(range(t, world, tp))) for t in range(tp)]
    tp_group, cp_group = tp_groups[rank // tp], cp_groups[rank % tp]
    cp_rank = dist.get_rank(cp_group)
    torch.manual_seed(0)
    dense = DenseGPT(config).double()
    model = TPGPT(
        dense,
        tp_group,
        options=RunOptions(
            context=ContextParallel(cp_group, strategy, layout), recompute=recompute
        ),
    )
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 37, (2, 16), generator=g)
    tgt = torch.randint(0, 37, (2, 16), generator=g)
    tgt[0, 3] = -100
    want = dense(ids, tgt)
    want.backward()
    mine = [split_sequence(t, cp, cp_rank, layout, dim=1) for t in (ids, tgt)]
    loss = model(*mine)
    loss.backward()
    model.sync_grads()
    sum_over_cp(model.parameters(), cp_group)
    grads = model.gather_state_dict(grads=True)
    ref = {k: p.grad for k, p in dense.named_parameters()}
    worst = max(
        ((grads[k] - ref[k]).abs().max() / ref[k].abs().max().clamp_min(1e-30)).item() for k in ref
    )
    return abs(loss.item() - want.item()) / want.item(), worst


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize(("tp", "world"), [(1, 2), (2, 4), (1, 4)])
@pytest.mark.parametrize("strategy", ["ring", "ulysses"])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_context_parallel_gpt_equals_dense(name, tp, world, strategy, layout):
    cp = world // tp
    if strategy == "ulysses" and (CONFIGS[name].kv_heads // tp) % cp:
        with pytest.raises(Exception, match="Ulysses needs cp to divide"):
            launch(_cp_vs_dense, world, name, tp, strategy, layout)
        return
    for rank, (loss, grad) in enumerate(launch(_cp_vs_dense, world, name, tp, strategy, layout)):
        assert loss < 1e-12 and grad < 1e-10, f"tp={tp} cp={cp} rank {rank}: {loss:.1e} {grad:.1e}"


def test_full_recompute_with_context_parallelism():
    for loss, grad in launch(_cp_vs_dense, 4, "llama", 2, "ring", "zigzag", "full"):
        assert loss < 1e-12 and grad < 1e-10


def _refused():
    g = dist.new_group([0, 1])
    config = GPTConfig.gpt2_like(37, seq_len=16, n_layers=1, hidden=16, n_heads=4, dropout=0.1)
    TPGPT(DenseGPT(config), None, options=RunOptions(context=ContextParallel(g)))


def test_dropout_with_context_parallelism_is_refused():
    with pytest.raises(Exception, match="context parallelism with dropout > 0 is not supported"):
        launch(_refused, 2)


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 37, (600,), generator=g), torch.randint(0, 37, (200,), generator=g)


def _f64_train(*args, **kwargs):
    from tpedu.train.loop import train

    torch.set_default_dtype(torch.float64)
    return train(*args, **kwargs)


def test_training_with_context_parallelism_equals_one_process(tmp_path):
    """train() at cp 2 (zig-zag) and cp 2 × tp 2 (contiguous): the same losses and
    gradient norms as one process, step by step (float64); the checkpoint it writes (CP rank
    0 only, like a DP replica) resumes in one process with the straight run's losses."""
    from tpedu.parallel.config import ParallelConfig
    from tpedu.train.config import TrainConfig

    config = CONFIGS["llama"]
    cfg = TrainConfig(
        steps=4, batch=4, lr=1e-2, warmup=1, eval_every=1, eval_batches=1, progress=False
    )
    tr, va = _data()
    ref = launch(_f64_train, 1, config, cfg, tr, va)[0]
    for parallel in (ParallelConfig(cp=2), ParallelConfig(tp=2, cp=2, cp_layout="contiguous")):
        saving = dataclasses.replace(cfg, ckpt_dir=str(tmp_path / f"ck{parallel.tp}"), save_every=2)
        got = launch(_f64_train, parallel.world, config, saving, tr, va, parallel=parallel)[0]
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-10), parallel
        for h, r in zip(got["history"], ref["history"], strict=True):
            assert h["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-10)
            assert h["val_loss"] == pytest.approx(r["val_loss"], rel=1e-10)
        step2 = tmp_path / f"ck{parallel.tp}" / "step_00000002"
        files = sorted(p.name for p in step2.glob("*.safetensors"))
        assert files == [f"tp{t}-pp0-dp0.safetensors" for t in range(parallel.tp)]
        resume = dataclasses.replace(cfg, resume=str(step2))
        again = launch(_f64_train, 1, config, resume, tr, va)[0]
        assert again["losses"] == pytest.approx(ref["losses"][2:], rel=1e-10)


def test_parallel_config_refuses_what_cp_cannot_run_yet():
    from tpedu.parallel.config import ParallelConfig

    with pytest.raises(ValueError, match="with sequence parallelism is not supported yet"):
        ParallelConfig(tp=2, cp=2, sequence_parallel=True).check(CONFIGS["gpt2"])
    with pytest.raises(ValueError, match="sequence length 12 is not divisible by 8"):
        ParallelConfig(cp=4).check(dataclasses.replace(CONFIGS["gpt2"], seq_len=12))
    with pytest.raises(ValueError, match="dropout > 0 is not supported"):
        ParallelConfig(cp=2).check(dataclasses.replace(CONFIGS["gpt2"], dropout=0.1))
