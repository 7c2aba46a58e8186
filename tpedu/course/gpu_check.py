"""Course infrastructure: the GPU checks, `make gpu-check` (`python -m tpedu.course.gpu_check`).

On a machine with CUDA GPUs this runs, in a few minutes, what the CPU test suite cannot show,
and prints one table (check, status, seconds, what was measured):

    one GPU, NCCL at world 1     a bf16 and an fp16 training step (losses vs fp32 on the CPU),
                                 TP == dense on the GPU, generation, checkpoint save and load,
                                 a resumed fp16 run bit-exact (is attention's backward
                                 deterministic?), a bad token id refused without a host sync
    two ranks on one GPU         $TPEDU_DEVICE=cuda puts every gloo rank's tensors on GPU 0:
                                 TP == dense at tp 2 over gloo's CUDA collectives; a collective
                                 gloo cannot run on CUDA tensors is reported, not hidden
    two or more GPUs             the same at tp 2 over NCCL, one GPU per rank
    ZeRO-3 (FSDP)                4 fp32 steps and a save/resume on the GPU (1 rank over NCCL,
                                 2 over NCCL with 2+ GPUs, else 2 on GPU 0 over gloo) against
                                 plain training on the CPU: flat buffers, storage freed and
                                 re-gathered, reduce-scatters, sharded checkpoints on CUDA
    --notebooks                  every lesson under nbval: over NCCL with 2+ GPUs, else with
                                 $TPEDU_DEVICE=cuda (all ranks on one GPU, gloo)
    throughput                   a GPT-2-small step in bf16: tokens/s and MFU against the GPU's
                                 dense bf16 peak (from a table of data-sheet figures)

`--device cpu` runs the same checks on CPU ranks (gloo), which is how the test suite keeps this
script's code path working on a machine without a GPU; its throughput line is not a GPU claim.
Exit code 0 when every check that ran passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tpedu import checkpoint
from tpedu.analysis.shape import ModelShape
from tpedu.comm.device import device
from tpedu.course.troubleshoot import compare_with_dense
from tpedu.launcher import launch
from tpedu.model import TPGPT, DenseGPT, GPTConfig
from tpedu.parallel.config import ParallelConfig
from tpedu.serve.generate import Sampling
from tpedu.train.config import TrainConfig
from tpedu.train.generate import generate
from tpedu.train.loop import train
from tpedu.train.optim import make_optimizer
from tpedu.train.step import build_model, train_step

U = 2.0**-8  # bf16 unit roundoff: the low-precision losses must stay within a few of it
SMALL = GPTConfig.gpt2_like(211, seq_len=32, n_layers=2, hidden=64, n_heads=4)
GPT2_SMALL = GPTConfig.gpt2_like(50257, seq_len=1024, n_layers=12, hidden=768, n_heads=12)
ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}


def _batch(config: GPTConfig, b: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (b, config.seq_len + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _first_losses(dtype: str, steps: int = 3) -> list[float]:
    """`steps` training steps of SMALL on this rank's device in `dtype`; their losses."""
    model = build_model(SMALL, seed=0)
    cfg = TrainConfig(steps=steps, batch=4, warmup=1, dtype=dtype)
    opt = make_optimizer(model, cfg)
    x, y = (t.to(device()) for t in _batch(SMALL, 4))
    return [train_step(model, opt, x, y, k, cfg)[0] for k in range(steps)]


def _tp_equals_dense() -> str:
    cmp = compare_with_dense(SMALL, None, _batch(SMALL, 3))  # float64: the same-arithmetic claim
    name, diff = cmp.worst
    if not cmp.ok:
        raise AssertionError(f"worst gradient {name} differs by {diff:.1e}")
    return f"{device()}: loss rel diff {cmp.loss_diff:.1e}, worst gradient {diff:.1e}"


def _generate_and_checkpoint(root: str) -> str:
    torch.manual_seed(0)
    state = DenseGPT(SMALL).state_dict()
    ids = generate(SMALL, state, [1, 2, 3], 8, Sampling(top_k=5))
    model = TPGPT.from_state_dict(SMALL, state).to(device())
    checkpoint.save(root, model, None, 1)
    back = TPGPT(DenseGPT(SMALL)).to(device())
    checkpoint.load(root, back)
    same = all(
        torch.equal(a, b) for a, b in zip(model.parameters(), back.parameters(), strict=True)
    )
    if not same or len(ids) != 11:
        raise AssertionError(f"generated {len(ids)} ids; checkpoint round trip equal: {same}")
    return f"{device()}: 8 tokens generated; save + load bit-exact"


def _bad_id_is_refused() -> str:
    """A token id outside the vocabulary must fail: a ValueError on the CPU, a device-side
    assert on CUDA (no host sync per forward; it surfaces at the next synchronisation)."""
    model = TPGPT(DenseGPT(SMALL)).to(device())
    ids = torch.full((1, 4), SMALL.vocab_size, dtype=torch.long, device=device())
    try:
        model(ids)
        if device().type == "cuda":
            torch.cuda.synchronize()
    except (ValueError, RuntimeError) as e:
        return f"{device()}: refused ({type(e).__name__}: {str(e).splitlines()[0][:60]})"
    raise AssertionError(f"token id {SMALL.vocab_size} of a {SMALL.vocab_size}-token model ran")


def _corpus() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, SMALL.vocab_size, (4000,), generator=g)


def _straight_and_resumed(
    cfg: TrainConfig, tmp: str, go: Callable[[TrainConfig], list[float]]
) -> tuple[list[float], list[float]]:
    """The losses of `go(cfg)` (4 steps), and of steps 2-3 resumed from a run that saved at
    step 2 under `tmp`."""
    straight = go(cfg)
    go(dataclasses.replace(cfg, ckpt_dir=tmp, save_every=2))
    return straight, go(dataclasses.replace(cfg, resume=f"{tmp}/step_00000002"))


RESUME_CFG = TrainConfig(steps=4, batch=4, warmup=1, eval_every=0, progress=False)


def _resume(tmp: str, backend: str) -> str:
    """4 fp16 steps straight vs 2, save, resume 2: the same losses, bit for bit? (On a GPU
    this also asks whether attention's backward is deterministic.)"""
    data = _corpus()

    def go(c: TrainConfig) -> list[float]:
        return launch(train, 1, SMALL, c, data, data, backend=backend)[0]["losses"]

    straight, resumed = _straight_and_resumed(
        dataclasses.replace(RESUME_CFG, dtype="fp16"), tmp, go
    )
    if resumed != straight[2:]:
        raise AssertionError(f"resumed losses {resumed} vs straight {straight[2:]}")
    return "fp16, save at step 2 of 4, resume: the same losses bit for bit"


ZERO_REL = 1e-4  # fp32 on another device sums in other orders (≈1e-6); a wrong shard is ≥1e-2


def _zero3(ranks: int, backend: str, tmp: str) -> str:
    """ZeRO-3 at dp `ranks` on this device: 4 fp32 steps straight, and 2 + save + resume 2,
    against plain training on the CPU (computed here, before any rank touches CUDA)."""
    data, cfg = _corpus(), RESUME_CFG
    on_gpu = os.environ.pop("TPEDU_DEVICE", None)  # the reference on CPU ranks
    try:
        ref = launch(train, 1, SMALL, cfg, data, data, backend="gloo")[0]["losses"]
    finally:
        if on_gpu is not None:
            os.environ["TPEDU_DEVICE"] = on_gpu
    par = ParallelConfig(dp=ranks, zero=3)

    def go(c: TrainConfig) -> list[float]:
        first = launch(train, ranks, SMALL, c, data, data, parallel=par, backend=backend)[0]
        return first["losses"]

    straight, resumed = _straight_and_resumed(cfg, tmp, go)
    gap = max(abs(a - b) / b for a, b in zip(straight + resumed, ref + ref[2:], strict=True))
    if gap > ZERO_REL:
        raise AssertionError(f"ZeRO-3 losses {straight}, resumed {resumed} vs CPU {ref}")
    return f"dp {ranks}: 4 steps and a resume; largest loss gap to the CPU {gap:.1e}"


def _throughput(config: GPTConfig, batch: int, steps: int) -> dict[str, float | str]:
    """Seconds of `steps` bf16 training steps after 2 of warm-up; tokens/s and TFLOP/s
    (ModelShape.flops_per_token: 6·N + 12·L·s·h per token)."""
    model = build_model(config, seed=0)
    cfg = TrainConfig(steps=steps + 2, batch=batch, warmup=1, dtype="bf16")
    opt = make_optimizer(model, cfg)
    x, y = (t.to(device()) for t in _batch(config, batch))
    for k in range(2):  # warm-up: kernels chosen, allocator filled
        train_step(model, opt, x, y, k, cfg)
    sync = torch.cuda.synchronize if device().type == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    for k in range(steps):
        train_step(model, opt, x, y, k, cfg)
    sync()
    seconds = (time.perf_counter() - t) / steps
    flops = ModelShape.from_config(config).flops_per_token() * batch * config.seq_len
    name = torch.cuda.get_device_name(device()) if device().type == "cuda" else "CPU"
    tokens = batch * config.seq_len / seconds
    return {"tokens_per_s": tokens, "tflops": flops / seconds / 1e12, "name": name}


def _peak(name: str) -> float | None:
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def run_checks(
    on: str, quick: bool = False, notebooks: bool = False
) -> list[tuple[str, str, float, str]]:
    """Every check for device `on` ("cuda" or "cpu"): rows (name, status, seconds, detail).
    `notebooks`: also every lesson under nbval (with 2+ GPUs over NCCL, with one GPU over gloo
    with every rank's tensors on it)."""
    rows: list[tuple[str, str, float, str]] = []
    gpus = torch.cuda.device_count() if on == "cuda" else 0
    single = "nccl" if on == "cuda" else "gloo"

    def check(name: str, fn: Callable[[], str]) -> None:
        t = time.perf_counter()
        try:
            status, detail = "ok", fn()
        except Exception as e:  # a failed check is a row, the others still run
            status, detail = "FAIL", str(e).splitlines()[0][:160]
        rows.append((name, status, time.perf_counter() - t, detail))

    def low_precision(dtype: str) -> str:
        ref = launch(_first_losses, 1, "fp32", backend="gloo")[0]  # CPU, fp32
        got = launch(_first_losses, 1, dtype, backend=single)[0]
        gap = max(abs(a - b) / b for a, b in zip(got, ref, strict=True))
        if gap > 4 * U:
            raise AssertionError(f"losses {got} vs fp32 {ref}: {gap:.1e} > 4u")
        return f"3 steps; largest loss gap to CPU fp32 {gap:.1e} (bound 4u = {4 * U:.1e})"

    check(f"bf16 train step, 1 rank ({single})", lambda: low_precision("bf16"))
    check(f"fp16 train step, 1 rank ({single})", lambda: low_precision("fp16"))
    check(f"TP == dense, 1 rank ({single})", lambda: launch(_tp_equals_dense, 1, backend=single)[0])
    with tempfile.TemporaryDirectory() as tmp:
        check(
            f"generate + checkpoint, 1 rank ({single})",
            lambda: launch(_generate_and_checkpoint, 1, tmp, backend=single)[0],
        )
    with tempfile.TemporaryDirectory() as tmp:
        check(f"resume bit-exact, 1 rank ({single})", lambda: _resume(tmp, single))
    check(
        f"bad token id refused, 1 rank ({single})",
        lambda: launch(_bad_id_is_refused, 1, backend=single)[0],
    )
    if on == "cuda":  # every rank's tensors on GPU 0, over gloo
        os.environ["TPEDU_DEVICE"] = "cuda"
        try:
            check("TP == dense, 2 ranks on GPU 0 (gloo)", lambda: _two_ranks("gloo"))
        finally:
            del os.environ["TPEDU_DEVICE"]
    if on == "cpu" or gpus >= 2:
        check(f"TP == dense, 2 ranks ({single})", lambda: _two_ranks(single))
    else:
        rows.append(("TP == dense, 2 ranks (nccl)", "skipped", 0.0, "needs 2 GPUs"))
    with tempfile.TemporaryDirectory() as tmp:
        check(f"ZeRO-3, 1 rank ({single})", lambda: _zero3(1, single, tmp))
    with tempfile.TemporaryDirectory() as tmp:
        if on == "cpu" or gpus >= 2:
            check(f"ZeRO-3, 2 ranks ({single})", lambda: _zero3(2, single, tmp))
        else:  # every rank's tensors on GPU 0, over gloo
            os.environ["TPEDU_DEVICE"] = "cuda"
            try:
                check("ZeRO-3, 2 ranks on GPU 0 (gloo)", lambda: _zero3(2, "gloo", tmp))
            finally:
                del os.environ["TPEDU_DEVICE"]

    config, batch, steps = (SMALL, 4, 2) if quick or on == "cpu" else (GPT2_SMALL, 8, 10)

    def throughput() -> str:
        r = launch(_throughput, 1, config, batch, steps, backend=single)[0]
        name = r["name"]  # asked on the rank: CUDA must not start in this, the forking process
        peak = _peak(name) if on == "cuda" else None
        mfu = f", MFU {100 * r['tflops'] / peak:.0f} % of {peak:.0f}" if peak else ""
        size = "GPT-2 small" if config is GPT2_SMALL else "a tiny GPT"
        return f"{size}, bf16, {name}: {r['tokens_per_s']:,.0f} tokens/s, {r['tflops']:.2f} TFLOP/s{mfu}"

    check("throughput, 1 rank", throughput)
    if notebooks:
        env = {"TPEDU_BACKEND": "nccl"} if gpus >= 2 else {"TPEDU_DEVICE": "cuda"}
        if on == "cpu":
            env = {"TPEDU_BACKEND": "gloo"}
        for nb in sorted(NOTEBOOKS.glob("*.ipynb")):
            check(f"nbval {nb.name[:30]}", lambda nb=nb: _nbval(nb, env))
    return rows


def _nbval(notebook: Path, env: dict[str, str]) -> str:
    """One notebook under nbval with `env` (a GPU run's outputs may differ from the stored CPU
    ones only where nbval_sanitize.cfg masks rounding)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval"]
    cmd += ["--nbval-current-env", "--nbval-sanitize-with", str(ROOT / "nbval_sanitize.cfg")]
    p = subprocess.run(
        [*cmd, str(notebook)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TPEDU_IMPL": "solutions", **env},
        cwd=ROOT,
    )
    last = (p.stdout.strip().splitlines() or ["no output"])[-1]
    if p.returncode:
        raise AssertionError(last)
    return f"{' '.join(f'{k}={v}' for k, v in env.items())}: {last}"


def _two_ranks(backend: str) -> str:
    return launch(_tp_equals_dense, 2, backend=backend)[0]


def table(rows: list[tuple[str, str, float, str]]) -> str:
    lines = [f"{'check':<42} {'status':<8} {'s':>6}  detail", "-" * 110]
    lines += [f"{n:<42} {s:<8} {t:>6.1f}  {d}" for n, s, t, d in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="tpedu's GPU checks (see the module docstring)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--quick", action="store_true", help="a tiny model for the throughput line")
    ap.add_argument("--notebooks", action="store_true", help="also every lesson under nbval")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; `--device cpu` runs the same checks on CPU ranks")
        return 2
    rows = run_checks(args.device, args.quick, args.notebooks)
    print(table(rows))
    return 0 if all(s != "FAIL" for _, s, _, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
