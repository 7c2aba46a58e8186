"""Lesson 07: generate text with a trained tensor-parallel GPT, the same ids on every rank.

`generate(config, state, prompt_ids, ...)` builds a TPGPT from a dense state dict and continues
the prompt with tpedu.tp.vocab_parallel's sampler (temperature, top-k), never from one shard's
logits alone. The model runs plain tensor parallelism: what only training needs (sequence
parallelism, recompute, overlap) lives in a ParallelConfig, which generation does not take.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tpedu.checkpoint.convert import load_sharded_model
from tpedu.launcher import device
from tpedu.model.config import GPTConfig
from tpedu.model.gpt import TPGPT
from tpedu.tp.vocab_parallel import sample, vocab_parallel_sample


@torch.no_grad()
def generate(
    config: GPTConfig,
    state: dict[str, torch.Tensor] | str | Path,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int | None = 50,
    seed: int = 0,
) -> list[int]:
    """Continue `prompt_ids` on every rank of the TP group; every rank returns the same ids.

    Sampling never looks at one shard's logits alone (that picks the wrong token): it uses the
    vocab-parallel sampler, with the same generator seed on every rank; the noise comes from a
    CPU generator on every backend, so a tp=1 run on a GPU and a tp=2 run on CPU ranks draw the
    same noise (the text then differs only where the logits' rounding does).
    `state`: the dense state dict (the same on every rank), or a model directory, from which
    each rank reads only its own slices (checkpoint.load_sharded_model).
    """
    if isinstance(state, dict):
        model = TPGPT.from_state_dict(config, state)
    else:
        model = load_sharded_model(state)
    model = model.to(device())
    model.eval()
    gen = torch.Generator().manual_seed(seed)  # CPU noise: the same tokens on CPU and CUDA ranks
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device())
    for _ in range(max_new_tokens):
        logits = model(ids[:, -config.seq_len :])[:, -1]  # [1, Vp/t] (or [1, V] if replicated)
        if config.vocab_parallel:
            nxt = vocab_parallel_sample(logits, config.vocab_size, gen, temperature, top_k)
        else:
            nxt = sample(logits, gen, temperature, top_k)
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0].tolist()
