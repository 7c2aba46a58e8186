"""The KV cache sharded by heads and batched generation (tpedu.serve) against recomputing the
whole window: the same logits at every step (float64, ~1e-12: only the order of the attention
sums differs) and the same greedy tokens, at tp 1, 2, 4, GPT-2 style and Llama style (GQA with 2
KV heads: split at tp 2, replicated at tp 4); a batch against its sequences one at a time;
`transformers`' own cached greedy decoding; the context-length limit; and the communication per
prefill and per decoded token against the formula."""

import pytest
import torch

from tests.helpers import transformers_greedy
from tpedu import launch
from tpedu.comm.tracer import CommTracer
from tpedu.cp.context import ContextParallel
from tpedu.model.config import GPTConfig
from tpedu.model.dense import DenseGPT
from tpedu.model.gpt import TPGPT
from tpedu.model.options import RunOptions
from tpedu.serve.generate import Sampling, decode_step, generate_batch, pick, prefill, stream
from tpedu.tp.kv_cache import KVCache, check_cache_usable
from tpedu.tp.vocab_parallel import gather_logits

CONFIGS = {
    # vocab 37 is prime: padded at every tp > 1. Dropout is configured, and off in eval mode.
    "gpt2": GPTConfig.gpt2_like(37, seq_len=16, n_layers=2, hidden=24, n_heads=4, dropout=0.1),
    "llama": GPTConfig.llama_like(37, seq_len=16, n_layers=2, hidden=32, n_heads=4),
    "replicated-embedding": GPTConfig.gpt2_like(
        37, seq_len=16, n_layers=1, hidden=24, n_heads=4, vocab_parallel=False
    ),
}
PROMPTS = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14]]


def tp_model(config, fused=True):
    torch.manual_seed(0)
    return TPGPT(DenseGPT(config, fused_attention=fused).double()).double().eval()


def full(model, logits):
    """Every rank's logits [..., V] (the vocab-parallel shards gathered)."""
    if model.config.vocab_parallel:
        return gather_logits(logits, model.config.vocab_size, model.group)
    return logits


@torch.no_grad()
def cached_vs_recomputed(name, steps=8):
    """Greedy decoding of each prompt alone, with and without the cache: (max logit difference
    over every step, cached tokens, recomputed tokens) per prompt."""
    model = tp_model(CONFIGS[name.removesuffix("-explicit")], fused=not name.endswith("-explicit"))
    gen = torch.Generator()
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        cache = KVCache.for_model(model, 1)
        cached = prefill(model, cache, [prompt])
        diff, mine, theirs = 0.0, [], []
        for _ in range(steps):
            recomputed = model(ids)[:, -1]
            diff = max(diff, (full(model, cached) - full(model, recomputed)).abs().max().item())
            t_cache = pick(model, cached, gen, temperature=0.0)
            t_recompute = pick(model, recomputed, gen, temperature=0.0)
            mine.append(t_cache.item())
            theirs.append(t_recompute.item())
            ids = torch.cat([ids, t_recompute.view(1, 1)], dim=1)  # both follow the same text
            cached = decode_step(model, cache, t_recompute)
        out.append((diff, mine, theirs, cache.lengths.item()))
    return out


@pytest.mark.parametrize("name", ["gpt2", "llama", "llama-explicit"])  # explicit: scores, no SDPA
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_cached_decoding_equals_recomputing_the_window(name, tp):
    results = launch(cached_vs_recomputed, tp, name)
    for rank, per_prompt in enumerate(results):
        assert per_prompt == results[0]  # every rank: the same logits and tokens
        for i, (diff, mine, theirs, filled) in enumerate(per_prompt):
            assert diff < 1e-12, f"{name} tp={tp} rank {rank} prompt {i}: logits differ by {diff}"
            assert mine == theirs
            assert filled == len(PROMPTS[i]) + 8  # the prompt + every token fed back


def batch_vs_alone(name, steps=5):
    """The same text fed to a batch of all prompts and to each prompt alone, both cached:
    (max logit difference, batched greedy run, runs alone, a run stopped by a stop token)."""
    model = tp_model(CONFIGS[name])
    gen = torch.Generator()
    with torch.no_grad():
        cache = KVCache.for_model(model, len(PROMPTS))
        batched = [full(model, prefill(model, cache, PROMPTS))]
        alone_caches = [KVCache.for_model(model, 1) for _ in PROMPTS]
        alone = [
            [full(model, prefill(model, c, [p]))]
            for c, p in zip(alone_caches, PROMPTS, strict=True)
        ]
        for _ in range(steps):
            tokens = pick(model, batched[-1], gen, temperature=0.0)
            batched.append(full(model, decode_step(model, cache, tokens)))
            for j, c in enumerate(alone_caches):
                alone[j].append(full(model, decode_step(model, c, tokens[j : j + 1])))
    diff = max(
        (batched[s][j] - alone[j][s][0]).abs().max().item()
        for s in range(steps + 1)
        for j in range(len(PROMPTS))
    )
    max_new = [6, 9, 3]  # a length per sequence: the batch shrinks as they finish
    runs = generate_batch(model, PROMPTS, max_new, Sampling(greedy=True))
    singles = [
        generate_batch(model, [p], m, Sampling(greedy=True))[0]
        for p, m in zip(PROMPTS, max_new, strict=True)
    ]
    stop = runs[1][len(PROMPTS[1]) + 2]  # the third token sequence 1 generates
    stopped = generate_batch(
        model, PROMPTS, 9, Sampling(greedy=True), stop_tokens=[None, stop, None]
    )
    steps_seen = [sorted(new) for new in stream(model, PROMPTS, max_new, Sampling(greedy=True))]
    return diff, runs, singles, stop, stopped, steps_seen


@pytest.mark.parametrize(("name", "tp"), [("gpt2", 2), ("llama", 4), ("replicated-embedding", 2)])
def test_a_batch_decodes_each_sequence_as_it_would_alone(name, tp):
    for diff, runs, singles, stop, stopped, steps_seen in launch(batch_vs_alone, tp, name):
        assert diff < 1e-12  # right padding and per-sequence positions change nothing
        assert runs == singles
        assert [len(r) - len(p) for r, p in zip(runs, PROMPTS, strict=True)] == [6, 9, 3]
        first = runs[1].index(stop, len(PROMPTS[1]))  # the stop token's first appearance
        assert stopped[1] == runs[1][: first + 1]  # kept, then nothing more
        assert len(stopped[0]) == len(stopped[2]) - len(PROMPTS[2]) + len(PROMPTS[0])  # 9 each
        # the stream: every sequence each step until it finishes
        assert steps_seen[:3] == [[0, 1, 2]] * 3 and steps_seen[3:6] == [[0, 1]] * 3
        assert steps_seen[6:] == [[1]] * 3


def train_generate(config, state, prompt, n, use_cache):
    from tpedu.train.generate import generate

    return generate(
        config, state, prompt, n, Sampling(temperature=0.8, top_k=10, seed=3), use_cache
    )


def test_generate_samples_the_same_tokens_with_and_without_the_cache():
    """tpedu.train.generate.generate: the cached default draws the recompute path's tokens."""
    config = CONFIGS["llama"]
    torch.manual_seed(0)
    state = DenseGPT(config).double().state_dict()
    cached = launch(train_generate, 2, config, state, [3, 1, 4], 12, True)
    recomputed = launch(train_generate, 2, config, state, [3, 1, 4], 12, False)
    assert cached[0] == cached[1] == recomputed[0]
    assert len(cached[0]) == 15


def hf_greedy(prompts, steps, tp):
    transformers = pytest.importorskip("transformers")
    from tpedu.checkpoint import hf

    torch.manual_seed(0)
    # initializer_range 0.3, not GPT-2's 0.02: weights that small make greedy decoding repeat
    # one token whatever the positions are, and the comparison could not fail.
    cfg = transformers.GPT2Config(
        vocab_size=61,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=4,
        bos_token_id=None,
        eos_token_id=None,
        initializer_range=0.3,
    )
    ref = transformers.GPT2LMHeadModel(cfg).double().eval()
    expected = transformers_greedy(ref, prompts, steps)
    config = hf.config_from_hf(ref.config)
    state = hf.state_from_hf(ref.state_dict(), config)
    return expected, launch(_hf_worker, tp, config, state, prompts, steps)


def _hf_worker(config, state, prompts, steps):
    model = TPGPT.from_state_dict(config, state).double().eval()
    return generate_batch(model, prompts, steps, Sampling(greedy=True))


@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_tokens_equal_transformers_cached_generate(tp):
    prompts = [[5, 17, 3, 42, 8, 1], [60, 2, 33]]
    expected, results = hf_greedy(prompts, 12, tp)
    for got in results:
        assert got == expected
    assert len(set(expected[0][6:])) > 3  # not one token repeated


def trace_decoding(name, top_k):
    """The collectives of one prefill, one decode step and one sampling, separately."""
    model = tp_model(CONFIGS[name])
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]  # padded to s = 5
    cache = KVCache.for_model(model, len(prompts))
    gen = torch.Generator()
    traces = []
    with torch.no_grad():
        with CommTracer() as t:
            logits = prefill(model, cache, prompts)
        traces.append(t.summary())
        with CommTracer() as t:
            tokens = pick(model, logits, gen, 0.8, top_k)
        traces.append(t.summary())
        with CommTracer() as t:
            decode_step(model, cache, tokens)
        traces.append(t.summary())
    return traces


@pytest.mark.parametrize(("name", "tp", "top_k"), [("gpt2", 2, None), ("llama", 4, 5)])
def test_communication_per_prefill_and_per_token(name, tp, top_k):
    config = CONFIGS[name]
    b, s, h, layers = 2, 5, config.hidden, config.n_layers
    calls = 2 * layers + 1  # 2 per block + the vocab-parallel embedding
    prefill_t, sample_t, decode_t = launch(trace_decoding, tp, name, top_k)[0]
    assert set(prefill_t) == {("world", "all_reduce", "forward")}
    assert prefill_t[("world", "all_reduce", "forward")][:2] == (calls, calls * b * s * h)
    assert set(decode_t) == {("world", "all_reduce", "forward")}
    assert decode_t[("world", "all_reduce", "forward")][:2] == (calls, calls * b * h)
    # the sampler: each rank's best (value, id), plus every rank's top-k values with top_k
    gathers = (2, 2 * b * tp) if top_k is None else (3, 2 * b * tp + b * top_k * tp)
    assert set(sample_t) == {("world", "all_gather", "forward")}
    assert sample_t[("world", "all_gather", "forward")][:2] == gathers


def _too_long(config):
    model = tp_model(config)
    generate_batch(model, [[1, 2, 3]], 14)  # 3 + 13 = 16 fits; this asks for 17


def _overfill(config):
    model = tp_model(config)
    cache = KVCache.for_model(model, 1, capacity=6)
    logits = prefill(model, cache, [[1, 2, 3, 4, 5]])
    tok = pick(model, logits, torch.Generator(), 0.0)
    tok = pick(model, decode_step(model, cache, tok), torch.Generator(), 0.0)  # position 5: fits
    decode_step(model, cache, tok)  # position 6


def _refusals(config):
    errors = []
    model = tp_model(config)
    ids = torch.tensor([[1, 2, 3]])
    for bad in (
        lambda: _too_long(config),
        lambda: _overfill(config),
        lambda: model.train()(ids, cache=KVCache.for_model(model, 1)),
        lambda: model.eval()(ids, cache=KVCache.for_model(model, 2)),
        lambda: KVCache.for_model(model, 1, capacity=17),
        lambda: TPGPT(DenseGPT(config), options=RunOptions(sequence_parallel=True)).eval()(
            ids[:, :2], cache=KVCache.for_model(model, 1)
        ),
        lambda: check_cache_usable(False, False, ContextParallel(None)),
        lambda: generate_batch(model, [[1], []], 2),
        lambda: generate_batch(model, [[1], [40]], 2),
        lambda: generate_batch(model, [[1], [2]], [2]),
    ):
        try:
            bad()
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_the_context_length_and_what_the_cache_cannot_serve_are_clear_errors():
    errors = launch(_refusals, 1, CONFIGS["gpt2"])[0]
    for e, expected in zip(
        errors,
        [
            "3 tokens + max_new_tokens 14 = 17, more than the model's context length seq_len = "
            "16: ask for at most 13 new tokens, or use_cache=False",
            "the KV cache holds 6 positions; position 6 does not fit",
            "call model.eval()",
            "the cache was made for 2 sequences",
            "capacity 17 is more than the model's context length seq_len = 16",
            "build the model without sequence_parallel",
            "context parallelism (cp > 1) is not supported",
            "prompt 1 is empty",
            "prompt 1 has token ids outside [0, vocab_size = 37)",
            "max_new_tokens has 1 entries for 2 prompts",
        ],
        strict=True,
    ):
        assert e is not None and expected in e, (expected, e)
