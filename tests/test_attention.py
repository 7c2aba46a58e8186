"""ParallelAttention == DenseAttention, forward and backward, MHA and GQA, dropout on.

float64 throughout: the TP result differs from the dense one only by the order of the out
projection's sum (partial sums per rank, then the all-reduce), so agreement is ~1e-16 relative;
1e-12 absolute on O(1) values leaves room for that and still catches any wrong row or head.
"""

import pytest
import torch

import tpedu
from tpedu.comm.tracer import CommTracer
from tpedu.tp.attention import ParallelAttention, check_heads, local_heads, qkv_rows, split_qkv
from tpedu.tp.dense import DenseAttention

TOL = 1e-12


def _dense(nq, nkv, hidden=10, head_dim=3, p=0.3, seed=0, bias=True):
    torch.manual_seed(seed)
    return DenseAttention(
        hidden,
        nq,
        nkv,
        head_dim=head_dim,
        bias=bias,
        dropout_p=p,
        dropout_seed=1234,
        dtype=torch.float64,
    )


def _max(a, b):
    return (a - b).abs().max().item()


def _compare_worker(nq, nkv, b, s, bias=True):
    dev = tpedu.device()
    dense = _dense(nq, nkv, bias=bias).to(dev)
    par = ParallelAttention.from_dense(dense).to(dev)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(b, s, dense.qkv.in_features, generator=g, dtype=torch.float64).to(dev)
    w = torch.randn(b, s, dense.qkv.in_features, generator=g, dtype=torch.float64).to(dev)
    xd, xp = x.clone().requires_grad_(), x.clone().requires_grad_()

    yd = dense(xd, step=3)
    (yd * w).sum().backward()
    with CommTracer() as tr:
        yp = par(xp, step=3)
        (yp * w).sum().backward()
    out = {"fwd": _max(yp, yd), "dx": _max(xp.grad, xd.grad)}
    out["dWo"] = _max(par.out.dense_weight(grad=True), dense.out.weight.grad)
    out["dbo"] = _max(par.out.dense_bias(grad=True), dense.out.bias.grad) if bias else 0.0
    if par.kv_replicas > 1:  # before the sync a replica holds only its own q heads' share
        out["unsynced"] = _max(par.dense_qkv_weight(grad=True), dense.qkv.weight.grad)
    par.all_reduce_replicated_kv_grads()
    out["dWqkv"] = _max(par.dense_qkv_weight(grad=True), dense.qkv.weight.grad)
    out["dbqkv"] = _max(par.dense_qkv_bias(grad=True), dense.qkv.bias.grad) if bias else 0.0
    out["Wqkv"] = _max(par.dense_qkv_weight(), dense.qkv.weight)
    n = b * s * dense.qkv.in_features
    out["comm"] = (
        tr.count("all_reduce", "forward"),
        tr.numel("all_reduce", "forward"),
        tr.count("all_reduce", "backward"),
        tr.numel("all_reduce", "backward"),
        tr.count(),
        n,
    )
    # dropout really acts: the same model without dropout gives another output
    dense.dropout_p = 0.0
    out["dropout_effect"] = _max(dense(x, step=3), yd)
    return out


CASES = [
    (6, 6, 1),  # MHA
    (6, 6, 2),
    (6, 6, 3),
    (4, 4, 4),
    (8, 2, 2),  # GQA, nkv == tp
    (8, 4, 2),  # GQA, nkv > tp
    (8, 2, 4),  # GQA, nkv < tp: KV heads replicated on 2 ranks each
    (6, 1, 3),  # MQA: one KV head replicated on every rank
]


@pytest.mark.parametrize("nq,nkv,tp,bias", [(*c, True) for c in CASES] + [(8, 2, 4, False)])
def test_parallel_equals_dense(nq, nkv, tp, bias):
    for r, out in enumerate(tpedu.launch(_compare_worker, tp, nq, nkv, 2, 5, bias)):
        for key in ("fwd", "dx", "dWo", "dbo", "dWqkv", "dbqkv", "Wqkv"):
            assert out[key] < TOL, f"rank {r}: max |{key} parallel - dense| = {out[key]:.3e}"
        fc, fn, bc, bn, total, n = out["comm"]
        assert (fc, fn, bc, bn, total) == (1, n, 1, n, 2), (
            f"rank {r}: expected 1 all-reduce of b·s·H={n} forward and 1 backward, got "
            f"fwd {fc} calls/{fn} elements, bwd {bc}/{bn}, {total} collectives in all"
        )
        assert out["dropout_effect"] > 1e-3, "dropout had no effect: the test would prove nothing"
        if "unsynced" in out:
            assert out["unsynced"] > 1e-3, "replicated KV grads matched before the sync?"


def _fused_worker(nq, nkv, causal):
    """No dropout drawn: both models take the fused (flash) path; compare them and the explicit
    ones. Returns the diffs, each model's largest saved tensor (numel) and the scores' sizes."""
    dense = _dense(nq, nkv, p=0.0).to(tpedu.device())
    dense.causal = causal
    par = ParallelAttention.from_dense(dense)
    explicit = _dense(nq, nkv, p=0.0).to(tpedu.device())
    explicit.load_state_dict(dense.state_dict())
    explicit.causal, explicit.fused = causal, False
    par_explicit = ParallelAttention.from_dense(explicit)  # the control: a rank's scores saved
    x = torch.randn(2, 7, 10, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    x = x.to(tpedu.device())
    out, saved = {}, {}
    models = {"dense": dense, "par": par, "explicit": explicit, "par explicit": par_explicit}
    for name, model in models.items():
        xi = x.clone().requires_grad_()
        sizes: list[int] = []
        pack = lambda t, log=sizes: log.append(t.numel()) or t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = model(xi)
        (y * x).sum().backward()
        out[name], saved[name] = (y.detach(), xi.grad), max(sizes)
    diffs = {
        "tp fwd": _max(out["par"][0], out["dense"][0]),
        "tp dx": _max(out["par"][1], out["dense"][1]),
        "fused vs explicit fwd": _max(out["dense"][0], out["explicit"][0]),
        "fused vs explicit dx": _max(out["dense"][1], out["explicit"][1]),
        "tp explicit fwd": _max(out["par explicit"][0], out["explicit"][0]),
    }
    tp = torch.distributed.get_world_size()
    return diffs, saved, 2 * nq * 7 * 7, 2 * (nq // tp) * 7 * 7  # b·a·s², a rank's b·(a/t)·s²


@pytest.mark.parametrize(
    "nq,nkv,tp,causal", [(6, 6, 1, True), (6, 6, 2, True), (8, 2, 4, True), (6, 3, 3, False)]
)
def test_fused_attention_equals_explicit_and_stores_no_scores(nq, nkv, tp, causal):
    """Without dropout both models run F.scaled_dot_product_attention: TP == dense, fused ==
    explicit (flash attention's online softmax sums in another order: ~1e-16 relative), and
    nothing of the scores' size is saved for backward: under b·a·s² for the dense model, under
    a rank's own b·(a/t)·s² for the TP one (both explicit paths save at least that much)."""
    for r, (diffs, saved, scores, local) in enumerate(
        tpedu.launch(_fused_worker, tp, nq, nkv, causal)
    ):
        for key, d in diffs.items():
            assert d < TOL, f"rank {r}: max |{key}| = {d:.3e}"
        assert saved["explicit"] >= scores, f"explicit path saved at most {saved['explicit']}"
        assert saved["par explicit"] >= local, f"rank {r}: explicit TP path saved {saved}"
        assert saved["dense"] < scores, f"fused path saved {saved['dense']} >= b·a·s² = {scores}"
        assert saved["par"] < local, f"rank {r}: fused TP path saved {saved['par']} >= {local}"


def _naive_chunk_worker():
    dense = _dense(4, 4, p=0.0)
    par = ParallelAttention.from_dense(dense)
    x = torch.randn(2, 5, 10, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    right = _max(par(x), dense(x))
    t, r = torch.distributed.get_world_size(), torch.distributed.get_rank()
    with torch.no_grad():  # the classic bug: chunk the fused [q|k|v] rows like a plain column
        par.qkv.weight.copy_(dense.qkv.weight.chunk(t)[r])
        par.qkv.bias.copy_(dense.qkv.bias.chunk(t)[r])
    return right, _max(par(x), dense(x))


def test_naive_chunk_of_fused_qkv_is_wrong():
    for right, wrong in tpedu.launch(_naive_chunk_worker, 2):
        assert right < TOL, f"max |parallel - dense| = {right:.3e}"
        assert wrong > 1e-2, f"naive chunking should be wrong, max diff only {wrong:.3e}"


def test_eval_mode_steps_and_non_causal():
    """Different steps draw different masks; eval mode switches dropout off in both models;
    without the causal mask TP still equals dense."""

    def worker():
        dense = _dense(4, 2)
        par = ParallelAttention.from_dense(dense)
        x = torch.randn(1, 6, 10, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
        steps = _max(dense(x, step=1), dense(x, step=2))
        tp_step = _max(par(x, step=2), dense(x, step=2))
        dense.eval(), par.eval()
        ev, ev_steps = _max(par(x), dense(x)), _max(dense(x, step=1), dense(x, step=2))
        causal = dense(x)
        dense.causal = par.causal = False  # bidirectional attention splits by heads just the same
        return steps, tp_step, ev, ev_steps, _max(par(x), dense(x)), _max(dense(x), causal)

    for steps, tp_step, ev, ev_steps, full, mask_effect in tpedu.launch(worker, 2):
        assert steps > 1e-3 and ev_steps == 0.0 and mask_effect > 1e-3
        assert max(tp_step, ev, full) < TOL, f"max diff {max(tp_step, ev, full):.3e}"


def test_layout_covers_every_row_once():
    """Without replication the ranks' rows partition the fused weight; with it, k/v repeat."""
    nq, nkv, d = 8, 4, 3
    for tp in (1, 2, 4):
        rows = torch.cat([qkv_rows(nq, nkv, d, tp, r) for r in range(tp)])
        assert sorted(rows.tolist()) == list(range((nq + 2 * nkv) * d))
    # tp=8 > nkv=4: rank r holds q head r and KV head r // 2
    for r in range(8):
        q, kv = local_heads(nq, nkv, 8, r)
        assert q == [r] and kv == [r // 2]
        rows = qkv_rows(nq, nkv, d, 8, r).tolist()
        k0, v0 = nq * d + kv[0] * d, (nq + nkv) * d + kv[0] * d
        want = [*range(r * d, r * d + d), *range(k0, k0 + d), *range(v0, v0 + d)]
        assert rows == want, f"rank {r}: rows {rows}, expected {want}"
    w = torch.arange((nq + 2 * nkv) * d, dtype=torch.float64)[:, None].repeat(1, 5)
    assert torch.equal(split_qkv(w, nq, nkv, 8, 3)[:, 0].long(), qkv_rows(nq, nkv, d, 8, 3))


@pytest.mark.parametrize(
    "nq,nkv,tp,msg",
    [
        (8, 8, 3, "8 heads are not divisible by tp=3; valid tp values: 1, 2, 4, 8"),
        (12, 4, 6, "4 KV heads can be neither split over nor replicated across tp=6"),
        (12, 4, 6, "valid tp values: 1, 2, 4, 12"),
        (6, 4, 2, "n_heads = 6 must be a positive multiple of n_kv_heads = 4"),
    ],
)
def test_divisibility_errors(nq, nkv, tp, msg):
    with pytest.raises(ValueError, match=msg):
        check_heads(nq, nkv, tp)


def test_construction_error_names_the_numbers():
    def worker():
        try:
            ParallelAttention.from_dense(_dense(4, 4))
        except ValueError as e:
            return str(e)
        return "no error"

    for msg in tpedu.launch(worker, 3):
        assert msg == "4 heads are not divisible by tp=3; valid tp values: 1, 2, 4", msg
