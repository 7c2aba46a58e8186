"""Vocab-parallel cross-entropy, argmax and sampling == their dense counterparts.

Loss and gradient: float64; the parallel loss sums exp() per shard and then across ranks (a
reordered sum) and subtracts the max before the target logit, so it agrees with
F.cross_entropy to ~1e-15 relative; 1e-12 absolute on losses of ~log(V) ≈ 4-11.
Argmax and sampling pick integers from the same float values: exact. That the dense sampler
draws from softmax(z / T) is checked statistically (test_sample_follows_softmax).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tpedu
from tpedu.comm.tracer import CommTracer
from tpedu.tp.embedding import padded_vocab, vocab_range
from tpedu.tp.vocab_parallel import (
    gather_logits,
    sample,
    vocab_parallel_argmax,
    vocab_parallel_cross_entropy,
    vocab_parallel_sample,
)

TOL = 1e-12


def _shard(full, vocab):
    """This rank's columns of the logits padded to a multiple of tp (padding filled with junk:
    large values that would win every max if they were not masked)."""
    t, r = dist.get_world_size(), dist.get_rank()
    vp = padded_vocab(vocab, t)
    padded = torch.cat([full, full.new_full((*full.shape[:-1], vp - vocab), 1e4)], dim=-1)
    lo, hi = vocab_range(vocab, t, r)
    return padded[..., lo:hi].contiguous()


def _ce_worker(logits, target, vocab, inplace=False):
    dev = tpedu.device()
    logits, target = logits.to(dev), target.to(dev)
    g = torch.randn(target.shape, generator=torch.Generator().manual_seed(2), dtype=logits.dtype)
    g = g.to(dev)
    full = logits.clone().requires_grad_()
    dense = F.cross_entropy(full.flatten(0, -2), target.flatten(), reduction="none")
    (dense.view(target.shape) * g).sum().backward()

    shard = _shard(logits, vocab).requires_grad_()
    with CommTracer() as tr:
        z = shard * 1.0 if inplace else shard  # inplace overwrites its input: not the leaf
        loss = vocab_parallel_cross_entropy(z, target, vocab, inplace=inplace)
        (loss * g).sum().backward()
    lo, hi = vocab_range(vocab, dist.get_world_size(), dist.get_rank())
    real = max(0, min(hi, vocab) - lo)
    want_grad = full.grad[..., lo : lo + real]
    return {
        "loss": (loss - dense.view(target.shape)).abs().max().item(),
        "grad": (shard.grad[..., :real] - want_grad).abs().max().item(),
        "pad_grad": shard.grad[..., real:].abs().max().item() if real < hi - lo else 0.0,
        "comm": (
            tr.count("all_reduce", "forward"),
            tr.numel("all_reduce", "forward"),
            tr.count(phase="backward"),
            tr.count("all_gather"),
        ),
    }


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_cross_entropy_equals_dense(tp, inplace):
    vocab = 23  # prime: padded at every tp > 1 (tp=4: 24, the last rank holds 1 padding column)
    gen = torch.Generator().manual_seed(tp)
    logits = torch.randn(3, 5, vocab, generator=gen, dtype=torch.float64) * 3
    target = torch.randint(0, vocab, (3, 5), generator=gen)
    target[0, 0], target[1, 1], target[2, 2] = vocab - 1, 0, -100  # both ends, one ignored
    for r, out in enumerate(tpedu.launch(_ce_worker, tp, logits, target, vocab, inplace)):
        assert out["loss"] < TOL and out["grad"] < TOL, (
            f"rank {r}: max |loss diff| {out['loss']:.3e}, max |grad diff| {out['grad']:.3e}"
        )
        assert out["pad_grad"] == 0.0, "padding columns must get exactly zero gradient"
        # 3 all-reduces (max, target logit, sum of exp) of b·s elements; no backward traffic,
        # and never an all-gather of the logits
        assert out["comm"] == (3, 3 * target.numel(), 0, 0), f"rank {r}: {out['comm']}"


@pytest.mark.parametrize("tp", [2, 4])
def test_gpt2_vocab_padding(tp):
    vocab = 50257
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 3, vocab, generator=gen, dtype=torch.float64)
    target = torch.tensor([[50256, 0, 31337]])
    for out in tpedu.launch(_ce_worker, tp, logits, target, vocab):
        assert out["loss"] < TOL and out["grad"] < TOL and out["pad_grad"] == 0.0


def test_large_logits_are_stable():
    """Logits around 1e4 overflow exp() in any precision; the max subtraction keeps it exact."""
    logits = torch.randn(2, 4, 10, generator=torch.Generator().manual_seed(1), dtype=torch.float32)
    logits = logits + 1e4
    target = torch.tensor([[0, 9, 3, 4], [5, 6, 7, 8]])
    for out in tpedu.launch(_ce_worker, 2, logits, target, 10):
        assert out["loss"] < 1e-3 and out["grad"] < 1e-6  # fp32 at 1e4: ulp ~1e-3 in the logits


def test_bad_target_is_an_error():
    def worker():
        try:
            vocab_parallel_cross_entropy(torch.randn(2, 5), torch.tensor([1, 10]), 10)
        except ValueError as e:
            return str(e)
        return "no error"

    for msg in tpedu.launch(worker, 2):
        assert "targets must be in [0, 10) or ignore_index=-100; found 10" in msg, msg


def test_second_backward_is_an_error():
    """The backward writes the gradient into the saved softmax (no [..., V/t] copy), so a second
    backward through the same graph would be silently wrong: it must raise instead."""

    def worker():
        logits = torch.randn(3, 6, requires_grad=True)
        loss = vocab_parallel_cross_entropy(logits, torch.tensor([0, 5, 11]), 12).sum()
        loss.backward(retain_graph=True)
        try:
            loss.backward()
        except RuntimeError as e:
            return str(e)
        return "no error"

    for msg in tpedu.launch(worker, 2):
        assert "can run only once" in msg, msg


def _sample_worker(logits, vocab):
    logits = logits.to(tpedu.device())
    shard = _shard(logits, vocab)
    out = {
        "gathered": (gather_logits(shard, vocab) - logits).abs().max().item(),
        "shard_argmax": shard.argmax(-1)
        + vocab_range(vocab, dist.get_world_size(), dist.get_rank())[0],
        "argmax": vocab_parallel_argmax(shard, vocab),
        "dense_argmax": logits.argmax(-1),
    }
    # top_k 20 > the shard width at tp 2 (15) and 4 (8): the shards' top-ks are padded with -inf
    kws = {
        "t1": {},
        "t07k5": {"temperature": 0.7, "top_k": 5},
        "k20": {"top_k": 20},
        "t0": {"temperature": 0},
    }
    for name, kw in kws.items():
        draws, dense = [], []
        for seed in range(20):
            draws.append(
                vocab_parallel_sample(shard, vocab, torch.Generator().manual_seed(seed), **kw)
            )
            dense.append(sample(logits, torch.Generator().manual_seed(seed), **kw))
        out[name] = (torch.stack(draws), torch.stack(dense))
    return out


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_argmax_and_sampling_agree_with_dense(tp):
    vocab = 29  # prime: tp 2 -> shards of 15, tp 4 -> 8 (the last rank: 5 ids and 3 padding)
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 6, vocab, generator=gen, dtype=torch.float64)
    logits[0, 0, 3] = logits[0, 0, 20] = 50.0  # a tie across ranks: the lower id must win
    results = tpedu.launch(_sample_worker, tp, logits, vocab)
    for r, out in enumerate(results):
        assert out["gathered"] == 0.0
        assert torch.equal(out["argmax"], out["dense_argmax"]), f"rank {r}"
        assert out["argmax"][0, 0].item() == 3
        for name in ("t1", "t07k5", "k20", "t0"):
            par, dense = out[name]
            assert torch.equal(par, dense), f"rank {r} {name}: {int((par != dense).sum())} differ"
    if tp > 1:  # the seed's trap: each rank's own argmax is its best token, not the model's
        wrong = [(out["shard_argmax"] != out["dense_argmax"]).sum().item() for out in results]
        assert all(w > 0 for w in wrong), wrong
    # sampling is really random (different seeds, different tokens) and top-k really filters
    par, _ = results[0]["t1"]
    assert len(set(par[:, 1, 2].tolist())) > 3
    top5 = logits.topk(5, dim=-1).indices
    assert (results[0]["t07k5"][0][..., None] == top5).any(-1).all()


def test_sample_follows_softmax():
    """`sample` draws from softmax(z / T); with top_k, from the k largest logits renormalised and
    never from the others. The tests above compare the parallel sampler with `sample` draw by
    draw (same noise); this checks the noise itself.

    N draws of one row of logits in a single seeded call (deterministic). Each token's count is
    binomial(N, p): its frequency has standard deviation sqrt(p(1 - p) / N) (<= 0.0035 here). We
    require every frequency within 5 standard deviations of p: a correct sampler exceeds that with
    probability ~6e-7 per token (normal tail), while wrong noise (uniform, or a wrong temperature)
    is off by tens of standard deviations.
    """
    vocab, n = 29, 20_000
    z = torch.randn(vocab, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    for temperature, top_k in ((1.0, None), (0.7, 5), (2.0, 20)):
        g = torch.Generator().manual_seed(6)
        draws = sample(z.expand(n, vocab), g, temperature=temperature, top_k=top_k)
        freq = torch.bincount(draws, minlength=vocab).double() / n
        want = z / temperature
        if top_k is not None:
            want = want.masked_fill(want < want.topk(top_k).values[-1], float("-inf"))
        want = want.softmax(-1)
        kept = want > 0
        assert int(kept.sum()) == (top_k or vocab)
        assert (freq[~kept] == 0).all(), f"T={temperature}, top_k={top_k}: drew a filtered token"
        p = want[kept]
        err = ((freq[kept] - p).abs() / (p * (1 - p) / n).sqrt()).max().item()
        assert err < 5, f"T={temperature}, top_k={top_k}: a frequency is {err:.1f} std from p"
