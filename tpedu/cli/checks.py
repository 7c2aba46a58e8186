"""Course infrastructure: the command line's checks before launch: every value a rank would only
trip over later (a traceback per rank, or a silently wrong run) is refused here, in the one parent
process, with one line on stderr (`tpedu: error: ...`) and exit code 2.

Under torchrun every process runs the same checks; only the first process on each machine
(LOCAL_RANK 0, which includes RANK 0) prints the error, and every process exits 2.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import NoReturn

import torch

from tpedu.cli.parser import TP_COMMANDS
from tpedu.launcher import under_torchrun
from tpedu.model.config import GPTConfig
from tpedu.model.gpt import check_ring_overlap
from tpedu.parallel.config import ParallelConfig
from tpedu.parallel.mesh import AXIS_NAMES


def fail(message: str) -> NoReturn:
    """Print `tpedu: error: message` (under torchrun: on one process per machine), exit 2."""
    if _reports_errors():
        print(f"tpedu: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _reports_errors() -> bool:
    """False for the processes of a torchrun job that leave the error line to another: one
    line per machine, not one per rank."""
    if not under_torchrun():
        return True
    return os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")).strip() == "0"


def ranks(args: argparse.Namespace) -> int:
    """The subcommand's rank count: --tp (train, generate) or --nprocs (hello, commbench)."""
    return args.tp if args.command in TP_COMMANDS else args.nprocs


def check_ranks(args: argparse.Namespace) -> None:
    """The rank count and layout against this machine, or against torchrun's world size (then
    args.tp / args.nprocs is set from it)."""
    flag = "--tp" if args.command in TP_COMMANDS else "--nprocs"
    n = ranks(args)
    if n < 1:
        fail(f"{flag} must be at least 1, got {n}")
    sizes = {a: getattr(args, a, 1) for a in AXIS_NAMES if a != "tp"}  # train's layout
    for name, size in sizes.items():
        if size < 1:
            fail(f"--{name} must be at least 1, got {size}")
    others = math.prod(sizes.values())
    if args.backend == "nccl":  # one GPU per rank on this machine
        gpus = torch.cuda.device_count()
        here = (
            int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
            if under_torchrun()
            else n * others
        )
        if here > gpus:
            fail(
                f"--backend nccl needs one GPU per rank: {here} ranks on this machine, {gpus} "
                f"GPUs visible; use at most {gpus} ranks here, or --backend gloo"
            )
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if flag == "--tp" and others > 1 and n * others != world:
            used = {
                a: k for a, k in ({"tp": n} | sizes).items() if k > 1 or a in ("tp", "pp", "dp")
            }
            fail(
                " × ".join(f"--{a} {k}" for a, k in used.items())
                + f" = {n * others} ranks does not match torchrun's world size {world}; choose "
                f"{'·'.join(used)} = {world} or start {n * others} processes"
            )
        if flag == "--tp" and others == 1 and n != world:
            fail(
                f"--tp {n} does not match torchrun's world size {world}; "
                f"pass --tp {world} or start {n} processes"
            )
        setattr(args, flag.lstrip("-"), world // others)
        return
    cores = os.cpu_count() or 1
    if args.backend != "nccl" and n * others > 4 * cores:
        what = f"{flag} {n}" if others == 1 else f"tp·pp·dp = {n * others}"
        fail(
            f"{what} is more than 4 ranks per core on this {cores}-core "
            "machine; use fewer ranks or a bigger machine"
        )


def check_args(args: argparse.Namespace) -> None:
    """One-line errors for values the ranks would only trip over later (after check_ranks)."""
    if args.command == "commbench":
        if args.nprocs < 2:
            fail(
                f"--nprocs {args.nprocs}: commbench needs at least 2 ranks (one rank "
                "communicates nothing, so α and β cannot be fitted)"
            )
        if args.repeats < 1:
            fail(f"--repeats {args.repeats}: must be at least 1 (timed runs per size)")
        if min(args.sizes) < 1:
            fail(f"--sizes {min(args.sizes)}: sizes are bytes, each must be at least 1")
        if len(set(args.sizes)) < 2:
            fail(
                f"--sizes needs at least 2 different sizes to fit α and β, got "
                f"{sorted(set(args.sizes))}; e.g. --sizes 4096 1048576"
            )
    elif args.command == "train":
        _check_train_numbers(args)
        if args.save_every and not args.ckpt_dir:
            fail("--save-every needs --ckpt-dir (where to write the checkpoints)")
        for flag, value in (("--out", args.out), ("--ckpt-dir", args.ckpt_dir)):
            if value is not None:
                check_dir(flag, value)
        if args.out is not None:
            check_out(args.out)
        if args.json is not None:
            _check_json(args.json)
        if args.trace is not None:
            from tpedu.analysis.clock.trace import check_path

            try:
                check_path(args.trace)
            except ValueError as e:
                fail(f"--{e}")
    elif args.command == "generate":
        if args.top_k < 1:
            fail(
                f"--top-k {args.top_k}: must be at least 1 (a value at least the vocabulary "
                "size samples from the whole vocabulary)"
            )
        if not args.temperature >= 0:
            fail(
                f"--temperature {args.temperature}: must be at least 0 (0 always picks the "
                "most likely token, 1 samples the model's distribution)"
            )
        if args.prompt is not None and not args.prompt.strip():
            fail("--prompt is empty; give some text to continue, e.g. --prompt '宝玉'")
        if args.max_new_tokens < 0:
            fail(f"--max-new-tokens {args.max_new_tokens}: must be at least 0")


def _check_train_numbers(args: argparse.Namespace) -> None:
    """train's counts and optimizer settings: each flag, its value and what it may be."""
    at_least = [
        (name, 1)
        for name in ("layers", "hidden", "seq", "batch", "steps", "eval_batches", "chunks")
    ]
    at_least += [("eval_every", 0), ("save_every", 0)]
    if args.warmup is not None:
        at_least.append(("warmup", 0))
    if args.tokenizer == "bpe":
        at_least.append(("bpe_vocab", 1))
    for name, low in at_least:
        value = getattr(args, name)
        if value < low:
            fail(f"--{name.replace('_', '-')} must be at least {low}, got {value}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        fail(f"--lr must be a positive number (the peak learning rate, e.g. 3e-3), got {args.lr:g}")
    for flag, value, note in (
        ("--min-lr", args.min_lr, " (the learning rate the cosine decays to)"),
        ("--weight-decay", args.weight_decay, " (0: no weight decay)"),
        ("--grad-clip", args.grad_clip, " (0: no clipping)"),
    ):
        if value is not None and not (math.isfinite(value) and value >= 0):
            fail(f"{flag} must be a number at least 0{note}, got {value:g}")
    if args.min_lr is not None and args.min_lr > args.lr:
        fail(
            f"--min-lr {args.min_lr:g} is above --lr {args.lr:g}: the schedule decays from "
            "--lr down to --min-lr; give a --min-lr at most --lr"
        )


def check_dir(flag: str, value: str) -> None:
    """`value` must be a directory, or a path that does not exist yet (under no file)."""
    for path in (Path(value), *Path(value).parents):
        if path.exists():
            if not path.is_dir():
                fail(
                    f"{flag} {value}: {path} is a file, not a directory; give a directory "
                    "(a missing one is created)"
                )
            return


def check_out(out: str) -> None:
    """A model directory is written to `out` by replacing it as a whole: refuse a directory that
    holds something else (checkpoint.files.check_replaceable), before any work is done."""
    from tpedu.checkpoint.files import CheckpointError, check_replaceable

    try:
        check_replaceable(out)
    except CheckpointError as e:
        fail(f"--out {e}")


def _check_json(value: str) -> None:
    """--json is written after training: refuse a directory or a missing parent now."""
    path = Path(value)
    if path.is_dir():
        fail(f"--json {value} is a directory; give a file name for the summary")
    if not path.parent.is_dir():
        fail(
            f"--json {value}: {path.parent} is not a directory; create it first or give "
            "another file name"
        )


def check_layout(args: argparse.Namespace, n_layers: int) -> None:
    """The 3D layout's one-line errors, before any rank starts (n_layers: the model's, which
    with --resume is the checkpoint's, not --layers)."""
    from tpedu.parallel.pipeline.schedules import partition, schedule
    from tpedu.train.step import default_micro_batches

    if args.batch % args.dp:
        fail(
            f"--batch {args.batch} is not divisible by --dp {args.dp}; use a multiple of {args.dp}"
        )
    per_replica = args.batch // args.dp
    if args.micro_batches is not None and (
        args.micro_batches < 1 or per_replica % args.micro_batches
    ):
        fail(
            f"--micro-batches {args.micro_batches} does not divide the per-replica batch "
            f"{per_replica} (= batch / dp); choose a divisor of {per_replica}"
        )
    try:
        partition(n_layers, args.pp * args.chunks)
    except ValueError as e:
        whose = f" (the model in --resume {args.resume})" if args.resume else ""
        fail(f"--pp {args.pp}{f' --chunks {args.chunks}' if args.chunks > 1 else ''}{whose}: {e}")
    try:
        m = args.micro_batches or default_micro_batches(per_replica, args.pp)
        schedule(args.schedule, m, args.pp, 0, args.chunks)
    except ValueError as e:
        fail(f"--schedule {args.schedule} --chunks {args.chunks}: {e}")
    if args.tp_overlap == "chunks" and (per_replica // m) % args.tp_chunks:
        fail(
            f"--tp-chunks {args.tp_chunks} does not divide the micro-batch of {per_replica // m} "
            f"sequences (batch / dp / micro-batches); choose a divisor of {per_replica // m}"
        )


def read_resume(args: argparse.Namespace) -> GPTConfig | None:
    """The model config of the --resume checkpoint (None without --resume), after checking its
    index and the size of every shard file it lists (a truncated file fails here, not on the
    ranks)."""
    from tpedu import checkpoint

    if not args.resume:
        return None
    try:
        checkpoint.check_files(args.resume)
        return checkpoint.read_config(args.resume)
    except (ValueError, FileNotFoundError) as e:  # CheckpointError is a ValueError
        fail(str(e))


def check_vocab(args: argparse.Namespace, saved: GPTConfig, vocab_size: int) -> None:
    """The --resume checkpoint's model must read the --tokenizer's ids."""
    if saved.vocab_size != vocab_size:
        fail(
            f"{args.resume} has vocab_size {saved.vocab_size}, the --tokenizer "
            f"{args.tokenizer} gives {vocab_size}; pass the tokenizer it was trained with"
        )


def parallel_config(args: argparse.Namespace) -> ParallelConfig:
    """train's ParallelConfig from its flags (a one-line error if they do not make one)."""
    try:
        # before ParallelConfig's "ring needs --sequence-parallel", which --experts cannot take
        check_ring_overlap(args.tp_overlap, args.cp, args.experts > 0)
        return ParallelConfig(
            args.tp,
            args.pp,
            args.dp,
            schedule=args.schedule,
            chunks=args.chunks,
            micro_batches=args.micro_batches,
            stage_split=args.stage_split,
            sequence_parallel=args.sequence_parallel,
            recompute=args.recompute,
            overlap_comm=args.overlap_comm,
            zero=args.zero,
            cp=args.cp,
            cp_strategy=args.cp_strategy,
            cp_layout=args.cp_layout,
            ep=args.ep,
            tp_overlap=args.tp_overlap,
            tp_chunks=args.tp_chunks,
        )
    except ValueError as e:
        fail(str(e))


def check_config(config: GPTConfig, parallel: ParallelConfig) -> None:
    """The model config's checks against the layout (heads divisible by tp, ...), one line."""
    try:
        parallel.check(config)
    except ValueError as e:
        fail(str(e))


def check_prompt(tok: object, prompt: str) -> None:
    """Refuse a prompt with characters the model's tokenizer cannot encode (a character
    tokenizer knows only its training text's characters; the rest would become <unk>)."""
    unknown = tok.unknown(prompt)
    if not unknown:
        return
    shown = ", ".join(repr(c) for c in unknown[:10])
    more = f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""
    n = len(unknown)
    fail(
        f"the prompt has {n} character{'s' if n > 1 else ''} the model's tokenizer does not "
        f"know: {shown}{more} (the model would see <unk>, which it never saw in training); "
        "use characters from its training text"
    )
