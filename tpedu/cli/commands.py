"""Lessons 02–14: the subcommands of `python -m tpedu` (the overview: tpedu.cli.parser.DESCRIPTION):
`hello` (lesson 02: ranks start and talk), `commbench` (lesson 02: the α-β cost model), `train`
(lesson 07, and lessons 11-14 with --pp, --dp and checkpoints), `generate` (lesson 07), `reshard`
(lesson 14), `dryrun` (lesson 13: one rank of a big layout on the meta device), and `main`,
which parses, checks (tpedu.cli.checks) and then launches.

Every subcommand but reshard and dryrun (one process each) works two ways:

    python -m tpedu hello --nprocs 2                       # launches its own local ranks
    torchrun --nproc_per_node 2 -m tpedu hello             # joins the ranks torchrun started
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tpedu.cli import checks
from tpedu.cli.checks import fail
from tpedu.cli.parser import build_parser
from tpedu.comm import collectives as C
from tpedu.comm import cost_model
from tpedu.comm.device import device
from tpedu.launcher import LaunchTimeout, RankError, run, under_torchrun
from tpedu.model.config import GPTConfig
from tpedu.parallel.config import ParallelConfig
from tpedu.train.preempt import EXIT_CODE, Preempted


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


def main(argv: list[str] | None = None) -> int:
    """`python -m tpedu ...`: parse, check (one-line errors, exit 2), then run the subcommand.
    Returns the exit code: 0, 1 when a rank failed or hung, or 143 (= 128 + SIGTERM) when
    `train` was stopped by SIGTERM (after saving a checkpoint if it has --ckpt-dir)."""
    args = build_parser().parse_args(argv)
    if args.command == "reshard":  # one process, no ranks
        return _reshard(args)
    if args.command == "dryrun":  # one process: each rank alone on a fake process group
        return _dryrun(args)
    checks.check_ranks(args)
    checks.check_args(args)
    try:
        if args.command == "hello":
            run(hello, args.nprocs, backend=args.backend, timeout=args.timeout)
        elif args.command == "commbench":
            run(
                commbench,
                args.nprocs,
                args.sizes,
                args.repeats,
                backend=args.backend,
                timeout=args.timeout,
            )
        elif args.command == "train":
            return _train(args)
        else:
            return _generate(args)
    except Preempted as e:  # lesson 14: every rank stopped after the same step
        return _preempted(e, args, sys.argv[1:] if argv is None else argv)
    except (RankError, LaunchTimeout) as e:
        print(f"tpedu {args.command}: {e}", file=sys.stderr)
        return 1
    return 0


def _preempted(e: Preempted, args: argparse.Namespace, argv: list[str]) -> int:
    """One line: the step saved and the command that continues from it. Returns EXIT_CODE."""
    if int(os.environ.get("RANK", "0")) == 0:
        if e.path is None:
            line = (
                f"tpedu train: stopped by SIGTERM after step {e.step}; nothing could be saved "
                "(no --ckpt-dir): add --ckpt-dir DIR to be able to resume"
            )
        else:
            line = (
                f"tpedu train: stopped by SIGTERM after step {e.step}, saved {e.path}; "
                f"continue with: {_resume_command(argv, args.ckpt_dir)}"
            )
        print(line, file=sys.stderr, flush=True)
    return EXIT_CODE


def _resume_command(argv: list[str], ckpt_dir: str) -> str:
    """The same command line, with `--resume ckpt_dir` (the newest step there) instead of any
    --resume it had (argparse also takes an unambiguous prefix, `--res`)."""
    keep, rest = [], iter(argv)
    for a in rest:
        name = a.split("=", 1)[0]
        if len(name) >= 5 and "--resume".startswith(name):
            if "=" not in a:
                next(rest, None)  # its value
            continue
        keep.append(a)
    prefix = "torchrun ... -m tpedu" if under_torchrun() else "python -m tpedu"
    return f"{prefix} {shlex.join([*keep, '--resume', ckpt_dir])}"


def model_config(args: argparse.Namespace, vocab_size: int, **fields: object) -> GPTConfig:
    """The GPTConfig of the model flags (`parser._model_flags`), plus `fields`."""
    preset = GPTConfig.llama_like if args.arch == "llama" else GPTConfig.gpt2_like
    kv = {"n_kv_heads": args.kv_heads} if args.kv_heads or args.arch == "gpt2" else {}
    shape = {"seq_len": args.seq, "n_layers": args.layers, "hidden": args.hidden}
    if args.ffn is not None:
        shape["ffn_hidden"] = args.ffn
    moe = {
        "expert_ffn_hidden": args.expert_ffn,
        "experts": args.experts,
        "top_k": args.top_k,
        "moe_every": args.moe_every,
        "capacity_factor": args.capacity_factor,
    }
    return preset(vocab_size, n_heads=args.heads, **shape, **kv, **moe, **fields)


def _train(args: argparse.Namespace) -> int:
    # here, not at import: the training stack costs ~0.6 s that hello, reshard and every
    # refused input would pay
    from tpedu.data.corpus import novel_data
    from tpedu.train.config import TrainConfig
    from tpedu.train.loop import train

    parallel = checks.parallel_config(args)
    try:
        if args.out is not None:
            parallel.check_dense_export()
    except ValueError as e:
        fail(str(e))
    saved = checks.read_resume(args)  # with --resume, the checkpoint's model config
    checks.check_layout(args, saved.n_layers if saved else args.layers)
    try:
        tok, train_ids, val_ids = novel_data(args.tokenizer, args.bpe_vocab)
    except FileNotFoundError as e:
        fail(str(e))
    config = model_config(
        args, tok.vocab_size, dropout=args.dropout, vocab_parallel=not args.replicated_embedding
    )
    if saved is not None:  # the checkpoint's model; the flags choose only how it runs
        checks.check_vocab(args, saved, tok.vocab_size)
        config = saved
    checks.check_config(config, parallel)
    min_lr = args.lr / 10 if args.min_lr is None else args.min_lr
    warmup = min(20, args.steps // 10 + 1) if args.warmup is None else args.warmup
    cfg = TrainConfig(
        steps=args.steps,
        batch=args.batch,
        lr=args.lr,
        min_lr=min_lr,
        warmup=warmup,
        weight_decay=args.weight_decay,
        grad_clip=args.grad_clip,
        eval_every=args.eval_every,
        eval_batches=args.eval_batches,
        seed=args.seed,
        ckpt_dir=args.ckpt_dir,
        save_every=args.save_every,
        resume=args.resume,
        dtype=args.dtype,
        grad_reduce=args.grad_reduce,
        param_gather=args.param_gather,
    )
    results = run(
        train,
        parallel.world,
        config,
        cfg,
        train_ids,
        val_ids,
        args.out,
        tok,
        parallel,
        backend=args.backend,
        timeout=None,
        collective_timeout=args.timeout,
        stream=True,
        trace=args.trace is not None,
    )
    if int(os.environ.get("RANK", "0")) == 0:
        summary = results[0]
        if args.trace:  # lesson 11: measured and replayed, a core per rank (tpedu.analysis.clock)
            from tpedu.analysis.clock.trace import write

            clock = summary.pop("clock")
            write(args.trace, clock["logs"], clock["link"], link_name="loopback, measured here")
        if args.json:
            Path(args.json).write_text(json.dumps(summary, indent=2))
        print(json.dumps({k: v for k, v in summary.items() if k != "losses"}, indent=2))
    return 0


def _dryrun(args: argparse.Namespace) -> int:
    """Lesson 13: one training step of the chosen rank(s) of a tp·pp·dp job, on the meta
    device in this process (tpedu.analysis.dryrun); prints the table(s)."""
    for name in ("layers", "hidden", "heads", "seq", "batch", "vocab", "chunks"):
        if getattr(args, name) < 1:
            fail(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.kv_heads is not None and args.kv_heads < 1:
        fail(f"--kv-heads must be at least 1, got {args.kv_heads}")
    if args.dtype == "fp16":
        fail(
            "--dtype fp16: the dry run steps in fp32 or bf16; fp16's loss scaler reads the "
            "gradients' values, which meta tensors do not have: dry-run --dtype bf16 (the same "
            "bytes held; fp16 sends one more one-element all-reduce per step, the scaler's)"
        )
    parallel = checks.parallel_config(args)
    config = model_config(args, args.vocab)
    checks.check_config(config, parallel)
    checks.check_layout(args, args.layers)
    ranks = _dryrun_ranks(args.rank, parallel.world)
    # here, not at import: the analysis stack (and torch.testing's fake process group) costs
    # a second that every other subcommand would pay
    from tpedu.analysis import dryrun

    start = time.perf_counter()
    try:
        runs = dryrun.dry_run(config, parallel, args.batch, ranks, args.dtype)
    except ValueError as e:
        fail(str(e))
    if args.rank == ["all"]:
        print(dryrun.format_summary(runs))
    else:
        print("\n\n".join(dryrun.format_table(r) for r in runs))
    seconds = time.perf_counter() - start
    print(f"dry-ran {len(runs)} rank(s) of {parallel.world} in {seconds:.1f} s", file=sys.stderr)
    return 0


def _dryrun_ranks(values: list[str] | None, world: int) -> list[int] | None:
    """--rank: None (the default ranks), every rank for `all`, else the listed ranks."""
    if values is None:
        return None
    if values == ["all"]:
        return list(range(world))
    ranks = []
    for v in values:
        try:
            r = int(v)
        except ValueError:
            fail(f"--rank {v}: give global ranks (0 to {world - 1}) or `all`")
        if not 0 <= r < world:
            fail(f"--rank {r} is outside the {world} ranks of tp·pp·dp; use 0 to {world - 1}")
        ranks.append(r)
    return ranks


def _reshard(args: argparse.Namespace) -> int:
    from tpedu import checkpoint

    src = Path(args.src)
    dense_dir = (src / "model.safetensors").exists()  # `train --out`: import (or export) it
    if dense_dir and args.to == "dense":
        fail(
            f"{src} is already a dense model dir (`train --out`); use --to sharded to "
            "import it as a checkpoint, or --to hf to export it for transformers"
        )
    checks.check_dir("--out", args.out)
    if args.to in ("dense", "hf"):  # an export replaces --out as a whole
        checks.check_out(args.out)
    try:
        if dense_dir and args.to == "hf":
            with tempfile.TemporaryDirectory() as tmp:  # export_hf reads a checkpoint: make one
                path = checkpoint.export_hf(checkpoint.import_dense(src, tmp), args.out)
        elif dense_dir:
            path = checkpoint.import_dense(src, args.out, args.tp, args.pp, args.dp)
        elif args.to == "dense":
            path = checkpoint.export_dense(src, args.out)
        elif args.to == "hf":
            path = checkpoint.export_hf(src, args.out)
        else:
            path = checkpoint.reshard(src, args.out, args.tp, args.pp, args.dp, args.zero)
    except (ValueError, FileNotFoundError) as e:  # CheckpointError is a ValueError
        fail(str(e))
    print(checkpoint.summary(path) if (path / checkpoint.INDEX).exists() else f"wrote {path}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from tpedu.checkpoint.convert import load_model_info
    from tpedu.serve.generate import Sampling
    from tpedu.train.generate import generate_prompts

    try:  # every file checked here; the ranks read only their own slices of the weights
        config, tok = load_model_info(args.model)
    except (FileNotFoundError, ValueError) as e:  # CheckpointError is a ValueError
        fail(str(e))
    checks.check_config(config, ParallelConfig(args.tp))
    texts = [args.prompt] if args.prompts is None else _read_prompts(args.prompts)
    for text in texts:
        checks.check_prompt(tok, text)
    prompts = [tok.encode(text) for text in texts]
    if not args.no_cache:  # the KV cache holds at most the context length
        n = max(len(p) for p in prompts)
        if n + args.max_new_tokens > config.seq_len:
            fail(
                f"--max-new-tokens {args.max_new_tokens}: a prompt of {n} tokens + "
                f"{args.max_new_tokens} = {n + args.max_new_tokens} is more than the model's "
                f"context length {config.seq_len}; use --max-new-tokens "
                f"{max(0, config.seq_len - n)} or less, or --no-cache (recomputes a window "
                f"sliding over the last {config.seq_len} tokens)"
            )
    results = run(
        generate_prompts,
        args.tp,
        config,
        str(args.model),
        prompts,
        args.max_new_tokens,
        Sampling(
            temperature=args.temperature, top_k=args.top_k, greedy=args.greedy, seed=args.seed
        ),
        not args.no_cache,
        backend=args.backend,
        timeout=None,
        collective_timeout=args.timeout,
    )
    if int(os.environ.get("RANK", "0")) == 0:
        if args.prompts is None:
            print(tok.decode(results[0][0]))
        else:  # one line per prompt
            for ids in results[0]:
                print(tok.decode(ids).replace("\n", "⏎"))
    return 0


def _read_prompts(path: str) -> list[str]:
    """The non-empty lines of a --prompts file (without their line ends)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        fail(f"--prompts {path}: cannot read it ({e}); give a UTF-8 text file, one prompt a line")
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        fail(f"--prompts {path} has no prompts; write one prompt per line")
    return prompts
