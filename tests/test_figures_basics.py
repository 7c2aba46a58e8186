"""The figures of lessons 02–06 draw what the code recorded in a real run (tpedu.course.figures_basics)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tpedu
from tpedu.course import figures_basics as fb
from tpedu.tp.attention import qkv_rows
from tpedu.tp.dense import DenseMLP
from tpedu.tp.embedding import padded_vocab, vocab_range
from tpedu.tp.mlp import ParallelMLP
from tpedu.tp.operators import copy_to_tp_region, reduce_from_tp_region
from tpedu.tp.vocab_parallel import vocab_parallel_cross_entropy


def _texts(fig: plt.Figure) -> list[str]:
    return [t.get_text() for ax in fig.axes for t in ax.texts] + [t.get_text() for t in fig.texts]


def _ring_worker(numel: int) -> list[fb.RingStep]:
    x = torch.full((numel,), 2.0 ** dist.get_rank(), dtype=torch.float64)
    states = fb.record_ring(x)
    assert torch.equal(x, torch.full_like(x, 2.0 ** dist.get_world_size() - 1))
    return states


@pytest.mark.parametrize("t", [2, 3])
def test_ring_states_and_figure(t: int) -> None:
    states = tpedu.launch(_ring_worker, t, 7)  # uneven chunks
    for r, st in enumerate(states):
        assert len(st) == 1 + 2 * (t - 1)
        assert st[0].chunks == (2.0**r,) * t
        # after reduce-scatter rank r's own chunk is complete; at the end every chunk is
        assert st[t - 1].chunks[r] == 2.0**t - 1
        assert st[-1].chunks == (2.0**t - 1,) * t
        assert [s.sent for s in st[1:t]] == [(r - 1 - s) % t for s in range(t - 1)]
    # what a rank receives in a step is what its left neighbour sent
    for r in range(t):
        for s in range(1, len(states[r])):
            assert states[r][s].received == states[(r - 1) % t][s].sent
    fig = fb.draw_ring(states)
    labels = _texts(fig)
    full = sum(c == 2.0**t - 1 for st in states for s in st for c in s.chunks)
    assert labels.count("all") == full
    assert "".join(str(w) for w in fb._contributors(states[1][1].chunks[0])) in labels
    plt.close(fig)


def _stages_worker() -> list[fb.StageTrace]:
    r, t = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(8, 5, generator=g), torch.randn(5, 8, generator=g)
    n = 8 // t
    x = torch.randn(3, 5, generator=g).requires_grad_()
    _, traces = fb.trace_stages(
        [
            ("f", copy_to_tp_region),
            ("column", lambda h: h @ w1[r * n : (r + 1) * n].T),
            ("row", lambda h: h @ w2[:, r * n : (r + 1) * n].T),
            ("f-bar", reduce_from_tp_region),
        ],
        x,
    )
    return traces


def test_trace_stages_attributes_each_collective() -> None:
    traces = tpedu.launch(_stages_worker, 2)[0]
    ops = {st.name: ([r.op for r in st.forward], [r.op for r in st.backward]) for st in traces}
    assert ops == {
        "f": ([], ["all_reduce"]),
        "column": ([], []),
        "row": ([], []),
        "f-bar": (["all_reduce"], []),
    }
    assert [st.out_shape for st in traces] == [(3, 5), (3, 4), (3, 5), (3, 5)]
    fig = fb.draw_dataflow(traces)
    assert _texts(fig).count("all-reduce 15 el.") == 2
    assert "[3, 4]" in _texts(fig)
    plt.close(fig)


def _mlp_worker() -> tuple:
    torch.manual_seed(0)
    dense = DenseMLP(4, 8).double()
    with torch.no_grad():
        dense.fc1.weight.copy_(torch.arange(32.0).view(8, 4))
        dense.fc2.weight.copy_(torch.arange(32.0).view(4, 8))
    par = ParallelMLP.from_dense(dense)
    x = torch.randn(2, 3, 4, dtype=torch.float64).requires_grad_()
    _, traces = fb.trace_stages([("fc1", par.fc1), ("gelu", F.gelu), ("fc2", par.fc2)], x)
    return par.fc1.weight.detach(), par.fc2.weight.detach(), traces


def test_mlp_ownership_and_figure() -> None:
    res = tpedu.launch(_mlp_worker, 2)
    fc1 = fb.ownership(torch.arange(32.0).view(8, 4), [r[0] for r in res])
    fc2 = fb.ownership(torch.arange(32.0).view(4, 8), [r[1] for r in res])
    assert torch.equal(fc1, torch.arange(8).div(4, rounding_mode="floor")[:, None].expand(8, 4))
    assert torch.equal(fc2, torch.arange(8).div(4, rounding_mode="floor")[None, :].expand(4, 8))
    traces = res[0][2]
    assert [len(st.forward) for st in traces] == [0, 0, 1]
    assert [len(st.backward) for st in traces] == [1, 0, 0]
    fig = fb.draw_mlp_split(fc1, fc2, traces)
    assert (fig.axes[0].images[0].get_array() == fc1.numpy()).all()
    assert (fig.axes[2].images[0].get_array() == fc2.numpy()).all()
    assert "fc2, forward: all_reduce of 24 el." in fig.texts[0].get_text()
    plt.close(fig)


def test_ownership_marks_overlap_and_gaps() -> None:
    dense = torch.arange(6.0)
    owner = fb.ownership(dense, [torch.tensor([0.0, 1.0, 2.0]), torch.tensor([2.0, 3.0])])
    assert owner.tolist() == [0, 0, -2, 1, -1, -1]


def test_qkv_figure_counts_replicas() -> None:
    layouts = [("tp=4", [qkv_rows(8, 2, 2, 4, r) for r in range(4)])]
    fig = fb.draw_qkv_split(layouts, 8, 2, 2)
    ax = fig.axes[0]
    assert len(ax.patches) == sum(len(rows) for rows in layouts[0][1])  # one box per kept row
    assert _texts(fig).count("×2") == 4  # k0, k1, v0, v1 each on two ranks
    plt.close(fig)


def _ce_worker(vocab: int) -> tuple:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 3, vocab, generator=g, dtype=torch.float64)
    target = torch.randint(0, vocab, (2, 3), generator=g)
    t, r = dist.get_world_size(), dist.get_rank()
    start, end = vocab_range(vocab, t, r)
    shard = F.pad(logits, (0, padded_vocab(vocab, t) - vocab))[..., start:end]
    shard = shard.contiguous().requires_grad_()
    with fb.watch_all_reduce() as seen:
        vocab_parallel_cross_entropy(shard, target, vocab).sum().backward()
    return seen, tuple(shard.shape), logits


def test_watch_all_reduce_and_ce_figure() -> None:
    res = tpedu.launch(_ce_worker, 2, 11)
    seen = [r[0] for r in res]
    assert [(x.op, x.shape, x.phase) for x in seen[0]] == [("MAX", (2, 3), "forward")] + [
        ("SUM", (2, 3), "forward")
    ] * 2
    assert torch.equal(seen[0][0].after, res[0][2].amax(-1))  # the global max of the logits
    assert torch.equal(torch.maximum(seen[0][0].before, seen[1][0].before), seen[0][0].after)
    fig = fb.draw_vocab_ce(seen, res[0][1], ["max", "target", "sum"])
    texts = _texts(fig)
    assert f"{float(seen[0][0].after[0, 0]):.3g} on every rank" in texts
    assert any("all-reduce MAX" in s for s in texts)
    plt.close(fig)
