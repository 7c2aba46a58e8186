"""Lesson 14: the plan, how every dense tensor is split over TP, read from the TP modules.

Each tensor-parallel module says how it splits its parameters (its class's `shard_kinds`), and
a live model's shard map reads them there (tpedu.model.state). Without a live model (offline
resharding, or filling shards from a file), `param_kinds` builds this config's TPGPT on the
meta device, this process alone at tp 1 (no memory, no communication), and reads the same:

    tok_emb.weight            vocab (replicated when config.vocab_parallel is False)
    blocks.i.attn.qkv.*       qkv       blocks.i.attn.out.weight   row   (.bias replicated)
    blocks.i.mlp.fc1.*, up.*  column    blocks.i.mlp.fc2.weight    row   (.bias replicated)
    lm_head.weight            vocab     everything else            replicated

so changing how a module splits changes the plan, and nothing else has to follow.
"""

from __future__ import annotations

import torch

from tpedu.comm.collectives import this_rank_alone
from tpedu.model.config import GPTConfig
from tpedu.model.dense import DenseGPT
from tpedu.model.gpt import TPGPT
from tpedu.model.state import shard_map

_KINDS: dict[str, dict[str, str]] = {}  # repr(config) -> its plan: built once per config


def param_kinds(config: GPTConfig) -> dict[str, str]:
    """{DenseGPT state-dict key: its stored kind} for `config`, read off a meta-device TPGPT.
    Stored kinds only: "sequence" is a run-time choice the shard map marks on a live model."""
    key = repr(config)
    if key not in _KINDS:
        with this_rank_alone() as group, torch.device("meta"):
            model = TPGPT(DenseGPT(config), group)
        _KINDS[key] = {e.name: e.stored_kind for e in shard_map(model)}
    return _KINDS[key]


def param_kind(name: str, config: GPTConfig) -> str:
    """How the dense tensor `name` (a DenseGPT state-dict key) is split over TP ("replicated"
    for a name the model does not have)."""
    return param_kinds(config).get(name, "replicated")
