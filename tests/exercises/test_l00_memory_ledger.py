"""Grades exercises/l00_memory_ledger.py against real torch tensors and the seed's numbers.

tpedu's own ledger (tpedu.analysis.memory, tpedu.analysis.shape) refuses to run while the tests
do, so a wrapper or an alias of it fails."""

import random

import torch
import torch.nn as nn

from tests.exercises import refusing
from tpedu.analysis import memory, shape
from tpedu.course.grading import implementation

TWINS = (
    memory.training_bytes,
    memory.embedding_bytes,
    shape.embedding_params,
    shape.layer_params,
    shape.gpt_params,
)


def real_gpt(
    n_layers, hidden, vocab, seq_len, ffn=None, heads=1, kv_heads=None, tied=True, bias=True
):
    """A GPT-2-style model from plain torch.nn (parameters only; the count is what matters)."""
    ffn = ffn or 4 * hidden
    kv_dim = (kv_heads or heads) * (hidden // heads)
    blocks = nn.ModuleList()
    for _ in range(n_layers):
        blocks.append(
            nn.ModuleList(
                [
                    nn.LayerNorm(hidden, bias=bias),
                    nn.Linear(hidden, hidden, bias=bias),  # Q
                    nn.Linear(hidden, kv_dim, bias=bias),  # K
                    nn.Linear(hidden, kv_dim, bias=bias),  # V
                    nn.Linear(hidden, hidden, bias=bias),  # out-proj
                    nn.LayerNorm(hidden, bias=bias),
                    nn.Linear(hidden, ffn, bias=bias),
                    nn.Linear(ffn, hidden, bias=bias),
                ]
            )
        )
    model = nn.ModuleDict({"tok": nn.Embedding(vocab, hidden), "blocks": blocks})
    if seq_len:
        model["pos"] = nn.Embedding(seq_len, hidden)
    model["ln_f"] = nn.LayerNorm(hidden, bias=bias)
    model["head"] = nn.Linear(hidden, vocab, bias=False)
    if tied:
        model["head"].weight = model["tok"].weight  # parameters() then yields it once
    return model


def numel(model):
    return sum(p.numel() for p in model.parameters())


def check_count(m, rng, **fixed):
    """gpt_params == the real model's parameter count for a few random uneven configs."""
    for _ in range(3):
        heads = rng.choice([1, 2, 3, 4, 6])
        cfg = dict(
            n_layers=rng.randint(1, 4),
            hidden=heads * rng.randint(2, 7),
            vocab=rng.randint(11, 300),
            seq_len=rng.randint(1, 40),
        )
        cfg.update(fixed)
        kw = {k: v for k, v in cfg.items() if k not in ("n_layers", "hidden", "vocab", "seq_len")}
        real = numel(
            real_gpt(
                cfg["n_layers"],
                cfg["hidden"],
                cfg["vocab"],
                cfg["seq_len"],
                ffn=kw.get("ffn_hidden"),
                heads=kw.get("heads", 1),
                kv_heads=kw.get("kv_heads"),
                tied=kw.get("tied_embeddings", True),
                bias=kw.get("bias", True),
            )
        )
        got = m.gpt_params(**cfg)
        assert isinstance(got, int), f"gpt_params must return an int, got {type(got).__name__}"
        assert got == real, (
            f"gpt_params({cfg}) = {got}, real model has {real} (|difference| = {abs(got - real)})"
        )


@refusing(*TWINS)
def test_training_bytes_seed_and_real_adamw():
    m = implementation("l00_memory_ledger")
    got = m.training_bytes(35 * 10**9)
    assert got == 560 * 10**9, (
        f"35B params in mixed-precision AdamW: expected 560e9 bytes, got {got}"
    )
    # Uneven byte counts catch a swapped or dropped term.
    assert m.training_bytes(1000, 1, 3, 7) == 11000
    # fp32 AdamW measured on real tensors: weight + grad + m + v.
    layer = nn.Linear(13, 7)
    opt = torch.optim.AdamW(layer.parameters())
    layer(torch.randn(3, 13)).sum().backward()
    opt.step()
    real = sum(p.nbytes + p.grad.nbytes for p in layer.parameters())
    real += sum(s["exp_avg"].nbytes + s["exp_avg_sq"].nbytes for s in opt.state.values())
    got = m.training_bytes(numel(layer), weight_bytes=4, grad_bytes=4, optimizer_bytes=8)
    assert got == real, (
        f"fp32 AdamW: got {got}, real tensors hold {real} (|difference| = {abs(got - real)})"
    )


@refusing(*TWINS)
def test_embedding_bytes_seed_and_real_tables():
    m = implementation("l00_memory_ledger")
    assert m.embedding_bytes(50_000, 4096, 1) == 204_800_000, "50k x 4096 must be 204.8M params"
    rng = random.Random(0)
    for dtype, nbytes in ((torch.bfloat16, 2), (torch.float32, 4)):
        vocab, hidden = rng.randint(50, 500), rng.randint(3, 40)
        real = nn.Embedding(vocab, hidden, dtype=dtype).weight.nbytes
        got = m.embedding_bytes(vocab, hidden, nbytes)
        assert got == real, (
            f"[{vocab}, {hidden}] {dtype}: got {got}, real {real} (|difference| = {abs(got - real)})"
        )
    assert m.embedding_bytes(37, 5) == 37 * 5 * 2, "the default is 2 bytes (bf16) per parameter"


@refusing(*TWINS)
def test_gpt_params_gpt2_block_formula():
    m = implementation("l00_memory_ledger")
    h = 48
    one = m.gpt_params(1, h, 100, 16)
    two = m.gpt_params(2, h, 100, 16)
    assert two - one == 12 * h * h + 13 * h, (
        f"one GPT-2 block should add 12h²+13h = {12 * h * h + 13 * h}, got {two - one}"
    )


@refusing(*TWINS)
def test_gpt_params_random_gpt2_configs():
    check_count(implementation("l00_memory_ledger"), random.Random(1))


@refusing(*TWINS)
def test_gpt_params_untied_no_bias_no_positions():
    m = implementation("l00_memory_ledger")
    check_count(m, random.Random(2), tied_embeddings=False)
    check_count(m, random.Random(3), bias=False)
    check_count(m, random.Random(4), seq_len=0, tied_embeddings=False, bias=False)


@refusing(*TWINS)
def test_gpt_params_gqa_and_ffn():
    m = implementation("l00_memory_ledger")
    rng = random.Random(5)
    check_count(
        m,
        rng,
        heads=6,
        kv_heads=rng.choice([1, 2, 3]),
        hidden=6 * rng.randint(2, 5),
        ffn_hidden=rng.randint(5, 50),
    )
