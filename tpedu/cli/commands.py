"""The tpedu command line. Every subcommand works two ways:

    python -m tpedu hello --nprocs 2                       # launches its own local ranks
    torchrun --nproc_per_node 2 -m tpedu hello             # joins the ranks torchrun started

Subcommands:
    hello       every rank reports in; an all-reduce is checked against its formula
    commbench   time collectives, fit the α-β model, print predicted vs measured
    train       train the tensor-parallel GPT on 红楼梦 (--tp N ranks), print a JSON summary;
                with --pp P --dp D: 3D parallel on tp·pp·dp ranks
    generate    continue a prompt with a trained model (--model DIR --prompt ...)
    reshard     rewrite a sharded checkpoint for another (tp, pp, dp), or export it (one process)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from tpedu.checkpoint.convert import load_model_files
from tpedu.comm import collectives as C
from tpedu.comm import cost_model
from tpedu.launcher import LaunchTimeout, RankError, device, run, under_torchrun
from tpedu.model.config import GPTConfig
from tpedu.parallel.pipeline.schedules import partition, schedule
from tpedu.train.data.corpus import novel_data
from tpedu.train.generate import generate, generation_config
from tpedu.train.loop import TrainConfig, default_micro_batches, train, train_3d


def hello() -> dict:
    """Each rank prints who it is; the sum of all ranks is checked against t(t-1)/2."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.tensor([float(rank)], device=device())
    C.all_reduce(x)
    expected = world * (world - 1) / 2
    ok = x.item() == expected
    # One write per line: under torchrun every rank shares the terminal, and print's separate
    # write of "\n" lets another rank's line land in the middle of this one.
    line = (
        f"rank {rank} of {world} on {dist.get_backend()}: all_reduce(rank) = {x.item():g} "
        f"(expected {expected:g}) {'✓' if ok else '✗'}\n"
    )
    print(line, end="", flush=True)
    if not ok:
        raise RuntimeError(f"all_reduce gave {x.item()}, expected {expected}")
    return {"rank": rank, "world_size": world, "sum": x.item()}


def commbench(sizes: list[int], repeats: int) -> list[cost_model.Sample]:
    """Time all-reduce, all-gather and reduce-scatter at each size; fit α, β on rank 0."""
    samples = []
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        samples += cost_model.measure(op, sizes, repeats=repeats)
    if dist.get_rank() == 0:
        model = cost_model.fit(samples)
        print(f"fitted α = {model.alpha * 1e6:.1f} µs, β⁻¹ = {model.bandwidth / 1e9:.2f} GB/s")
        print(f"{'op':<15} {'bytes':>10} {'measured ms':>12} {'predicted ms':>13}")
        for s in samples:
            pred = model.predict(s.op, s.nbytes, s.world_size)
            print(f"{s.op:<15} {s.nbytes:>10,} {s.seconds * 1e3:>12.3f} {pred * 1e3:>13.3f}")
    return samples


def _common(s: argparse.ArgumentParser, ranks_flag: str = "--nprocs") -> None:
    s.add_argument(ranks_flag, type=int, default=2, dest="nprocs",
                   help="local ranks (under torchrun: must equal the world size)")  # fmt: skip
    s.add_argument("--backend", choices=["gloo", "nccl"], default=None)
    s.add_argument("--timeout", type=float, default=600.0,
                   help="seconds a rank may wait on the others before the run fails as a hang")  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tpedu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = p.add_subparsers(dest="command", required=True)
    _common(sub.add_parser("hello", help="check that ranks start and talk"))
    bench = sub.add_parser("commbench", help="fit the α-β collective cost model")
    _common(bench)
    bench.add_argument("--sizes", type=int, nargs="+", default=[4096, 65536, 1 << 20, 1 << 22])
    bench.add_argument("--repeats", type=int, default=5)

    tr = sub.add_parser("train", help="train the tensor-parallel GPT on 红楼梦")
    _common(tr, "--tp")
    tr.add_argument("--arch", choices=["gpt2", "llama"], default="gpt2")
    tr.add_argument("--layers", type=int, default=2)
    tr.add_argument("--hidden", type=int, default=128)
    tr.add_argument("--heads", type=int, default=4)
    tr.add_argument("--kv-heads", type=int, default=None, help="grouped-query attention")
    tr.add_argument("--seq", type=int, default=128)
    tr.add_argument("--batch", type=int, default=8)
    tr.add_argument("--steps", type=int, default=200)
    tr.add_argument("--lr", type=float, default=3e-3)
    tr.add_argument("--dropout", type=float, default=0.0)
    tr.add_argument("--tokenizer", choices=["char", "bpe"], default="char")
    tr.add_argument("--bpe-vocab", type=int, default=4096)
    tr.add_argument("--replicated-embedding", action="store_true",
                    help="keep the whole embedding on every rank instead of splitting the vocabulary")  # fmt: skip
    tr.add_argument("--sequence-parallel", action="store_true",
                    help="shard norms, dropout and residuals along the sequence (lesson 08)")  # fmt: skip
    tr.add_argument("--overlap-comm", action="store_true",
                    help="overlap each f's backward all-reduce with dL/dW (lesson 14; same result)")  # fmt: skip
    tr.add_argument("--eval-every", type=int, default=50)
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--out", default=None, help="directory to save the trained model in")
    tr.add_argument("--json", default=None, help="also write the full summary (all losses) here")
    tr.add_argument("--pp", type=int, default=1, help="pipeline stages (lesson 10)")
    tr.add_argument("--dp", type=int, default=1, help="data-parallel replicas (lesson 11)")
    tr.add_argument("--micro-batches", type=int, default=None,
                    help="micro-batches per step with --pp (default: the largest ≤ 2·pp dividing batch/dp)")  # fmt: skip
    tr.add_argument("--zero1", action="store_true", help="shard AdamW's states over --dp ranks")
    tr.add_argument("--schedule", choices=["1f1b", "gpipe", "interleaved"], default="1f1b",
                    help="pipeline schedule with --pp (lesson 10)")  # fmt: skip
    tr.add_argument("--chunks", type=int, default=1,
                    help="model chunks per pipeline rank (--schedule interleaved)")  # fmt: skip
    tr.add_argument("--stage-split", choices=["even", "flops"], default="even",
                    help="blocks per pipeline stage: even, or by FLOPs counting the head (lesson 10)")  # fmt: skip
    tr.add_argument("--ckpt-dir", default=None, help="write sharded checkpoints here (lesson 13)")
    tr.add_argument("--save-every", type=int, default=0,
                    help="checkpoint every N steps (and at the end) into --ckpt-dir")  # fmt: skip
    tr.add_argument("--resume", default=None,
                    help="continue from this checkpoint (any layout; its model config is used)")  # fmt: skip

    gen = sub.add_parser("generate", help="continue a prompt with a trained model")
    _common(gen, "--tp")
    gen.add_argument("--model", required=True, help="directory written by `train --out`")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new-tokens", type=int, default=100)
    gen.add_argument("--temperature", type=float, default=0.8)
    gen.add_argument("--top-k", type=int, default=50)
    gen.add_argument("--seed", type=int, default=0)

    rs = sub.add_parser("reshard", help="rewrite a checkpoint for another layout, or export it")
    rs.add_argument("src", help="a checkpoint (step dir, or its parent with `latest`), or a dense "
                    "model dir (`train --out`) to import")  # fmt: skip
    rs.add_argument("--out", required=True, help="the new checkpoint's (or export's) directory")
    rs.add_argument("--tp", type=int, default=1)
    rs.add_argument("--pp", type=int, default=1)
    rs.add_argument("--dp", type=int, default=1)
    rs.add_argument("--zero1", action="store_true", help="record a ZeRO-1 layout")
    rs.add_argument("--to", choices=["sharded", "dense", "hf"], default="sharded",
                    help="dense: a `train --out` model dir; hf: GPT-2 for transformers")  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "reshard":  # one process, no ranks
        return _reshard(args)
    _check_ranks(args)
    _check_args(args)
    try:
        if args.command == "hello":
            run(hello, args.nprocs, backend=args.backend, timeout=args.timeout)
        elif args.command == "commbench":
            run(commbench, args.nprocs, args.sizes, args.repeats, backend=args.backend,
                timeout=args.timeout)  # fmt: skip
        elif args.command == "train":
            return _train(args)
        else:
            return _generate(args)
    except (RankError, LaunchTimeout) as e:
        print(f"tpedu {args.command}: {e}", file=sys.stderr)
        return 1
    return 0


def _check_ranks(args: argparse.Namespace) -> None:
    flag = "--tp" if args.command in ("train", "generate") else "--nprocs"
    if args.nprocs < 1:
        _fail(f"{flag} must be at least 1, got {args.nprocs}")
    for name in ("pp", "dp"):  # train's 3D layout: tp·pp·dp ranks
        if getattr(args, name, 1) < 1:
            _fail(f"--{name} must be at least 1, got {getattr(args, name)}")
    others = getattr(args, "pp", 1) * getattr(args, "dp", 1)
    if args.backend == "nccl":  # one GPU per rank on this machine
        gpus = torch.cuda.device_count()
        here = (
            int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
            if under_torchrun()
            else args.nprocs * others
        )
        if here > gpus:
            _fail(f"--backend nccl needs one GPU per rank: {here} ranks on this machine, {gpus} "
                  f"GPUs visible; use at most {gpus} ranks here, or --backend gloo")  # fmt: skip
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if flag == "--tp" and others > 1 and args.nprocs * others != world:
            _fail(f"--tp {args.nprocs} × --pp {args.pp} × --dp {args.dp} = "
                  f"{args.nprocs * others} ranks does not match torchrun's world size {world}; "
                  f"choose tp·pp·dp = {world} or start {args.nprocs * others} processes")  # fmt: skip
        if flag == "--tp" and others == 1 and args.nprocs != world:
            _fail(f"--tp {args.nprocs} does not match torchrun's world size {world}; "
                  f"pass --tp {world} or start {args.nprocs} processes")  # fmt: skip
        args.nprocs = world // others
        return
    cores = os.cpu_count() or 1
    if args.backend != "nccl" and args.nprocs * others > 4 * cores:
        what = f"{flag} {args.nprocs}" if others == 1 else f"tp·pp·dp = {args.nprocs * others}"
        _fail(f"{what} is more than 4 ranks per core on this {cores}-core "
              "machine; use fewer ranks or a bigger machine")  # fmt: skip


def _check_args(args: argparse.Namespace) -> None:
    """One-line errors for values the ranks would only trip over later (after _check_ranks)."""
    if args.command == "commbench":
        if args.nprocs < 2:
            _fail(f"--nprocs {args.nprocs}: commbench needs at least 2 ranks (one rank "
                  "communicates nothing, so α and β cannot be fitted)")  # fmt: skip
        if args.repeats < 1:
            _fail(f"--repeats {args.repeats}: must be at least 1 (timed runs per size)")
        if min(args.sizes) < 1:
            _fail(f"--sizes {min(args.sizes)}: sizes are bytes, each must be at least 1")
        if len(set(args.sizes)) < 2:
            _fail(f"--sizes needs at least 2 different sizes to fit α and β, got "
                  f"{sorted(set(args.sizes))}; e.g. --sizes 4096 1048576")  # fmt: skip
    elif args.command == "train":
        for name in ("layers", "hidden", "seq", "batch", "steps"):
            if getattr(args, name) < 1:
                _fail(f"--{name} must be at least 1, got {getattr(args, name)}")
        if args.save_every and not args.ckpt_dir:
            _fail("--save-every needs --ckpt-dir (where to write the checkpoints)")
        for flag, value in (("--out", args.out), ("--ckpt-dir", args.ckpt_dir)):
            if value is not None:
                _check_dir(flag, value)
    elif args.command == "generate":
        if args.top_k < 1:
            _fail(f"--top-k {args.top_k}: must be at least 1 (a value at least the vocabulary "
                  "size samples from the whole vocabulary)")  # fmt: skip
        if not args.temperature >= 0:
            _fail(f"--temperature {args.temperature}: must be at least 0 (0 always picks the "
                  "most likely token, 1 samples the model's distribution)")  # fmt: skip


def _check_dir(flag: str, value: str) -> None:
    """`value` must be a directory, or a path that does not exist yet (under no file)."""
    for path in (Path(value), *Path(value).parents):
        if path.exists():
            if not path.is_dir():
                _fail(f"{flag} {value}: {path} is a file, not a directory; give a directory "
                      "(a missing one is created)")  # fmt: skip
            return


def _train(args: argparse.Namespace) -> int:

    saved = _read_resume(args)  # with --resume, the checkpoint's model config
    if args.pp * args.dp > 1 or args.micro_batches or args.zero1 or args.chunks > 1:
        _check_layout(args, saved.n_layers if saved else args.layers)
    try:
        tok, train_ids, val_ids = novel_data(args.tokenizer, args.bpe_vocab)
    except FileNotFoundError as e:
        _fail(str(e))
    preset = GPTConfig.llama_like if args.arch == "llama" else GPTConfig.gpt2_like
    kv = {"n_kv_heads": args.kv_heads} if args.kv_heads or args.arch == "gpt2" else {}
    config = preset(tok.vocab_size, seq_len=args.seq, n_layers=args.layers, hidden=args.hidden,
                    n_heads=args.heads, dropout=args.dropout,
                    vocab_parallel=not args.replicated_embedding,
                    sequence_parallel=args.sequence_parallel, overlap_comm=args.overlap_comm,
                    stage_split=args.stage_split,
                    **kv)  # fmt: skip
    if saved is not None:
        config = _resume_config(args, saved, config, tok.vocab_size)
    try:
        config.check(args.nprocs)
    except ValueError as e:
        _fail(str(e))
    cfg = TrainConfig(steps=args.steps, batch=args.batch, lr=args.lr, min_lr=args.lr / 10,
                      warmup=min(20, args.steps // 10 + 1), eval_every=args.eval_every,
                      seed=args.seed, ckpt_dir=args.ckpt_dir, save_every=args.save_every,
                      resume=args.resume)  # fmt: skip
    if args.pp * args.dp > 1 or args.micro_batches or args.zero1 or args.chunks > 1:
        results = run(train_3d, args.nprocs * args.pp * args.dp, config, cfg, train_ids,
                      val_ids, args.nprocs, args.pp, args.dp, args.micro_batches, args.zero1,
                      args.schedule, out=args.out, tok=tok, chunks=args.chunks,
                      backend=args.backend, timeout=None,
                      collective_timeout=args.timeout, stream=True)  # fmt: skip
    else:
        results = run(train, args.nprocs, config, cfg, train_ids, val_ids, args.out, tok,
                      backend=args.backend, timeout=None, collective_timeout=args.timeout,
                      stream=True)  # fmt: skip
    if int(os.environ.get("RANK", "0")) == 0:
        summary = results[0]
        if args.json:
            Path(args.json).write_text(json.dumps(summary, indent=2))
        print(json.dumps({k: v for k, v in summary.items() if k != "losses"}, indent=2))
    return 0


def _check_layout(args: argparse.Namespace, n_layers: int) -> None:
    """The 3D layout's one-line errors, before any rank starts (n_layers: the model's, which
    with --resume is the checkpoint's, not --layers)."""

    if args.batch % args.dp:
        _fail(f"--batch {args.batch} is not divisible by --dp {args.dp}; "
              f"use a multiple of {args.dp}")  # fmt: skip
    per_replica = args.batch // args.dp
    if args.micro_batches is not None and (
        args.micro_batches < 1 or per_replica % args.micro_batches
    ):
        _fail(f"--micro-batches {args.micro_batches} does not divide the per-replica batch "
              f"{per_replica} (= batch / dp); choose a divisor of {per_replica}")  # fmt: skip
    try:
        partition(n_layers, args.pp * args.chunks)
    except ValueError as e:
        whose = f" (the model in --resume {args.resume})" if args.resume else ""
        _fail(f"--pp {args.pp}{f' --chunks {args.chunks}' if args.chunks > 1 else ''}{whose}: {e}")
    try:
        m = args.micro_batches or default_micro_batches(per_replica, args.pp)
        schedule(args.schedule, m, args.pp, 0, args.chunks)
    except ValueError as e:
        _fail(f"--schedule {args.schedule} --chunks {args.chunks}: {e}")


def _read_resume(args: argparse.Namespace) -> object | None:
    """The model config of the --resume checkpoint (None without --resume)."""
    from tpedu import checkpoint

    if not args.resume:
        return None
    try:
        return checkpoint.read_config(args.resume)
    except (ValueError, FileNotFoundError) as e:  # CheckpointError is a ValueError
        _fail(str(e))


def _resume_config(args: argparse.Namespace, saved: object, config: object,
                   vocab_size: int) -> object:  # fmt: skip
    """The checkpoint's model config `saved`, with its layout-only fields from the flags."""
    from dataclasses import replace

    from tpedu import checkpoint

    if saved.vocab_size != vocab_size:
        _fail(f"{args.resume} has vocab_size {saved.vocab_size}, the --tokenizer "
              f"{args.tokenizer} gives {vocab_size}; pass the tokenizer it was trained with")  # fmt: skip
    return replace(saved, **{k: getattr(config, k) for k in checkpoint.LAYOUT_ONLY})


def _reshard(args: argparse.Namespace) -> int:
    from tpedu import checkpoint

    src = Path(args.src)
    dense_dir = (src / "model.safetensors").exists()  # `train --out`: import (or export) it
    try:
        if dense_dir and args.to == "dense":
            _fail(f"{src} is already a dense model dir (`train --out`); use --to sharded to "
                  "import it as a checkpoint, or --to hf to export it for transformers")  # fmt: skip
        elif dense_dir and args.to == "hf":
            with tempfile.TemporaryDirectory() as tmp:  # export_hf reads a checkpoint: make one
                path = checkpoint.export_hf(checkpoint.import_dense(src, tmp), args.out)
        elif dense_dir:
            path = checkpoint.import_dense(src, args.out, args.tp, args.pp, args.dp)
        elif args.to == "dense":
            path = checkpoint.export_dense(src, args.out)
        elif args.to == "hf":
            path = checkpoint.export_hf(src, args.out)
        else:
            path = checkpoint.reshard(src, args.out, args.tp, args.pp, args.dp, args.zero1)
    except (ValueError, FileNotFoundError) as e:  # CheckpointError is a ValueError
        _fail(str(e))
    print(checkpoint.summary(path) if (path / checkpoint.INDEX).exists() else f"wrote {path}")
    return 0


def _generate(args: argparse.Namespace) -> int:

    if not args.prompt.strip():
        _fail("--prompt is empty; give some text to continue, e.g. --prompt '宝玉'")
    try:
        config, state, tok = load_model_files(args.model)
        config = generation_config(config)  # a model trained with --sequence-parallel too
        config.check(args.nprocs)
    except (FileNotFoundError, ValueError) as e:
        _fail(str(e))
    prompt = tok.encode(args.prompt)
    results = run(generate, args.nprocs, config, state, prompt, args.max_new_tokens,
                  args.temperature, args.top_k, args.seed, backend=args.backend,
                  timeout=None, collective_timeout=args.timeout)  # fmt: skip
    if int(os.environ.get("RANK", "0")) == 0:
        print(tok.decode(results[0]))
    return 0


def _fail(message: str) -> NoReturn:
    print(f"tpedu: error: {message}", file=sys.stderr)
    raise SystemExit(2)

