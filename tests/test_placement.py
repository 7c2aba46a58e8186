"""Where each parameter lives is declared by the module that creates it (tpedu.comm.placement),
and the shard map, the gradient norm, the reducers and the checkpoint writer read it there."""

import ast
from pathlib import Path

import torch
from torch import nn

from tpedu.comm.collectives import this_rank_alone
from tpedu.comm.placement import (
    Replicate,
    Shard,
    declared,
    placement,
    sharded_on,
    split_over,
)
from tpedu.model.config import GPTConfig
from tpedu.model.dense import DenseGPT
from tpedu.model.gpt import TPGPT
from tpedu.model.state import TP_PLACEMENTS, shard_map
from tpedu.moe.dense import DenseMoE
from tpedu.moe.expert_parallel import ExpertParallelMoE
from tpedu.parallel.mesh import gradient_group

ROOT = Path(__file__).resolve().parent.parent
MOE = GPTConfig.gpt2_like(64, seq_len=8, n_layers=2, hidden=16, n_heads=2, experts=4, top_k=2)


def test_an_undeclared_axis_is_replicate():
    assert placement({}, "ep") == Replicate() and not sharded_on({}, "ep")
    assert sharded_on({"ep": Shard(0)}, "ep") and not sharded_on({"ep": Shard(0)}, "tp")


def test_a_declaration_reaches_its_parameters_and_no_others():
    class Experts(nn.Module):
        placements = {"experts.": {"ep": Shard(0)}, "router.weight": {"tp": Shard(1)}}

        def __init__(self):
            super().__init__()
            self.router = nn.Linear(2, 3)
            self.experts = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
            self.experts_gate = nn.Linear(2, 2)  # a name that starts like the child's: not in it

    model = nn.Sequential(Experts())
    got = declared(model)
    assert got["0.experts.1.weight"] == {"ep": Shard(0)}
    assert got["0.router.weight"] == {"tp": Shard(1)} and got["0.router.bias"] == {}
    assert got["0.experts_gate.weight"] == {}
    assert split_over(model, "ep") == {
        f"0.experts.{i}.{w}" for i in (0, 1) for w in ("weight", "bias")
    }


def test_the_moe_layer_declares_its_experts_split_over_ep_and_the_rest_replicated():
    with this_rank_alone() as group:
        moe = ExpertParallelMoE(DenseMoE(16, 24, 4, 2, shared_expert=True), group)
    split = split_over(moe, "ep")
    assert split == {n for n, _ in moe.named_parameters() if n.startswith("experts.")}
    assert [p for n, p in moe.named_parameters() if n in split] == moe.expert_parameters()
    assert len(moe.replicated_parameters()) == len(list(moe.parameters())) - len(split)


def test_the_shard_map_carries_tp_from_the_kind_and_ep_from_the_moe_layer():
    with this_rank_alone() as group, torch.device("meta"):
        model = TPGPT(DenseGPT(MOE), group)
    entries = shard_map(model)
    assert all(e.placements["tp"] == TP_PLACEMENTS[e.kind] for e in entries)
    on_ep = {e.name for e in entries if sharded_on(e.placements, "ep")}
    assert on_ep == {e.name for e in entries if ".mlp.experts." in e.name}  # the test may look
    assert on_ep and any(".mlp.router." in e.name for e in entries)


def test_no_consumer_decides_where_a_parameter_lives_from_its_name():
    """The reducers, the optimizer's groups, the norm and the checkpoint writer hold no string
    that names a kind of parameter (an expert, a shard): they read placements."""
    consumers = [
        "tpedu/model/gpt.py",
        "tpedu/train/optim.py",
        "tpedu/train/step.py",
        "tpedu/parallel/data_parallel.py",
        "tpedu/parallel/zero.py",
        "tpedu/checkpoint/writer.py",
    ]
    for path in consumers:
        tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
        strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)]
        # a name or a fragment of one ("experts", ".experts."), not prose or a CLI flag
        named = [
            s
            for s in strings
            if isinstance(s, str) and "expert" in s and " " not in s and not s.startswith("--")
        ]
        assert not named, f"{path} matches parameter names: {named}"


def test_the_reducers_groups_follow_the_declaration_not_the_name(monkeypatch):
    """The group each gradient is summed over (what DataParallel and ZeRO bucket by,
    optim.gradient_groups) is what the MoE layer declares: the experts' over edp (with the CP
    ranks: edp_cp), the rest over dp (dp_cp); take the declaration away and every gradient is
    summed over dp_cp."""

    def groups() -> dict[str, str]:
        with this_rank_alone() as group, torch.device("meta"):
            model = TPGPT(DenseGPT(MOE), group)
        return {e.local: gradient_group(e.placements) for e in shard_map(model)}

    named = groups()
    experts = {n for n in named if ".experts." in n}
    assert {n for n, g in named.items() if g == "edp_cp"} == experts
    assert {n for n, g in named.items() if g == "dp_cp"} == set(named) - experts
    monkeypatch.setattr(ExpertParallelMoE, "placements", {})
    assert set(groups().values()) == {"dp_cp"}
