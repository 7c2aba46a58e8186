"""The tensor-parallel GPT against the dense GPT: forward (dropout on, and in eval mode),
backward, state dicts, gradient norm, communication per step, and training steps on the novel.

Tolerances: in float64 the only differences come from sums reordered by the row-parallel
all-reduces and the vocab-parallel softmax (≈1e-16 relative each); 1e-10 leaves room for their
accumulation through the layers while still catching any real error (those are ≥1e-3). Training
runs in float32 (see test_training_steps_match).
"""

import pytest
import torch

from tpedu import launch
from tpedu.comm.tracer import CommTracer
from tpedu.model.config import GPTConfig
from tpedu.model.dense import DenseGPT
from tpedu.model.gpt import TPGPT, weighted_grads

CONFIGS = {
    # vocab 37 is prime: padded at every tp > 1; dropout on everywhere.
    "gpt2": GPTConfig.gpt2_like(37, seq_len=12, n_layers=2, hidden=24, n_heads=4, dropout=0.1),
    # GQA with 2 KV heads: split at tp 2, replicated at tp 4; RoPE, RMSNorm, SwiGLU, untied head.
    "llama": GPTConfig.llama_like(37, seq_len=12, n_layers=2, hidden=32, n_heads=4, dropout=0.1),
    "replicated-embedding": GPTConfig.gpt2_like(
        37, seq_len=12, n_layers=1, hidden=24, n_heads=4, vocab_parallel=False
    ),
}


def dense_model(config):
    torch.manual_seed(0)
    return DenseGPT(config).double()


def batch(config, b=3, s=10):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (b, s), generator=g)
    targets = torch.randint(0, config.vocab_size, (b, s), generator=g)
    targets[0, :3] = -100  # some ignored positions, as with padding
    return ids, targets


def compare_with_dense(name):
    config = CONFIGS[name]
    dense = dense_model(config)
    model = TPGPT(dense).double()
    ids, targets = batch(config)
    dense_loss = dense(ids, targets, step=5)
    dense_loss.backward()
    with CommTracer() as trace:
        loss = model(ids, targets, step=5)
        loss.backward()
    model.sync_grads()
    dense_norm = torch.nn.utils.get_total_norm([p.grad for p in dense.parameters()])
    logits = (model.full_logits(ids), dense(ids))
    with torch.no_grad():  # eval mode: every dropout site must switch off, in both models
        eval_logits = (model.eval().full_logits(ids), dense.eval()(ids))
    return {
        "loss": (loss.item(), dense_loss.item()),
        "logits": logits,
        "eval_logits": eval_logits,
        "grads": (
            model.gather_state_dict(grads=True),
            {n: p.grad for n, p in dense.named_parameters()},
        ),
        "state": (model.gather_state_dict(), dense.state_dict()),
        "norm": (model.grad_norm().item(), dense_norm.item()),
        "trace": trace.summary(),
    }


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_gpt_equals_dense(name, tp):
    config = CONFIGS[name]
    out = launch(compare_with_dense, tp, name)
    for rank, r in enumerate(out):
        tp_loss, dense_loss = r["loss"]
        assert tp_loss == pytest.approx(dense_loss, rel=1e-12, abs=0), f"rank {rank} loss"
        torch.testing.assert_close(*r["logits"], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(*r["eval_logits"], rtol=1e-10, atol=1e-12)
        if config.dropout > 0:  # not vacuous: dropout changes the training-mode logits
            assert (r["eval_logits"][1] - r["logits"][1]).abs().max() > 1e-3
        grads, dense_grads = r["grads"]
        assert grads.keys() == dense_grads.keys()
        for key in grads:
            diff = (grads[key] - dense_grads[key]).abs().max().item()
            assert diff < 1e-10, f"{name} tp={tp} rank {rank}: grad of {key} differs by {diff:.1e}"
        state, dense_state = r["state"]
        assert all(torch.equal(state[k], dense_state[k]) for k in dense_state)  # sharding is exact
        assert r["norm"][0] == pytest.approx(r["norm"][1], rel=1e-12)
    if tp > 1:
        check_communication(config, out[0]["trace"], tp)


def check_communication(config, trace, tp):
    """Per block 1 all-reduce of b·s·H in each of attention and MLP, forward and backward."""
    b, s, h, layers = 3, 10, config.hidden, config.n_layers
    fwd = trace[("world", "all_reduce", "forward")]
    bwd = trace[("world", "all_reduce", "backward")]
    if config.vocab_parallel:
        # + the embedding's all-reduce (b·s·h) and the loss's 3 all-reduces of b·s elements
        assert fwd[:2] == (2 * layers + 1 + 3, (2 * layers + 1) * b * s * h + 3 * b * s)
        # + the LM head's f (its input gradient, b·s·h)
        assert bwd[:2] == (2 * layers + 1, (2 * layers + 1) * b * s * h)
    else:
        assert fwd[:2] == (2 * layers, 2 * layers * b * s * h)
        assert bwd[:2] == (2 * layers, 2 * layers * b * s * h)


def test_bad_configs_are_clear_errors():
    with pytest.raises(
        ValueError, match="4 heads are not divisible by tp=3; valid tp values: 1, 2, 4"
    ):
        CONFIGS["gpt2"].check(3)
    with pytest.raises(ValueError, match="hidden = 30 is not divisible by n_heads = 4"):
        GPTConfig(50, hidden=30, n_heads=4).check(1)
    with pytest.raises(ValueError, match="n_heads = 0 must be a positive multiple"):
        GPTConfig(50, n_heads=0).check(1)  # not a ZeroDivisionError
    for p in (-0.1, 1.0, 1.5):
        with pytest.raises(ValueError, match=rf"dropout = {p} must be in \[0, 1\)"):
            GPTConfig(50, dropout=p).check(1)


def squares(model):
    """This rank's weighted sum of squared gradients, as grad_norm sums them before its
    all-reduce."""
    return sum((g.double().square() * w).sum() for g, w in weighted_grads([model]))


def counts_after_moving():
    """build_model builds on the CPU, then moves the model to its GPU: the replica counts of the
    QKV rows stay on the CPU and must follow the gradients. The meta device plays the GPU
    (mixing it with CPU tensors raises, as CUDA does). Unlike .to("cuda"), .to("meta") and
    to_empty() make new Parameter objects: the counts, keyed by parameter name, must still find
    them. At tp 4 the llama config's 2 KV heads are replicated twice and norms 4 times, so a
    count that is lost (the default, t) changes the sum."""
    on_meta = TPGPT(DenseGPT(CONFIGS["llama"])).to("meta")
    for p in on_meta.parameters():
        p.grad = torch.zeros_like(p)
    device = squares(on_meta).device.type
    model = TPGPT(DenseGPT(CONFIGS["llama"]))
    moved = TPGPT(DenseGPT(CONFIGS["llama"])).to("meta").to_empty(device="cpu")
    assert not any(a is b for a, b in zip(model.parameters(), moved.parameters(), strict=True))
    for m in (model, moved):
        for p in m.parameters():
            p.grad = torch.ones_like(p)
    return device, squares(model).item(), squares(moved).item()


def test_gradient_norm_counts_follow_the_model_to_its_device():
    for device, before, after in launch(counts_after_moving, 4):
        assert device == "meta"
        assert after == before  # ones everywhere: the same counts give the same sum, exactly


def train_losses(config, steps):
    from tpedu.data.corpus import novel_data
    from tpedu.train.config import TrainConfig
    from tpedu.train.loop import train

    _, train_ids, val_ids = novel_data("char")
    cfg = TrainConfig(steps=steps, batch=4, lr=3e-3, warmup=2, eval_every=0, progress=False)
    return train(config, cfg, train_ids[:50_000], val_ids[:5_000])["losses"]


def test_training_steps_match_on_the_novel():
    """5 AdamW steps on 红楼梦 at tp=2 give the tp=1 losses.

    float32: row-parallel sums are reordered (≈1e-7 relative per reduction); AdamW's update
    divides by sqrt(v), which amplifies tiny gradient differences early on, so losses agree to
    ~1e-5 relative after a few steps. A real bug (a missing all-reduce) shifts them by > 1e-2.
    """
    from tpedu.data.corpus import novel_data

    tok, _, _ = novel_data("char")
    config = GPTConfig.gpt2_like(tok.vocab_size, seq_len=32, n_layers=2, hidden=32, n_heads=4)
    single = launch(train_losses, 1, config, 5)[0]
    double = launch(train_losses, 2, config, 5)
    assert double[0] == double[1]  # both TP ranks compute the same loss
    assert single[-1] < single[0]  # it learns
    for step, (a, b) in enumerate(zip(single, double[0], strict=True)):
        assert a == pytest.approx(b, rel=2e-5), f"step {step}: tp=1 {a} vs tp=2 {b}"


def chained_stages(name):
    """Two pipeline stages on the same ranks, called one after the other, equal the full model."""
    config = CONFIGS[name]
    dense = dense_model(config)
    ids, targets = batch(config)
    first, last = (
        TPGPT(dense, layers=range(0, 1)).double(),
        TPGPT(dense, layers=range(1, 2)).double(),
    )
    loss = last(first(ids, step=2), targets, step=2)
    keys = set(first.gather_state_dict()) | set(last.gather_state_dict())
    return loss.item(), dense(ids, targets, step=2).item(), keys, set(dense.state_dict())


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_pipeline_stages_compose_to_the_full_model(name):
    for loss, dense_loss, keys, dense_keys in launch(chained_stages, 2, name):
        assert loss == pytest.approx(dense_loss, rel=1e-12)
        assert keys == dense_keys  # together the stages hold every parameter, once
