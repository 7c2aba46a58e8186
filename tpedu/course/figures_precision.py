"""Lesson 00: training in bf16: why the master weights stay fp32, measured and drawn.

`--dtype bf16` (TrainConfig(dtype="bf16"), tpedu/train/precision.py) runs every matmul in bf16
under autocast but keeps the parameters, their gradients and AdamW's moments in fp32: the fp32
parameters are the master weights. Near 1.0 bf16 has steps of 2⁻⁷ ≈ 0.0078, so an update smaller
than half of that is rounded away:

    print(rounded_away())                              # 100 updates of +0.001: bf16 stays 1.0
    runs = tpedu.launch(precision_runs, 2, 60, timeout=600)[0]
    print(precision_table(runs)); plot_precision_runs(runs)

`precision_runs` trains the novel GPT at tp 2 three ways (fp32; bf16 compute with fp32 masters;
everything in bf16) and measures, on the fp32 run's last step, the share of parameter updates
a bf16 copy of the weights would lose (w + Δ rounds back to w): about 70 %. At this size and 60
steps the losses do not yet tell the three runs apart (their means agree within 0.1, and which
bf16 run ends lower depends on the CPU's kernels); the updates a bf16 weight drops are what
shows the difference, and they add up over a long run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tpedu.data.batches import packed_batch
from tpedu.data.corpus import novel_data
from tpedu.model.config import GPTConfig
from tpedu.model.dense import DenseGPT
from tpedu.model.gpt import TPGPT
from tpedu.train.config import TrainConfig
from tpedu.train.optim import make_optimizer
from tpedu.train.step import train_step

if TYPE_CHECKING:
    from matplotlib.figure import Figure

RUNS = ("fp32", "bf16, fp32 masters", "bf16 everywhere")


def rounded_away(updates: int = 100, delta: float = 0.001) -> str:
    """`updates` AdamW-sized updates of +delta (lr 1e-3, |m / sqrt(v)| = 1) to a weight of 1.0,
    in bf16 and in fp32: the line that says where each ended."""
    w16, w32 = torch.tensor(1.0, dtype=torch.bfloat16), torch.tensor(1.0)
    for _ in range(updates):
        w16 += delta
        w32 += delta
    return (
        f"after {updates} updates of +{delta}: bf16 weight {w16.item():.4f}, "
        f"fp32 weight {w32.item():.4f}"
    )


def precision_runs(steps: int) -> dict[str, object]:
    """Worker (tp = the launch's ranks): {run name: losses per step, "lost": the share of the
    fp32 run's last updates that bf16 weights would lose}."""
    tok, ids, _ = novel_data("char")
    cfg = GPTConfig.gpt2_like(tok.vocab_size, seq_len=64, n_layers=2, hidden=64, n_heads=4)
    out: dict[str, object] = {}
    for name in RUNS:
        torch.manual_seed(0)
        model = TPGPT(DenseGPT(cfg))
        if name == "bf16 everywhere":
            model = model.to(torch.bfloat16)
        train = TrainConfig(steps=steps, batch=8, dtype="bf16" if "masters" in name else "fp32")
        opt = make_optimizer(model, train)
        losses = []
        for k in range(steps):
            before = [p.detach().clone() for p in model.parameters()]
            x, y = packed_batch(ids, train.batch, cfg.seq_len, k, 0)
            losses.append(train_step(model, opt, x, y, k, train)[0])
        out[name] = losses
        if name == "fp32":  # the last update, applied to bf16 copies of the weights
            lost = total = 0
            for w, p in zip(before, model.parameters(), strict=True):
                w16 = w.bfloat16()
                lost += int(((w16 + (p.detach() - w).bfloat16()) == w16).sum())
                total += w.numel()
            out["lost"] = lost / total
    return out


AGREE = 0.1  # the bf16 runs' last-20 mean losses are within this of fp32's on every CPU tried
LOST = 0.5  # at least this share of the fp32 run's last updates vanish on bf16 weights


def precision_table(runs: dict[str, object]) -> str:
    """Claims, each checked (an AssertionError when one fails) and printed at its threshold, as
    a stored notebook output must hold on any CPU: over `LOST` of the fp32 run's last updates
    would be lost on bf16 weights; the bf16 runs' mean losses of their last 20 steps within
    `AGREE` of fp32's. Which bf16 run ends lower is the kernels' rounding (it flips between
    AVX2 and SSE code), so it is not printed."""
    mean = {name: sum(runs[name][-20:]) / len(runs[name][-20:]) for name in RUNS}
    if not runs["lost"] > LOST:
        raise AssertionError(f"only {runs['lost']:.0%} of the updates lost, not over {LOST:.0%}")
    lines = [f"last fp32 step: over {LOST:.0%} of the updates would be lost on bf16 weights ✓"]
    for name in RUNS[1:]:
        gap = abs(mean[name] - mean[RUNS[0]])
        if not gap <= AGREE:
            raise AssertionError(f"{name}: mean loss {gap:.3f} from fp32's, more than {AGREE}")
        lines.append(f"{name:<20} mean loss of the last 20 steps within {AGREE} of fp32's ✓")
    return "\n".join(lines)


def plot_precision_runs(runs: dict[str, object]) -> Figure:
    """The three runs' training losses per step."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.2))
    for name in RUNS:
        ax.plot(runs[name], label=name, lw=1)
    ax.set(xlabel="step", ylabel="training loss", title="The novel GPT at tp 2, three precisions")
    ax.legend()
    fig.tight_layout()
    return fig
