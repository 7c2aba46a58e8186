"""Replicated and vocab-parallel embeddings == nn.Embedding, forward and backward.

A lookup copies rows and the all-reduce adds exact zeros to them, so the forward is bit-exact
(tolerance 0.0); the weight gradient of each row is accumulated by the same index_add on the
owning rank, also exact.
"""

import pytest
import torch
import torch.nn.functional as F

import tpedu
from tpedu.comm.tracer import CommTracer
from tpedu.tp.embedding import (
    ReplicatedEmbedding,
    VocabParallelEmbedding,
    padded_vocab,
    vocab_range,
)


def test_padded_vocab_and_ranges():
    assert [padded_vocab(50257, t) for t in (1, 2, 3, 4, 8)] == [50257, 50258, 50259, 50260, 50264]
    assert [vocab_range(10, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 12)]
    with pytest.raises(ValueError, match=r"rank must be in \[0, tp=2\)"):
        vocab_range(10, 2, 2)


def _worker(vocab, hidden, ids):
    dev = tpedu.device()
    torch.manual_seed(0)
    w = torch.randn(vocab, hidden, dtype=torch.float64, device=dev)
    ids = ids.to(dev)
    grad_out = torch.randn(
        *ids.shape, hidden, generator=torch.Generator().manual_seed(1), dtype=torch.float64
    ).to(dev)
    dense = torch.nn.Embedding.from_pretrained(w.clone(), freeze=False)
    yd = dense(ids)
    (yd * grad_out).sum().backward()  # y.backward(g) would import sympy (5 s) in each rank

    emb = VocabParallelEmbedding(w)
    with CommTracer() as tr:
        y = emb(ids)
        (y * grad_out).sum().backward()
    rep = ReplicatedEmbedding(w)
    with CommTracer() as tr_rep:
        yr = rep(ids)
        (yr * grad_out).sum().backward()
    return {
        "fwd": (y - yd).abs().max().item(),
        "grad": (emb.dense_grad() - dense.weight.grad).abs().max().item(),
        "weight": (emb.dense_weight() - w).abs().max().item(),
        "local_rows": emb.weight.shape[0],
        "rep": max(
            (yr - yd).abs().max().item(), (rep.weight.grad - dense.weight.grad).abs().max().item()
        ),
        "comm": (
            tr.count("all_reduce", "forward"),
            tr.numel("all_reduce", "forward"),
            tr.count(phase="backward"),
            tr.count(),
            tr_rep.count(),
        ),
    }


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_vocab_parallel_equals_dense(tp):
    vocab, hidden = 37, 6  # 37 is prime: padded at every tp > 1
    g = torch.Generator().manual_seed(tp)
    ids = torch.randint(0, vocab, (3, 7), generator=g)
    ids[0, 0], ids[-1, -1] = 0, vocab - 1  # both ends of the vocabulary, last rank included
    for r, out in enumerate(tpedu.launch(_worker, tp, vocab, hidden, ids)):
        assert out["fwd"] == 0.0 and out["grad"] == 0.0 and out["weight"] == 0.0, (
            f"rank {r}: max |diff| fwd {out['fwd']:.3e}, grad {out['grad']:.3e}"
        )
        assert out["rep"] == 0.0
        assert out["local_rows"] == padded_vocab(vocab, tp) // tp
        n = ids.numel() * hidden
        assert out["comm"] == (1, n, 0, 1, 0), (
            f"rank {r}: expected 1 forward all-reduce of b·s·h={n}, none backward, none for the "
            f"replicated table; got {out['comm']}"
        )


@pytest.mark.parametrize("tp", [2, 4])
def test_gpt2_vocab_needs_padding(tp):
    vocab = 50257  # GPT-2's real vocabulary: prime-ish, divisible by neither 2 nor 4
    ids = torch.tensor([[0, 50256, 25128, 12564, 37692, 50255]])
    for out in tpedu.launch(_worker, tp, vocab, 4, ids):
        assert out["fwd"] == 0.0 and out["grad"] == 0.0 and out["weight"] == 0.0
        assert out["local_rows"] == padded_vocab(vocab, tp) // tp


def test_out_of_range_ids_are_an_error():
    def worker():
        emb = VocabParallelEmbedding(torch.randn(10, 3))
        try:
            emb(torch.tensor([[1, 10]]))  # 10 is in rank 1's padded range [6, 12) but invalid
        except ValueError as e:
            return str(e)
        return "no error"

    for msg in tpedu.launch(worker, 2):
        assert "token ids must be in [0, 10), got min 1, max 10" in msg, msg
    # the dense lookup refuses it too: the parallel one must not silently return a zero row
    with pytest.raises(IndexError):
        F.embedding(torch.tensor([10]), torch.randn(10, 3))
