"""Lesson 17: batched generation with a KV cache: prefill every prompt at once, then decode one token per
sequence per step, on every rank of the TP group (the same ids everywhere).

    prefill      prompts, right-padded into [b, s]: one forward fills the cache and gives each
                 sequence's logits at its last prompt token
    decode_step  the b newest tokens [b] -> logits [b, Vp/t]: one forward of b tokens
    stream       a generator: yields {sequence: new token} after every step (a live view)
    generate_batch  the finished sequences, prompt + continuation
    Sampling     how each next token is chosen (temperature, top_k, greedy, seed): stream's,
                 generate_batch's and tpedu.train.generate's

Sequences of different lengths keep their own lengths in the cache (no left padding): slot j
holds position j, so every sequence sees exactly the positions and keys it would alone, and a
batch gives each sequence the tokens it would get by itself (greedy: the same tokens; logits
equal up to the order of floating-point sums). Left padding would need position ids shifted per
sequence and a mask over the pads in every step; per-sequence lengths need neither. Finished
sequences (stop token or their own max_new_tokens) leave the batch and the cache.

Tokens come from the vocab-parallel sampler (tpedu.tp.vocab_parallel), never from one shard's
logits: greedy decoding is `vocab_parallel_argmax`, sampling is Gumbel-max with noise for the
whole vocabulary from one CPU generator seeded the same on every rank.

Communication per decode step of b sequences (vocab-parallel model, tp > 1):
    embedding      1 all-reduce of b·H
    each block     2 all-reduces of b·H (attention out-projection, MLP fc2)
    sampler        2 all-gathers of b·t elements (each rank's best value and id); top_k adds
                   1 all-gather of b·k·t
and the prefill is the same forward with b·s·H per all-reduce (s: the longest prompt). The
cache itself never moves: each rank attends over its own heads' keys and values.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields

import torch

from tpedu.model.gpt import TPGPT
from tpedu.tp.kv_cache import KVCache
from tpedu.tp.vocab_parallel import sample, vocab_parallel_sample


@dataclass(frozen=True)
class Sampling:
    """How each next token is chosen, the same on every rank. greedy=True (or temperature 0):
    the argmax; otherwise Gumbel-max sampling at `temperature` among the `top_k` largest logits
    (None: all), its noise from a CPU generator seeded with `seed`."""

    temperature: float = 0.8
    top_k: int | None = 50
    greedy: bool = False
    seed: int = 0

    @classmethod
    def from_dict(cls, recorded: object, where: str = "sampling") -> Sampling:
        """The Sampling a `dataclasses.asdict` record describes. An unknown key (a typo, a
        field Sampling lacks) is refused, not dropped: the settings would differ from the
        record's. A ValueError naming it and `where` the record came from."""
        known = [f.name for f in fields(cls)]
        unknown = [k for k in recorded if k not in known] if isinstance(recorded, dict) else [""]
        if unknown:
            raise ValueError(
                f"{where} has an unknown key {unknown[0]!r}: record "
                f"dataclasses.asdict(Sampling(...)), whose keys are {', '.join(known)}"
            )
        return cls(**recorded)


def pad_right(
    seqs: Sequence[Sequence[int]], device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [b, s_max] right-padded with 0, lengths [b]). Causal attention keeps the padding,
    which comes after every real token, out of the real tokens' results."""
    lengths = torch.tensor([len(q) for q in seqs], dtype=torch.int64)
    ids = torch.zeros(len(seqs), int(lengths.max()), dtype=torch.int64)
    for i, q in enumerate(seqs):
        ids[i, : len(q)] = torch.tensor(q, dtype=torch.int64)
    return ids.to(device), lengths.to(device)


def _last(logits: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """logits [b, s, V'] -> [b, V'] at each sequence's last real token."""
    return logits[torch.arange(logits.shape[0], device=logits.device), lengths - 1]


@torch.no_grad()
def prefill(model: TPGPT, cache: KVCache, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
    """Run every prompt through the model into an empty `cache` (one forward of the right-padded
    [b, s_max] batch); returns the logits at each prompt's last token: [b, Vp/t] when
    vocab-parallel, else [b, V]. Communication: the forward's, 2·layers (+1) all-reduces of
    b·s_max·H."""
    ids, lengths = pad_right(prompts, cache.lengths.device)
    logits = model(ids, cache=cache)
    cache.truncate(lengths)  # the padding's slots are free: the next tokens overwrite them
    return _last(logits, lengths)


@torch.no_grad()
def decode_step(model: TPGPT, cache: KVCache, tokens: torch.Tensor) -> torch.Tensor:
    """Each sequence's newest token, tokens [b], through the model at its next position;
    returns the logits [b, Vp/t] (or [b, V]). Communication: 2·layers (+1) all-reduces of b·H."""
    return model(tokens.view(-1, 1), cache=cache)[:, 0]


@torch.no_grad()
def recompute_logits(model: TPGPT, seqs: Sequence[Sequence[int]]) -> torch.Tensor:
    """Without a cache: every sequence's last seq_len tokens through the model again (a window
    that slides once a sequence is longer than the context); logits at each one's last token."""
    window = [q[-model.config.seq_len :] for q in seqs]
    ids, lengths = pad_right(window, next(model.parameters()).device)
    return _last(model(ids), lengths)


def pick(
    model: TPGPT,
    logits: torch.Tensor,
    generator: torch.Generator,
    temperature: float = 0.8,
    top_k: int | None = 50,
) -> torch.Tensor:
    """Next tokens [b] from logits [b, Vp/t] (vocab-parallel: the sampler's all-gathers) or
    [b, V]; temperature 0 is greedy (the global argmax, never a shard's)."""
    if model.config.vocab_parallel:
        return vocab_parallel_sample(
            logits, model.config.vocab_size, generator, temperature, top_k, model.group
        )
    return sample(logits, generator, temperature, top_k)


def _per_sequence(value: object, b: int, name: str) -> list:
    """One value for each of b sequences from a scalar or a list of b."""
    if isinstance(value, (list, tuple)):
        if len(value) != b:
            raise ValueError(
                f"{name} has {len(value)} entries for {b} prompts: give one per prompt"
            )
        return list(value)
    return [value] * b


def check_request(
    model: TPGPT,
    prompts: Sequence[Sequence[int]],
    max_new: list[int],
    sampling: Sampling,
    use_cache: bool,
) -> None:
    """ValueErrors naming the problem and the fix, before anything runs."""
    vocab, seq_len = model.config.vocab_size, model.config.seq_len
    temperature, top_k = sampling.temperature, sampling.top_k
    if not prompts:
        raise ValueError("no prompts: give at least one list of token ids")
    for i, q in enumerate(prompts):
        if len(q) == 0:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        if min(q) < 0 or max(q) >= vocab:
            raise ValueError(f"prompt {i} has token ids outside [0, vocab_size = {vocab})")
    if any(not isinstance(m, int) or m < 0 for m in max_new):
        raise ValueError(f"max_new_tokens must be integers >= 0, got {max_new}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
    if not use_cache:
        return
    for i, (q, m) in enumerate(zip(prompts, max_new, strict=True)):
        if len(q) + m > seq_len:
            raise ValueError(
                f"prompt {i} has {len(q)} tokens + max_new_tokens {m} = {len(q) + m}, more than "
                f"the model's context length seq_len = {seq_len}: ask for at most "
                f"{max(0, seq_len - len(q))} new tokens, or use_cache=False (--no-cache), which "
                f"recomputes a window sliding over the last {seq_len} tokens"
            )


@torch.no_grad()
def stream(
    model: TPGPT,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int | Sequence[int] = 100,
    sampling: Sampling = Sampling(),
    *,
    stop_tokens: int | None | Sequence[int | None] = None,
    use_cache: bool = True,
) -> Iterator[dict[int, int]]:
    """Generate for every prompt at once; after each step yield {prompt index: its new token}
    for the sequences still running (a live view, e.g. a notebook widget).

    max_new_tokens and stop_tokens: one for all, or one per prompt; a sequence stops after its
    stop token (which it keeps) or its max_new_tokens. `sampling`: how each token is chosen;
    the same Sampling (its seed) on every rank gives every rank the same tokens.
    use_cache=False: recompute every sequence's window each step (no KV cache; the window
    slides past the context length instead of refusing it).
    """
    model.eval()
    b = len(prompts)
    max_new = _per_sequence(max_new_tokens, b, "max_new_tokens")
    stops = _per_sequence(stop_tokens, b, "stop_tokens")
    check_request(model, prompts, max_new, sampling, use_cache)
    temperature = 0.0 if sampling.greedy else sampling.temperature
    # CPU noise: the same tokens on CPU and CUDA ranks
    gen = torch.Generator().manual_seed(sampling.seed)
    seqs = [list(q) for q in prompts]
    active = [i for i in range(b) if max_new[i] > 0]
    if not active:
        return
    if use_cache:
        capacity = max(
            max(len(q) for q in prompts), *(len(seqs[i]) + max_new[i] - 1 for i in active)
        )
        cache = KVCache.for_model(model, len(active), capacity)
        logits = prefill(model, cache, [seqs[i] for i in active])
    else:
        logits = recompute_logits(model, [seqs[i] for i in active])
    while True:
        tokens = pick(model, logits, gen, temperature, sampling.top_k)
        new, keep = {}, []
        for j, (i, t) in enumerate(zip(active, tokens.tolist(), strict=True)):
            seqs[i].append(t)
            new[i] = t
            if len(seqs[i]) - len(prompts[i]) < max_new[i] and t != stops[i]:
                keep.append(j)
        yield new
        if not keep:
            return
        if len(keep) < len(active):  # finished sequences leave the batch
            active = [active[j] for j in keep]
            tokens = tokens[torch.tensor(keep, device=tokens.device)]
            if use_cache:
                cache.keep(keep)
        if use_cache:
            logits = decode_step(model, cache, tokens)
        else:
            logits = recompute_logits(model, [seqs[i] for i in active])


def generate_batch(
    model: TPGPT,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int | Sequence[int] = 100,
    sampling: Sampling = Sampling(),
    *,
    stop_tokens: int | None | Sequence[int | None] = None,
    use_cache: bool = True,
) -> list[list[int]]:
    """Each prompt followed by its generated tokens (every rank returns the same lists);
    the arguments are stream's."""
    out = [list(q) for q in prompts]
    steps = stream(
        model, prompts, max_new_tokens, sampling, stop_tokens=stop_tokens, use_cache=use_cache
    )
    for new in steps:
        for i, t in new.items():
            out[i].append(t)
    return out
