"""The training loop's own parts, against references outside tpedu: the learning-rate schedule by
hand, clip_grads against torch.nn.utils.clip_grad_norm_, and train() at tp=1 and tp=2 against a
hand-written DenseGPT + torch AdamW loop (the recipe of tpedu/train/: the same batches, weight
decay on matrices only, clipping by the global norm, warm-up then cosine).

The other training tests compare tp=2 and train_3d runs with train() at tp=1: a bug in the loop
they share (no clipping, a wrong schedule, decay on the norms) is on both sides of those
comparisons.

Tolerance: float64; TPGPT and DenseGPT order their sums differently (≈1e-16 relative each), so
1e-10 relative is sharp (measured worst: 4.3e-16 for the losses and gradient norms, 6.1e-14 of a
tensor's largest entry for the weights). Measured on this run, decay on the norms and biases
moves the final weights by 3.1e-3 of a tensor's largest entry, a cosine that ends at 0 instead
of min_lr by 1.8e-2, no clipping by 0.31.
"""

import math

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import CONFIG, V
from tpedu import launch
from tpedu.data.batches import packed_batch
from tpedu.model.dense import DenseGPT
from tpedu.train.config import TrainConfig, lr_at
from tpedu.train.loop import train
from tpedu.train.step import clip_grads

CFG = TrainConfig(
    steps=4,
    batch=4,
    lr=1e-2,
    min_lr=1e-3,
    warmup=2,
    weight_decay=0.1,
    grad_clip=0.05,
    eval_every=1,
    eval_batches=1,
    progress=False,
)
# warm-up 1/2, 2/2 of lr; then cosine over steps 2..4: frac 0 (lr) and 1/2 (halfway to min_lr)
LRS = [1e-2 / 2, 1e-2, 1e-2, (1e-2 + 1e-3) / 2]


def test_lr_warms_up_linearly_then_decays_by_a_cosine():
    cfg = TrainConfig(steps=10, lr=1.0, min_lr=0.1, warmup=4)
    assert [lr_at(s, cfg) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0], abs=1e-15)
    # after warm-up: min_lr + (lr - min_lr)·(1 + cos(π·(step - 4)/6))/2
    cosine = {
        4: 1.0,
        5: 0.1 + 0.45 * (1 + math.sqrt(3) / 2),
        6: 0.775,
        7: 0.55,
        8: 0.325,
        9: 0.1 + 0.45 * (1 - math.sqrt(3) / 2),
        10: 0.1,
        12: 0.1,
    }
    for step, want in cosine.items():
        assert lr_at(step, cfg) == pytest.approx(want, abs=1e-15), step
    assert [lr_at(s, CFG) for s in range(CFG.steps)] == pytest.approx(LRS, abs=1e-15)
    no_warmup = TrainConfig(steps=4, lr=1.0, min_lr=0.0, warmup=0)
    assert [lr_at(s, no_warmup) for s in range(5)] == pytest.approx(
        [1.0, (1 + math.sqrt(0.5)) / 2, 0.5, (1 - math.sqrt(0.5)) / 2, 0.0], abs=1e-15
    )


def test_clip_grads_equals_torch_clip_grad_norm():
    g = torch.Generator().manual_seed(0)
    for max_norm in (0.5, 1e3, 0.0):  # clipped; below the limit (unchanged); 0: clipping off
        grads = [torch.randn(s, generator=g, dtype=torch.float64) for s in [(3, 4), (5,)]]
        mine, torchs = ([torch.nn.Parameter(torch.zeros_like(x)) for x in grads] for _ in "ab")
        for a, b, x in zip(mine, torchs, grads, strict=True):
            a.grad, b.grad = x.clone(), x.clone()
        norm = torch.linalg.vector_norm(torch.cat([x.flatten() for x in grads]))
        no_grad = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
        clip_grads([*mine, no_grad], norm, max_norm)
        assert no_grad.grad is None
        if max_norm > 0:  # torch's max_norm=0 would zero the gradients; ours switches clipping off
            total = torch.nn.utils.clip_grad_norm_(torchs, max_norm)  # the norm before clipping
            assert total.item() == pytest.approx(norm.item(), rel=1e-15)
        for a, b in zip(mine, torchs, strict=True):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-15, atol=0)
        # the norm after clipping: max_norm·norm/(norm + 1e-6), within 1e-6/norm = 2.5e-7 of max_norm
        clipped = torch.linalg.vector_norm(torch.cat([a.grad.flatten() for a in mine])).item()
        assert clipped == pytest.approx(min(norm.item(), max_norm or math.inf), rel=1e-6)


def by_hand(config, cfg, train_ids):
    """DenseGPT + torch AdamW for cfg.steps steps: (losses, gradient norms, final state dict)."""
    torch.manual_seed(cfg.seed)
    model = DenseGPT(config)
    matrices = [p for p in model.parameters() if p.ndim == 2]  # linear weights, embedding tables
    rest = [p for p in model.parameters() if p.ndim < 2]  # norms' weights, biases
    opt = torch.optim.AdamW(
        [
            {"params": matrices, "weight_decay": cfg.weight_decay},
            {"params": rest, "weight_decay": 0.0},
        ],
        betas=(0.9, 0.95),
    )
    losses, norms = [], []
    for step, lr in enumerate(LRS):
        x, y = packed_batch(train_ids, cfg.batch, config.seq_len, step, cfg.seed)
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip).item())
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        losses.append(loss.item())
    return losses, norms, model.state_dict()


def train_and_by_hand(out):
    """On every rank (tp = world size): train() saving to `out`, and the hand-written loop."""
    torch.set_default_dtype(torch.float64)
    g = torch.Generator().manual_seed(0)
    tr, va = torch.randint(0, V, (500,), generator=g), torch.randint(0, V, (200,), generator=g)
    return train(CONFIG, CFG, tr, va, out), by_hand(CONFIG, CFG, tr)


@pytest.mark.parametrize("tp", [1, 2])
def test_train_equals_a_hand_written_adamw_loop(tp, tmp_path):
    summary, (losses, norms, state) = launch(train_and_by_hand, tp, str(tmp_path))[0]
    assert len(LRS) == CFG.steps and all(n > CFG.grad_clip for n in norms)  # clipping is on
    assert summary["losses"] == pytest.approx(losses, rel=1e-10)
    assert [h["grad_norm"] for h in summary["history"]] == pytest.approx(norms, rel=1e-10)
    saved = load_file(tmp_path / "model.safetensors")  # the dense weights, gathered
    assert set(saved) == set(state)
    for k, want in state.items():
        diff = (saved[k] - want).abs().max().item()
        assert diff <= 1e-10 * want.abs().max().item(), f"{k}: max |train - by hand| {diff:.1e}"
