"""Data parallelism: bucketed all-reduce == one process with the global batch, accumulation
without extra all-reduces, overlap with backward (tracer). ZeRO: tests/test_zero.py.

Tolerances: float64. DP averages N per-rank mean gradients (a reordered sum, ≈1e-16 relative);
1e-12 relative catches any real error (a missing 1/N is 100 %, a wrong slice ≥1e-3).
"""

import pytest
import torch

from tpedu import launch
from tpedu.comm.tracer import CommTracer
from tpedu.model.config import GPTConfig
from tpedu.model.dense import DenseGPT
from tpedu.parallel.data_parallel import DataParallel

CONFIG = GPTConfig.gpt2_like(29, seq_len=8, n_layers=2, hidden=12, n_heads=2)
B, S = 3, 7  # per-rank batch, sequence


def model():
    torch.manual_seed(0)
    return DenseGPT(CONFIG).double()


def global_batch(n, step=0):
    g = torch.Generator().manual_seed(10 + step)
    ids = torch.randint(0, CONFIG.vocab_size, (n * B, S), generator=g)
    return ids, torch.randint(0, CONFIG.vocab_size, (n * B, S), generator=g)


def close(a, b, rel=1e-12):
    diff = (a - b).abs().max().item()
    return diff <= rel * b.abs().max().item() + 1e-15, diff


def test_dp_equals_one_process_with_the_global_batch():
    def worker(n):
        import torch.distributed as dist

        r = dist.get_rank()
        m = model()
        dp = DataParallel(m, bucket_numel=300)  # several buckets
        first_param = next(m.parameters())  # tok_emb: its gradient arrives last in backward
        started_before_last = []
        first_param.register_post_accumulate_grad_hook(
            lambda _: started_before_last.append(len(dp.launched))
        )
        ids, tgt = global_batch(n)
        with CommTracer() as t:
            m(ids[r * B : (r + 1) * B], tgt[r * B : (r + 1) * B]).backward()
        dp.finish()
        grads = {k: p.grad.clone() for k, p in m.named_parameters()}
        # accumulation: 2 micro-batches per rank, all-reduce only in the second backward
        m.zero_grad(set_to_none=True)
        with CommTracer() as t2:
            half = B // 2 + 1  # uneven micro-batches: weight each mean by its share
            mine = slice(r * B, (r + 1) * B)
            xs, ys = ids[mine], tgt[mine]
            with dp.no_sync():
                (m(xs[:half], ys[:half]) * half / B).backward()
            (m(xs[half:], ys[half:]) * (B - half) / B).backward()
            dp.finish()
        acc = {k: p.grad.clone() for k, p in m.named_parameters()}
        return {
            "grads": grads,
            "acc": acc,
            "buckets": len(dp.buckets),
            "bw": t.count("all_reduce", phase="backward"),
            "all": t.count("all_reduce"),
            "acc_calls": t2.count("all_reduce"),
            "started": started_before_last,
        }

    for n in (1, 2, 3, 4):
        ref = model()
        ids, tgt = global_batch(n)
        ref(ids, tgt).backward()
        for r in launch(worker, n, n):
            for kind in ("grads", "acc"):
                for k, p in ref.named_parameters():
                    ok, diff = close(r[kind][k], p.grad)
                    assert ok, f"dp={n} {kind} {k}: max |dp - one process| = {diff:.2e}"
            if n > 1:
                assert r["buckets"] > 2
                # every bucket all-reduced once, from backward hooks: overlap with backward
                assert r["bw"] == r["all"] == r["buckets"]
                assert r["acc_calls"] == r["buckets"]  # accumulation adds no all-reduce
                assert r["started"][0] >= 1  # a bucket was in flight before backward ended


def test_dp_training_steps_equal_one_process():
    def worker(n):
        import torch.distributed as dist

        r = dist.get_rank()
        m = model()
        dp = DataParallel(m, bucket_numel=400)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        for step in range(3):
            ids, tgt = global_batch(n, step)
            opt.zero_grad()
            m(ids[r * B : (r + 1) * B], tgt[r * B : (r + 1) * B]).backward()
            dp.finish()
            opt.step()
        return {k: p.detach().clone() for k, p in m.state_dict().items()}

    for n in (2, 4):
        ref = model()
        opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        for step in range(3):
            ids, tgt = global_batch(n, step)
            opt.zero_grad()
            ref(ids, tgt).backward()
            opt.step()
        # Adam divides by √v: a 1e-16 gradient difference stays ≈1e-16 relative in the update.
        for state in launch(worker, n, n):
            for k, v in ref.state_dict().items():
                ok, diff = close(state[k], v, rel=1e-10)
                assert ok, f"dp={n} {k}: max |dp - one process| = {diff:.2e}"


def test_bad_bucket_size_is_a_clear_error():
    def worker():
        DataParallel(model(), bucket_numel=0)

    from tpedu.launcher import RankError

    with pytest.raises(RankError, match="bucket_numel must be at least 1"):
        launch(worker, 1)
