"""tpedu.analysis.memory: formulas against real torch models, and the ledger's division rules."""

import math
import random

import matplotlib
import pytest
import torch

from tpedu.analysis.memory import (
    TinyGPT,
    activation_bytes_per_layer,
    adamw_step,
    gpt_params,
    ledger,
    measure_training_bytes,
    training_bytes,
)
from tpedu.analysis.shape import ModelShape

matplotlib.use("Agg")

CONFIGS = [
    ModelShape(n_layers=2, hidden=24, n_heads=4, vocab_size=97, seq_len=16, micro_batch=2),
    ModelShape(
        n_layers=3, hidden=30, n_heads=6, vocab_size=101, seq_len=9, n_kv_heads=2, ffn_hidden=50
    ),
    ModelShape(n_layers=1, hidden=20, n_heads=5, vocab_size=53, seq_len=0, tie_embeddings=False),
    ModelShape(
        n_layers=2, hidden=18, n_heads=3, vocab_size=67, seq_len=7, bias=False, tie_embeddings=False
    ),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"L{c.n_layers}h{c.hidden}")
def test_param_count_equals_real_model(config):
    model = TinyGPT(config)
    real = sum(p.numel() for p in model.parameters())
    assert config.n_params == real, f"formula {config.n_params} vs real {real}"
    # gpt_params's defaults are the GPT-2 block: 12h² + 13h per layer.
    h = 40
    two, three = (
        ModelShape(n_layers=n, hidden=h, n_heads=4, vocab_size=11, seq_len=5) for n in (2, 3)
    )
    assert gpt_params(three) - gpt_params(two) == 12 * h * h + 13 * h
    # With no parallelism the ledger holds every parameter exactly once.
    assert ledger(config).params == real


def test_measured_bytes_equal_formula():
    # fp32 AdamW: 4 (weight) + 4 (grad) + 8 (m, v) bytes per parameter, exactly.
    torch.manual_seed(0)
    model = TinyGPT(CONFIGS[1])
    measured = measure_training_bytes(model, adamw_step(model))
    n = CONFIGS[1].n_params
    assert measured.params == n
    assert (measured.weights, measured.gradients, measured.optimizer) == (4 * n, 4 * n, 8 * n)
    assert measured.bookkeeping == 4 * len(list(model.parameters()))  # one fp32 step per tensor
    assert training_bytes(n, 4, 4, 8) == measured.total - measured.bookkeeping
    # A tied LM head is one storage: untying it adds exactly V·h parameters' worth of every line.
    untied = TinyGPT(ModelShape(**{**CONFIGS[1].__dict__, "tie_embeddings": False}))
    m2 = measure_training_bytes(untied, adamw_step(untied))
    vh = CONFIGS[1].vocab_size * CONFIGS[1].hidden
    assert (m2.weights - measured.weights, m2.optimizer - measured.optimizer) == (4 * vh, 8 * vh)
    # Plain bf16 AdamW keeps m and v in bf16 (2+2+4 bytes): the 12 needs fp32 master + m + v.
    model16 = TinyGPT(CONFIGS[0]).to(torch.bfloat16)
    m16 = measure_training_bytes(model16, adamw_step(model16))
    n0 = CONFIGS[0].n_params
    assert (m16.weights, m16.gradients, m16.optimizer) == (2 * n0, 2 * n0, 4 * n0)


def sharded_count(model, tp):
    """Parameters one TP rank holds, by classifying TinyGPT's real tensors by name."""
    vocab_parallel = ("tok.weight", "head.weight")
    sharded = ("q.", "kv_proj.", "fc1.", "out.weight", "fc2.weight")
    total = 0
    for name, p in model.named_parameters():
        if name in vocab_parallel:
            total += math.ceil(p.shape[0] / tp) * p.shape[1]
        elif any(s in name for s in sharded):
            assert p.numel() % tp == 0, name
            total += p.numel() // tp
        else:  # LayerNorms, positions, row-parallel biases: replicated
            total += p.numel()
    return total


def test_ledger_tensor_parallel_division():
    config = ModelShape(
        n_layers=2, hidden=36, n_heads=6, vocab_size=101, seq_len=8, tie_embeddings=False
    )
    model = TinyGPT(config)
    base = ledger(config)
    for tp in (1, 2, 3, 6):
        lg = ledger(config, tp=tp)
        assert lg.params == sharded_count(model, tp), f"tp={tp}"
        assert (lg.weights, lg.gradients, lg.optimizer) == (
            2 * lg.params,
            2 * lg.params,
            12 * lg.params,
        )
        assert lg.total == lg.weights + lg.gradients + lg.optimizer + lg.activations
        if tp > 1:
            assert lg.params < base.params and lg.activations < base.activations


def test_ledger_pipeline_and_data_parallel_division():
    c = ModelShape(n_layers=7, hidden=32, n_heads=4, vocab_size=90, seq_len=12, micro_batch=3)
    h = c.hidden
    per_layer = 12 * h * h + 13 * h
    act = activation_bytes_per_layer(c.seq_len, c.micro_batch, h, c.n_heads)
    for pp in (2, 3, 4):
        lg = ledger(c, pp=pp)
        layers = math.ceil(c.n_layers / pp)  # stage 0 gets the largest share
        # final LN: last stage
        assert lg.params == layers * per_layer + c.vocab_size * h + c.seq_len * h
        assert lg.activations == layers * act * pp  # 1F1B: pp micro-batches in flight on stage 0
    one, dp8, z = ledger(c), ledger(c, dp=8), ledger(c, dp=8, zero=1)
    fields = ("weights", "gradients", "optimizer", "activations", "params")
    assert all(getattr(one, f) == getattr(dp8, f) for f in fields), "DP alone divides nothing"
    assert (z.weights, z.gradients, z.activations) == (one.weights, one.gradients, one.activations)
    assert z.optimizer == one.optimizer / 8
    assert "total" in z.table() and "zero1" in z.table()


def test_activation_formulas_reduce():
    rng = random.Random(0)
    for _ in range(5):
        s, b, a = rng.randint(1, 4096), rng.randint(1, 8), rng.choice([8, 16, 32])
        h = a * rng.randint(1, 200)
        sbh = s * b * h
        none = activation_bytes_per_layer(s, b, h, a)
        assert none == pytest.approx(sbh * (34 + 5 * a * s / h), rel=1e-15)
        # at t = 1 the TP and TP+SP rows are the no-parallelism row
        assert activation_bytes_per_layer(s, b, h, a, tp=1) == none
        assert activation_bytes_per_layer(s, b, h, a, tp=1, sp=True) == none
        for t in (2, 4, 8):
            sp = activation_bytes_per_layer(s, b, h, a, tp=t, sp=True)
            tp = activation_bytes_per_layer(s, b, h, a, tp=t)
            assert sp == pytest.approx(none / t, rel=1e-12)  # SP row = no-parallel row / t
            assert tp - sp == pytest.approx(10 * sbh * (1 - 1 / t), rel=1e-9)  # replicated 10sbh
            sel = activation_bytes_per_layer(s, b, h, a, tp=t, sp=True, recompute="selective")
            assert sel == pytest.approx(34 * sbh / t, rel=1e-12)
            full = activation_bytes_per_layer(s, b, h, a, tp=t, sp=True, recompute="full")
            assert full == 2 * sbh / t
        assert activation_bytes_per_layer(s, b, h, a, recompute="full") == 2 * sbh
    # the seed's setting s=2048, b=4, h=4096 (a=32): 114 sbh = 3.83 GB per layer
    assert activation_bytes_per_layer(2048, 4, 4096, 32) == 114 * 2048 * 4 * 4096


def test_bad_input_messages():
    c = ModelShape(n_layers=4, hidden=64, n_heads=8, vocab_size=100, seq_len=8)
    with pytest.raises(
        ValueError, match=r"8 heads are not divisible by tp=3; valid tp values: 1, 2, 4, 8"
    ):
        ledger(c, tp=3)
    with pytest.raises(ValueError, match=r"pp=5 exceeds the 4 layers"):
        ledger(c, pp=5)
    with pytest.raises(ValueError, match=r"recompute must be one of"):
        activation_bytes_per_layer(8, 1, 64, 8, recompute="some")
    with pytest.raises(ValueError, match=r"dp must be a positive integer"):
        ledger(c, dp=0)


def test_calculator_wires_widgets_to_ledger(capsys):
    from tpedu.analysis.calculator import memory_calculator

    calls = []
    box = memory_calculator(on_measure=lambda cfg, st: calls.append((cfg, st)) or "measured")
    calc = box.calculator
    assert calc.params_b.value == round(calc.config().n_params / 1e9, 2)  # the shape's size
    calc.params_b.value = 7.0  # typing a size sets the layer count
    assert calc.layers.value == ModelShape().with_params(7e9).n_layers
    calc.layers.value = 2  # and the box follows the layers (and every other shape control)
    assert calc.params_b.value == round(calc.config().n_params / 1e9, 2)
    assert calc.layers.value == 2
    calc.tp.value, calc.sp.value, calc.zero1.value, calc.dp.value = 4, True, True, 2
    assert calc.ledger() == ledger(calc.config(), tp=4, dp=2, sp=True, zero=1)
    calc.widget.children[2].click()  # the "measure" hook
    assert calls == [(calc.config(), calc.settings())]
    capsys.readouterr()
    calc.tp.value = 64  # 32 heads / 64: reported in the output, not raised
    assert "32 heads are not divisible by tp=64" in capsys.readouterr().out


@pytest.mark.parametrize(
    "overrides",
    [{}, {"tie_embeddings": False}, {"bias": False}, {"n_kv_heads": 2, "ffn_hidden": 50}],
    ids=["gpt2", "untied", "no-bias", "gqa-ffn"],
)
def test_model_shape_from_config_counts_the_real_model(overrides):
    from tpedu.model.config import GPTConfig
    from tpedu.model.dense import DenseGPT

    config = GPTConfig.gpt2_like(97, seq_len=16, n_layers=2, hidden=24, n_heads=4, **overrides)
    shape = ModelShape.from_config(config, micro_batch=3)
    real = sum(p.numel() for p in DenseGPT(config).parameters())
    assert shape.n_params == real == sum(p.numel() for p in TinyGPT(shape).parameters())
    assert (shape.vocab_size, shape.seq_len, shape.n_layers, shape.hidden, shape.n_heads) == (
        97,
        16,
        2,
        24,
        4,
    )
    assert (shape.kv_heads, shape.ffn, shape.micro_batch) == (config.kv_heads, config.ffn, 3)
    with pytest.raises(
        ValueError, match="this config has norm='rmsnorm', position='rope', activation='swiglu'"
    ):
        ModelShape.from_config(GPTConfig.llama_like(97))
