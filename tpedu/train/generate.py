"""Lesson 07: generate text with a trained tensor-parallel GPT, the same ids on every rank.

`generate(config, state, prompt_ids, ...)` builds a TPGPT from a dense state dict and continues
the prompt with tpedu.vocab_parallel's sampler (temperature, top-k, or greedy: a
tpedu.serve.generate.Sampling), never from one shard's logits alone. By default it keeps a KV
cache sharded by heads (tpedu.serve): each new token costs one forward of that token only.
`use_cache=False` reruns the whole window for every token instead, sliding it once the text is
longer than the context. `generate_prompts` does the same for several prompts at once. The
model runs plain tensor parallelism: what only training needs (sequence parallelism, recompute,
overlap) lives in a ParallelConfig, which generation does not take.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from tpedu.checkpoint.convert import load_sharded_model
from tpedu.comm.device import device
from tpedu.model.config import GPTConfig
from tpedu.model.gpt import TPGPT
from tpedu.serve.generate import Sampling, generate_batch


def load_for_generation(config: GPTConfig, state: dict[str, torch.Tensor] | str | Path) -> TPGPT:
    """This rank's TPGPT on its device, in eval mode. `state`: the dense state dict (the same on
    every rank), or a model directory, from which each rank reads only its own slices
    (checkpoint.load_sharded_model)."""
    if isinstance(state, dict):
        model = TPGPT.from_state_dict(config, state)
    else:
        model = load_sharded_model(state)
    return model.to(device()).eval()


@torch.no_grad()
def generate_prompts(
    config: GPTConfig,
    state: dict[str, torch.Tensor] | str | Path,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    use_cache: bool = True,
    stop_token: int | None = None,
) -> list[list[int]]:
    """Continue every prompt, as one batch (tpedu.serve.generate.generate_batch); every rank
    returns the same lists, each prompt followed by its new tokens."""
    model = load_for_generation(config, state)
    return generate_batch(
        model, prompts, max_new_tokens, sampling, stop_tokens=stop_token, use_cache=use_cache
    )


def generate(
    config: GPTConfig,
    state: dict[str, torch.Tensor] | str | Path,
    prompt_ids: list[int],
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    use_cache: bool = True,
) -> list[int]:
    """Continue `prompt_ids` on every rank of the TP group; every rank returns the same ids.

    Sampling never looks at one shard's logits alone (that picks the wrong token): it uses the
    vocab-parallel sampler, with the same `sampling` (its seed) on every rank; the noise comes
    from a CPU generator on every backend, so a tp=1 run on a GPU and a tp=2 run on CPU ranks
    draw the same noise (the text then differs only where the logits' rounding does). With the cache
    (default) the prompt plus the new tokens must fit the context length config.seq_len.
    """
    return generate_prompts(config, state, [prompt_ids], max_new_tokens, sampling, use_cache)[0]
