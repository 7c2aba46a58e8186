"""Mixed precision (tpedu.train.precision): bf16 / fp16 compute under autocast with fp32 master
weights, fp16 loss scaling, checkpoints and resume.

The unit roundoff of bf16 is u = 2⁻⁸ (8 significand bits): every rounding to bf16 changes a
value by at most u relatively. That fixes the tolerances below; each is derived where it is used.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist

from tpedu import checkpoint, launch
from tpedu.analysis.memory import BytesPerParam, ledger, measure_training_bytes
from tpedu.analysis.shape import ModelShape
from tpedu.comm.tracer import CommTracer
from tpedu.model import TPGPT, DenseGPT, GPTConfig
from tpedu.parallel.config import ParallelConfig
from tpedu.tp.layers import row_parallel_linear
from tpedu.tp.sharding import rank_chunk
from tpedu.train.config import TrainConfig
from tpedu.train.loop import train
from tpedu.train.optim import make_optimizer
from tpedu.train.precision import LossScaler
from tpedu.train.step import train_step

U = 2.0**-8  # bf16 unit roundoff
V = 41
GPT2 = GPTConfig.gpt2_like(V, seq_len=16, n_layers=2, hidden=32, n_heads=4)
LLAMA = GPTConfig.llama_like(V, seq_len=16, n_layers=2, hidden=32, n_heads=4)
CFG = TrainConfig(steps=6, batch=8, lr=1e-2, warmup=1, eval_every=0, progress=False)


def data():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, V, (2000,), generator=g), torch.randint(0, V, (400,), generator=g)


def _row_parallel_bf16(x: torch.Tensor, w: torch.Tensor):
    t, r = dist.get_world_size(), dist.get_rank()
    xs, ws = rank_chunk(x, -1, r, t), rank_chunk(w, -1, r, t)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = row_parallel_linear(xs, ws, None)
    # |partial r| in float64, from the bf16-rounded inputs the matmul really multiplied
    part = (xs.bfloat16().double() @ ws.bfloat16().double().T).abs()
    dist.all_reduce(part)
    return y.double(), part


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_row_parallel_bf16_is_within_the_rounding_bound_of_dense_bf16(tp):
    """Autocast rounds x and W to bf16 the same way on every layout (a shard is a slice). Dense
    then rounds the exact sum once: |y_d − ŷ| ≤ u·|ŷ|. TP rounds each rank's partial sum ŷ_r
    (≤ u·|ŷ_r|) and the bf16 all-reduce rounds each of its t − 1 additions (≤ u·Σ|ŷ_r| each),
    so |y_tp − y_d| ≤ (t + 1)·u·Σ_r|ŷ_r|, to first order in u (the margin below is for the
    second-order terms and the fp32 accumulation inside each matmul, ≈ in·2⁻²⁴)."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(6, 5, 48, generator=g), torch.randn(24, 48, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        dense = torch.nn.functional.linear(x, w).double()
    for y, part in launch(_row_parallel_bf16, tp, x, w):
        assert y.dtype == torch.float64 and (y != dense).any() or tp == 1
        bound = (tp + 1) * U * part * 1.01 + 1e-6
        excess = ((y - dense).abs() - bound).max().item()
        assert excess <= 0, f"tp={tp}: the difference exceeds the bound by {excess:.2e}"


def _loss_and_grads(config: GPTConfig, dtype: torch.dtype | None):
    torch.manual_seed(0)
    dense = DenseGPT(config)
    model = TPGPT(dense)
    g = torch.Generator().manual_seed(1)
    ids, tgt = (torch.randint(0, V, (4, 16), generator=g) for _ in range(2))
    ctx = torch.autocast("cpu", dtype=dtype) if dtype else torch.autocast("cpu", enabled=False)
    with ctx:
        loss = model(ids, tgt)
    loss.backward()
    model.sync_grads()
    with CommTracer() as trace:
        with ctx:
            model(ids, tgt)
    return loss.item(), model.gather_state_dict(grads=True), trace.wire_bytes(phase="forward")


@pytest.mark.parametrize("config", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_bf16_tp_tracks_fp32_and_its_all_reduces_carry_bf16(config):
    """At tp 1, 2, 4: the bf16 loss is within 4u of fp32's (a few roundings of 8 bits each on
    the way to a loss of order 1; measured ≤ 1e-3 relative), every gradient within 0.1 of its
    tensor's largest fp32 entry (gradients are differences of rounded terms: measured ≤ 3 %),
    and bf16 halves the bytes the forward's TP collectives send."""
    ref_loss, ref_grads, _ = launch(_loss_and_grads, 1, config, None)[0]
    sent = {}
    for tp in (1, 2, 4):
        fp32 = launch(_loss_and_grads, tp, config, None)[0]
        loss, grads, sent[tp] = launch(_loss_and_grads, tp, config, torch.bfloat16)[0]
        assert abs(loss - ref_loss) <= 4 * U * abs(ref_loss), (tp, loss, ref_loss)
        for k, ref in ref_grads.items():
            err = (grads[k].double() - ref.double()).abs().max().item()
            assert err <= 0.1 * ref.abs().max().item() + 1e-6, (tp, k, err)
        if tp > 1:
            assert 0 < sent[tp] < 0.75 * fp32[2], (tp, sent[tp], fp32[2])


def test_bf16_and_fp16_training_track_fp32():
    """20 steps at tp 2 and at pp 2 × dp 2: every step's loss within 4u relative of fp32's
    (measured: ≤ 5e-5 on this model: its weights are small, so few bits are lost)."""
    tr, va = data()
    steps = dataclasses.replace(CFG, steps=20)
    for parallel in (ParallelConfig(tp=2), ParallelConfig(pp=2, dp=2)):
        ref = launch(train, parallel.world, GPT2, steps, tr, va, parallel=parallel)[0]["losses"]
        for dtype in ("bf16", "fp16"):
            low = dataclasses.replace(steps, dtype=dtype)
            got = launch(train, parallel.world, GPT2, low, tr, va, parallel=parallel)[0]["losses"]
            assert got != ref  # the low precision really ran
            for a, b in zip(got, ref, strict=True):
                assert abs(a - b) <= 4 * U * b, (parallel, dtype, a, b)


def _overflow_step(init_scale: float, growth_interval: int, steps: int):
    torch.manual_seed(0)
    model = TPGPT(DenseGPT(GPT2))
    opt = make_optimizer(model, CFG)
    scaler = LossScaler(init_scale=init_scale, growth_interval=growth_interval)
    cfg = dataclasses.replace(CFG, dtype="fp16")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = (
        torch.randint(0, V, (4, 16), generator=torch.Generator().manual_seed(s)) for s in (1, 2)
    )
    norms = [train_step(model, opt, x, y, k, cfg, scaler)[1] for k in range(steps)]
    same = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    return norms, scaler.state_dict(), same, len(opt.state)


def test_an_overflow_skips_the_step_and_halves_the_scale():
    """A scale of 2¹²⁸ overflows fp32 (max ≈ 2¹²⁸): the gradients are inf on every rank, the
    step is skipped (weights and AdamW states untouched), the scale halves."""
    for norms, state, same, n_states in launch(_overflow_step, 2, 2.0**128, 1000, 1):
        assert norms == [math.inf] and same and n_states == 0
        assert state == {"scale": 2.0**127, "clean_steps": 0, "skipped": 1}


def test_the_scale_grows_after_clean_steps():
    for norms, state, same, _ in launch(_overflow_step, 2, 1024.0, 2, 5):
        assert all(math.isfinite(n) for n in norms) and not same
        assert state == {"scale": 4096.0, "clean_steps": 1, "skipped": 0}  # grew after 2 and 4


def _one_rank_overflows():
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 8.0)
    if dist.get_rank() == 1:
        p.grad[1] = math.inf  # only this TP rank's shard overflowed
    return LossScaler(init_scale=8.0).unscale_and_check([p]), p.grad[0].item()


def test_every_rank_agrees_to_skip_when_one_shard_overflows():
    assert launch(_one_rank_overflows, 2) == [(True, 1.0), (True, 1.0)]


@pytest.mark.parametrize("parallel", [ParallelConfig(tp=2), ParallelConfig(pp=2)], ids=["tp", "pp"])
def test_fp16_resume_is_bit_exact_and_keeps_fp32_masters_and_the_scale(tmp_path, parallel):
    """Saved after 3 of 6 steps and resumed == 6 straight, bit for bit, losses and the loss
    scale's state; the checkpoint holds fp32 weights (the master weights) and the scaler; a
    reshard keeps both. (A scale that is a power of two changes no rounding: the losses alone
    could not tell a restarted scale from a restored one.)"""
    tr, va = data()
    six = dataclasses.replace(CFG, dtype="fp16", loss_scale_window=2)  # grows at 2, 4, 6
    straight = launch(train, parallel.world, GPT2, six, tr, va, parallel=parallel)[0]
    assert straight["loss_scale"] == {"scale": 2.0**19, "clean_steps": 0, "skipped": 0}
    saving = dataclasses.replace(six, save_every=3, ckpt_dir=str(tmp_path / "ck"))
    launch(train, parallel.world, GPT2, saving, tr, va, parallel=parallel)
    step3 = tmp_path / "ck" / "step_00000003"
    _, index = checkpoint.read_index(step3)
    assert index["loss_scaler"] == {"scale": 2.0**17, "clean_steps": 1, "skipped": 0}
    assert index["train"]["dtype"] == "fp16"
    assert {e["dtype"] for k, e in index["tensors"].items() if "/" not in k} == {"F32"}
    resume = dataclasses.replace(six, resume=str(step3))
    resumed = launch(train, parallel.world, GPT2, resume, tr, va, parallel=parallel)[0]
    assert resumed["losses"] == straight["losses"][3:]
    assert resumed["loss_scale"] == straight["loss_scale"]  # the scale continued, not restarted
    out = checkpoint.reshard(step3, tmp_path / "tp4", tp=4)
    _, moved = checkpoint.read_index(out)
    assert moved["loss_scaler"] == index["loss_scaler"]
    _, a, _ = checkpoint.read_dense(step3)
    _, b, _ = checkpoint.read_dense(out)
    assert all(torch.equal(a[k], b[k]) and b[k].dtype == torch.float32 for k in a if "/" not in k)


def _bytes_after_bf16_step():
    torch.manual_seed(0)
    model = TPGPT(DenseGPT(GPT2))
    opt = make_optimizer(model, CFG)
    x = torch.randint(0, V, (4, 16), generator=torch.Generator().manual_seed(1))
    train_step(model, opt, x, x, 0, dataclasses.replace(CFG, dtype="bf16"))
    return measure_training_bytes(model, opt)


def test_bytes_per_parameter_on_a_real_rank_equal_the_ledger_row():
    """AMP keeps fp32 weights (the masters), fp32 gradients and two fp32 AdamW moments:
    4 + 4 + 8 = 16 B per parameter, measured on each rank of tp 2, equal to the ledger's row
    with those byte counts (Megatron's bf16 row is 2 + 2 + 12, also 16)."""
    row = ledger(ModelShape.from_config(GPT2), tp=2, per_param=BytesPerParam(4, 4, 8))
    for m in launch(_bytes_after_bf16_step, 2):
        assert (m.weights, m.gradients, m.optimizer) == (4 * m.params, 4 * m.params, 8 * m.params)
        assert (m.params, m.weights, m.gradients, m.optimizer) == (
            row.params,
            row.weights,
            row.gradients,
            row.optimizer,
        )


def _dp_reduce(reduce_dtype: torch.dtype | None):
    from tpedu.parallel.data_parallel import DataParallel

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)  # the same init on every rank; each rank its own data
    dpar = DataParallel(model, reduce_dtype=reduce_dtype, bucket_numel=1000)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(dist.get_rank()))
    with CommTracer() as trace:
        model(x).square().mean().backward()
        dpar.finish()
    local = model.weight.grad.clone()  # the average, after finish(); the rank's own below
    model.weight.grad = None
    model(x).square().mean().backward()
    own = model.weight.grad.double().abs()
    dist.all_reduce(own)
    return local, own, trace.wire_bytes()


@pytest.mark.parametrize("dp", [2, 4])
def test_a_bf16_gradient_all_reduce_sends_half_the_bytes_within_its_rounding_bound(dp):
    """Each replica's gradient is rounded to bf16 (≤ u·|g_i|), and each of the ring's N − 1
    additions rounds again (≤ u·Σ|g_i|): |mean_bf16 − mean_fp32| ≤ N·u·Σ|g_i| / N = u·Σ|g_i|
    to first order. Measured beside it: the largest difference, as a share of the bound."""
    exact = launch(_dp_reduce, dp, None)
    low = launch(_dp_reduce, dp, torch.bfloat16)
    for (g32, own, b32), (g16, _, b16) in zip(exact, low, strict=True):
        assert b16 == b32 / 2
        diff = (g16.double() - g32.double()).abs()
        assert (diff > 0).any()  # bf16 really rounded
        assert (diff <= U * own * 1.01 + 1e-9).all(), (diff / (U * own)).max().item()
