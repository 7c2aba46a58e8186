"""The shard map (tpedu/model/state.py): every parameter's dense name, kind and replica count."""

from __future__ import annotations

import pytest
import torch

from tpedu import launch
from tpedu.model.config import GPTConfig
from tpedu.model.dense import DenseGPT
from tpedu.model.gpt import TPGPT
from tpedu.model.options import RunOptions
from tpedu.model.plan import param_kind
from tpedu.model.state import shard_map, split_tensor

GPT2 = GPTConfig.gpt2_like(37, seq_len=8, n_layers=2, hidden=16, n_heads=4)
# n_kv_heads=1: at tp 2 and 4 every rank holds a replica of the one KV head
LLAMA = GPTConfig.llama_like(37, seq_len=8, n_layers=2, hidden=16, n_heads=4, n_kv_heads=1)

# What the plan says, written out by hand (block 0; block 1 is the same)
KINDS = {
    "gpt2": {
        "tok_emb.weight": "vocab",
        "pos_emb.weight": "replicated",
        "blocks.0.norm1.weight": "replicated",
        "blocks.0.norm1.bias": "replicated",
        "blocks.0.attn.qkv.weight": "qkv",
        "blocks.0.attn.qkv.bias": "qkv",
        "blocks.0.attn.out.weight": "row",
        "blocks.0.attn.out.bias": "replicated",
        "blocks.0.mlp.fc1.weight": "column",
        "blocks.0.mlp.fc1.bias": "column",
        "blocks.0.mlp.fc2.weight": "row",
        "blocks.0.mlp.fc2.bias": "replicated",
        "norm_f.weight": "replicated",
    },
    "llama": {
        "tok_emb.weight": "vocab",
        "blocks.0.norm1.weight": "replicated",
        "blocks.0.attn.qkv.weight": "qkv",
        "blocks.0.attn.out.weight": "row",
        "blocks.0.mlp.fc1.weight": "column",
        "blocks.0.mlp.up.weight": "column",
        "blocks.0.mlp.fc2.weight": "row",
        "norm_f.weight": "replicated",
        "lm_head.weight": "vocab",
    },
}


def _walk(config: GPTConfig, pp: int, sequence_parallel: bool) -> list[tuple]:
    """(dense name, kind, is tied copy, Σ 1/copies over this rank's elements, shard ok) on every
    stage this rank's TP group holds; pp stages are built one after the other on the same ranks."""
    import torch.distributed as dist

    from tpedu.parallel.pipeline.schedules import stage_layers

    torch.manual_seed(0)
    dense = DenseGPT(config)
    state = dense.state_dict()
    tp, rank = dist.get_world_size(), dist.get_rank()
    out = []
    for layers in stage_layers(config, pp):
        model = TPGPT(dense, layers=layers, options=RunOptions(sequence_parallel=sequence_parallel))
        for e in shard_map(model):
            mine = split_tensor(state[e.name], e.stored_kind, tp, rank, config)
            same = mine.shape == e.param.shape and torch.equal(mine, e.param.detach())
            share = (torch.ones_like(e.param, dtype=torch.float64) / e.copies).sum().item()
            out.append((e.name, e.kind, e.tied_copy, share, same))
    return out


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_every_parameter_has_its_kind_shard_and_replica_count(style, pp, tp):
    config = GPT2 if style == "gpt2" else LLAMA
    ranks = launch(_walk, tp, config, pp, False)
    names = [r[0] for r in ranks[0]]
    dense = {k: v.numel() for k, v in DenseGPT(config).state_dict().items()}
    # every dense tensor once (tied tables: the last stage's copy is marked, not a new name)
    assert sorted(n for n, _, tied, _, _ in ranks[0] if not tied) == sorted(dense)
    for name, kind in KINDS[style].items():
        assert dict((r[0], r[1]) for r in ranks[0] if not r[2])[name] == kind, name
    for i, name in enumerate(names):
        assert all(r[i][4] for r in ranks), f"{name}: a rank's shard is not split_tensor's"
        if ranks[0][i][2]:
            continue
        counted = sum(r[i][3] for r in ranks)  # each element counted exactly once over TP
        want = dense[name]
        if ranks[0][i][1] == "vocab":  # + the zero rows that pad V to a multiple of tp
            want += (-(-config.vocab_size // tp) * tp - config.vocab_size) * config.hidden
        assert counted == pytest.approx(want, rel=1e-12), name


def test_sequence_parallel_marks_the_replicated_parameters_fed_sequence_shards():
    ranks = launch(_walk, 2, GPT2, 1, True)
    kinds = {name: kind for name, kind, *_ in ranks[0]}
    for name in (
        "pos_emb.weight",
        "blocks.0.norm1.weight",
        "blocks.0.attn.out.bias",
        "blocks.1.mlp.fc2.bias",
        "norm_f.bias",
    ):
        assert kinds[name] == "sequence", name
    assert kinds["blocks.0.mlp.fc1.bias"] == "column"
    assert param_kind("blocks.0.norm1.weight", GPT2) == "replicated"  # stored as it is


def test_kv_heads_replicated_over_tp_count_once_in_the_gradient_norm():
    # tp 4 > n_kv_heads 1: the k, v rows of the fused QKV weight sit on all 4 ranks
    ranks = launch(_walk, 4, LLAMA, 1, False)
    i = [r[0] for r in ranks[0]].index("blocks.0.attn.qkv.weight")
    rows_q, rows_kv, h = 4 // 4 * 4, 2 * 4, 16  # head_dim 4: 1 q head and 1 k, 1 v head per rank
    assert ranks[0][i][3] == pytest.approx((rows_q + rows_kv / 4) * h)


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_the_offline_plan_is_read_from_the_modules(style, monkeypatch):
    """param_kinds (no live model, no process group) gives the hand-written table; a module
    that splits differently changes it: the modules are the one source."""
    from tpedu.comm.collectives import this_rank_alone
    from tpedu.model import plan
    from tpedu.tp.layers import ColumnParallelLinear

    config = GPT2 if style == "gpt2" else LLAMA
    kinds = plan.param_kinds(config)
    assert sorted(kinds) == sorted(DenseGPT(config).state_dict())  # TPGPT names are DenseGPT's
    assert {n: kinds[n] for n in KINDS[style]} == KINDS[style]
    with this_rank_alone() as group:
        names = list(TPGPT(DenseGPT(config), group).state_dict())
    assert names == list(DenseGPT(config).state_dict())
    monkeypatch.setattr(plan, "_KINDS", {})
    monkeypatch.setattr(ColumnParallelLinear, "shard_kinds", {"weight": "row", "bias": "row"})
    assert plan.param_kind("blocks.0.mlp.fc1.weight", config) == "row"
