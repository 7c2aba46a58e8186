"""Lesson 07: a trained run's dense model directory (`train --out`), gathered on rank 0.

Saved models are a directory: `config.json` (model + training settings), `tokenizer.json`, and
`model.safetensors` with the *dense* state dict, written atomically (temporary directory, then
rename). Sharded, reshardable checkpoints are lesson 14 (tpedu.checkpoint).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from tpedu.checkpoint.convert import write_model_dir
from tpedu.comm import collectives
from tpedu.comm.device import device
from tpedu.model.config import GPTConfig
from tpedu.model.dense import DenseGPT
from tpedu.model.gpt import TPGPT
from tpedu.parallel.mesh import Mesh
from tpedu.parallel.pipeline.schedules import stage_layers, stage_of
from tpedu.train.config import TrainConfig


def gather_pipeline_state(
    chunks: Sequence[TPGPT], mesh: Mesh, split: str = "even"
) -> dict[str, torch.Tensor]:
    """The whole dense state dict on global rank 0 (others: their stage's part). Collective.

    `chunks`: this rank's TPGPT chunks, cut with stage split `split`. Each stage gathers its TP
    shards; then tp_rank 0 of replica 0 of every later stage sends its tensors to rank 0
    (sorted by name, blocking send/recv: only rank 0 receives, so no cycle).
    """
    state = {k: v for chunk in chunks for k, v in chunk.gather_state_dict().items()}
    if mesh.tp_rank or mesh.dp_rank or mesh.layout.pp == 1:
        return state
    if mesh.pp_rank > 0:
        for name in sorted(state):
            collectives.send(state[name].contiguous(), 0, mesh.pp_group)
        return state
    config, pp = chunks[0].config, mesh.layout.pp
    stages = stage_layers(config, pp * len(chunks), split)
    with torch.device("meta"):
        shapes = DenseGPT(config).state_dict()
    for s in range(1, pp):
        src = mesh.members["pp"][s]
        for name in sorted(n for n in shapes if stage_of(n, stages, pp) == s):
            buf = torch.empty(
                shapes[name].shape, dtype=state["tok_emb.weight"].dtype, device=device()
            )
            state[name] = collectives.recv(buf, src, mesh.pp_group)
    return state


def write_dense(
    state: dict[str, torch.Tensor],
    config: GPTConfig,
    cfg: TrainConfig,
    out: str | Path,
    tok: object | None,
) -> None:
    """Rank 0 writes the gathered dense state as a model directory (`train --out`)."""
    if dist.get_rank() == 0:
        write_model_dir(out, config, state, asdict(cfg), tok)
