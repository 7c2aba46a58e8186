"""Lessons 02–14: the argument parser of `python -m tpedu` (`build_parser`): every subcommand
and flag.

Defaults and ranges are checked by tpedu.cli.checks before any rank starts; the subcommands
themselves are in tpedu.cli.commands.
"""

from __future__ import annotations

import argparse

from tpedu.cp.context import STRATEGIES as CP_STRATEGIES
from tpedu.cp.ring import LAYOUTS as CP_LAYOUTS
from tpedu.data.tokenizer import KINDS as TOKENIZERS
from tpedu.launcher import BACKENDS
from tpedu.model.config import RECOMPUTE
from tpedu.model.options import TP_OVERLAPS
from tpedu.parallel.config import SCHEDULES, STAGE_SPLITS, ZERO_LEVELS
from tpedu.train.config import REDUCE_DTYPES
from tpedu.train.precision import DTYPES

DESCRIPTION = """\
The tpedu command line. Every subcommand works two ways:

    python -m tpedu hello --nprocs 2                       # launches its own local ranks
    torchrun --nproc_per_node 2 -m tpedu hello             # joins the ranks torchrun started

Subcommands:
    hello       every rank reports in; an all-reduce is checked against its formula
    commbench   time collectives, fit the α-β model, print predicted vs measured
    train       train the tensor-parallel GPT on 红楼梦 (--tp N ranks), print a JSON summary;
                with --pp P --dp D: 3D parallel on tp·pp·dp ranks
    generate    continue a prompt with a trained model (--model DIR --prompt ...)
    reshard     rewrite a sharded checkpoint for another (tp, pp, dp), or export it (one process)
    dryrun      one rank of a big job (e.g. 128 GPUs) on the meta device, in one process: the
                bytes it holds and sends in one training step, beside the memory ledger
"""

# The subcommands whose rank count is --tp (stored in args.tp); hello and commbench use
# --nprocs (args.nprocs).
TP_COMMANDS = ("train", "generate")


def _common(s: argparse.ArgumentParser, ranks_flag: str = "--nprocs") -> None:
    s.add_argument(
        ranks_flag,
        type=int,
        default=2,
        dest=ranks_flag.lstrip("-"),
        help="local ranks (under torchrun: must equal the world size)",
    )
    s.add_argument("--backend", choices=BACKENDS, default=None)
    s.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds a rank may wait on the others before the run fails as a hang",
    )


def build_parser() -> argparse.ArgumentParser:
    """The parser for `python -m tpedu SUBCOMMAND ...` (its --help shows DESCRIPTION).

    Long because it is the CLI's reference: every subcommand and its own flags, top to bottom in
    --help's order (the flags several subcommands share are the helpers below)."""
    p = argparse.ArgumentParser(
        prog="python -m tpedu",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)
    _common(sub.add_parser("hello", help="check that ranks start and talk"))
    bench = sub.add_parser("commbench", help="fit the α-β collective cost model")
    _common(bench)
    bench.add_argument("--sizes", type=int, nargs="+", default=[4096, 65536, 1 << 20, 1 << 22])
    bench.add_argument("--repeats", type=int, default=5)

    tr = sub.add_parser(
        "train",
        help="train the tensor-parallel GPT on 红楼梦",
        epilog="exit codes: 0 done, 1 a rank failed or hung, 2 bad arguments, 143 stopped by "
        "SIGTERM (preempted: every rank finished the same step and saved it, if --ckpt-dir is "
        "given; the last line on stderr is the command that continues with --resume)",
    )
    _common(tr, "--tp")
    _model_flags(tr)
    tr.add_argument("--steps", type=int, default=200)
    tr.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    tr.add_argument(
        "--min-lr",
        type=float,
        default=None,
        help="learning rate at the end of the cosine decay (default: lr / 10)",
    )
    tr.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="linear warm-up steps (default: min(20, steps // 10 + 1))",
    )
    tr.add_argument(
        "--weight-decay", type=float, default=0.1, help="AdamW weight decay on the matrices"
    )
    tr.add_argument(
        "--grad-clip",
        type=float,
        default=1.0,
        help="clip the global gradient norm to this (0: no clipping)",
    )
    tr.add_argument("--dropout", type=float, default=0.0)
    tr.add_argument("--tokenizer", choices=TOKENIZERS, default="char")
    tr.add_argument("--bpe-vocab", type=int, default=4096)
    tr.add_argument(
        "--replicated-embedding",
        action="store_true",
        help="keep the whole embedding on every rank instead of splitting the vocabulary",
    )
    tr.add_argument(
        "--eval-every",
        type=int,
        default=50,
        help="validate every N steps (and at the end); 0: never",
    )
    tr.add_argument("--eval-batches", type=int, default=4, help="validation batches per evaluation")
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        default="fp32",
        help="compute precision; weights, gradients and AdamW stay fp32 (bf16/fp16: autocast)",
    )
    tr.add_argument(
        "--grad-reduce",
        choices=REDUCE_DTYPES,
        default="fp32",
        help="data-parallel gradient all-reduce in fp32, or in --dtype (half the bytes)",
    )
    tr.add_argument(
        "--param-gather",
        choices=REDUCE_DTYPES,
        default="fp32",
        help="ZeRO-2/3's parameter all-gathers in fp32, or in --dtype (half the bytes)",
    )
    tr.add_argument("--out", default=None, help="directory to save the trained model in")
    tr.add_argument("--json", default=None, help="also write the full summary (all losses) here")
    tr.add_argument(
        "--trace",
        default=None,
        metavar="FILE",
        help="record every rank's steps and write them, measured and replayed with a core per "
        "rank, as a Chrome trace / Perfetto JSON file (tpedu.analysis.clock)",
    )
    _layout_flags(tr)
    tr.add_argument("--ckpt-dir", default=None, help="write sharded checkpoints here (lesson 14)")
    tr.add_argument(
        "--save-every",
        type=int,
        default=0,
        help="checkpoint every N steps (and at the end) into --ckpt-dir",
    )
    tr.add_argument(
        "--resume",
        default=None,
        help="continue from this checkpoint (any layout; its model config is used)",
    )

    gen = sub.add_parser("generate", help="continue a prompt with a trained model")
    _common(gen, "--tp")
    gen.add_argument("--model", required=True, help="directory written by `train --out`")
    text = gen.add_mutually_exclusive_group(required=True)
    text.add_argument("--prompt", help="the text to continue")
    text.add_argument(
        "--prompts",
        metavar="FILE",
        help="a text file with one prompt per line, generated as one batch; prints one line "
        "per prompt (newlines in the text shown as ⏎)",
    )
    gen.add_argument("--max-new-tokens", type=int, default=100)
    gen.add_argument("--temperature", type=float, default=0.8)
    gen.add_argument("--top-k", type=int, default=50)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument(
        "--greedy", action="store_true", help="always the most likely token (= --temperature 0)"
    )
    gen.add_argument(
        "--no-cache",
        action="store_true",
        help="no KV cache: rerun the whole window for every token (slower; the window slides "
        "past the context length, which the cache refuses)",
    )

    _dryrun_parser(sub)

    rs = sub.add_parser("reshard", help="rewrite a checkpoint for another layout, or export it")
    rs.add_argument(
        "src",
        help="a checkpoint (step dir, or its parent with `latest`), or a dense "
        "model dir (`train --out`) to import",
    )
    rs.add_argument("--out", required=True, help="the new checkpoint's (or export's) directory")
    rs.add_argument("--tp", type=int, default=1)
    rs.add_argument("--pp", type=int, default=1)
    rs.add_argument("--dp", type=int, default=1)
    rs.add_argument("--zero", type=int, choices=ZERO_LEVELS, default=0, help="ZeRO stage")
    rs.add_argument("--zero1", dest="zero", action="store_const", const=1, help="= --zero 1")
    rs.add_argument(
        "--to",
        choices=["sharded", "dense", "hf"],
        default="sharded",
        help="dense: a `train --out` model dir; hf: GPT-2 for transformers",
    )
    return p


def _model_flags(p: argparse.ArgumentParser) -> None:
    """The model's shape and the global batch (train, dryrun)."""
    p.add_argument("--arch", choices=["gpt2", "llama"], default="gpt2")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=None, help="grouped-query attention")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    p.add_argument(
        "--experts",
        type=int,
        default=0,
        help="a mixture of experts in the MLPs: this many experts each (lesson 18; 0: dense)",
    )
    p.add_argument(
        "--ffn", type=int, default=None, help="the MLP's hidden width (default 4·hidden)"
    )
    p.add_argument(
        "--expert-ffn", type=int, default=None, help="each expert's hidden width (default --ffn)"
    )
    p.add_argument("--top-k", type=int, default=2, help="experts per token with --experts: 1 or 2")
    p.add_argument(
        "--moe-every", type=int, default=1, help="with --experts: every n-th block is an MoE"
    )
    p.add_argument(
        "--capacity-factor",
        type=float,
        default=None,
        help="with --experts: tokens an expert takes, over its even share (default: dropless)",
    )


def _layout_flags(p: argparse.ArgumentParser) -> None:
    """How the model runs, beside --tp: every ParallelConfig field (train, dryrun)."""
    p.add_argument(
        "--cp",
        type=int,
        default=1,
        help="context-parallel ranks: each sequence split over them (lesson 09)",
    )
    p.add_argument("--cp-strategy", choices=CP_STRATEGIES, default="ring")
    p.add_argument("--cp-layout", choices=CP_LAYOUTS, default="zigzag")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (lesson 11)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas (lesson 12)")
    p.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel ranks carved from the --dp ranks: the experts split over them "
        "(lesson 18)",
    )
    p.add_argument(
        "--micro-batches",
        type=int,
        default=None,
        help="micro-batches per step with --pp (default: the largest ≤ 2·pp dividing batch/dp)",
    )
    p.add_argument(
        "--zero",
        type=int,
        choices=ZERO_LEVELS,
        default=0,
        help="ZeRO stage over the --dp ranks (lesson 12): 1 shards AdamW's states, 2 also the "
        "gradients, 3 also the parameters (FSDP)",
    )
    p.add_argument("--zero1", dest="zero", action="store_const", const=1, help="= --zero 1")
    p.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default="1f1b",
        help="pipeline schedule with --pp (lesson 11)",
    )
    p.add_argument(
        "--chunks",
        type=int,
        default=1,
        help="model chunks per pipeline rank (--schedule interleaved)",
    )
    p.add_argument(
        "--stage-split",
        choices=STAGE_SPLITS,
        default="even",
        help="blocks per pipeline stage: even, or by FLOPs counting the head (lesson 11)",
    )
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="shard norms, dropout and residuals along the sequence (lesson 08)",
    )
    p.add_argument(
        "--recompute",
        choices=RECOMPUTE,
        default="none",
        help="recompute in backward: the attention core, or whole blocks (lesson 10)",
    )
    p.add_argument(
        "--overlap-comm",
        action="store_true",
        help="overlap each f's backward all-reduce with dL/dW (lesson 15; same result)",
    )
    _tp_overlap_flags(p)


def _tp_overlap_flags(p: argparse.ArgumentParser) -> None:
    """Hiding TP's communication under compute (lesson 19), beside --overlap-comm."""
    p.add_argument(
        "--tp-overlap",
        choices=TP_OVERLAPS,
        default="none",
        help="hide TP's communication (lesson 19): chunks (batch chunks, one's all-reduce "
        "under the next's compute; with --experts the MoE half runs unchunked) or ring "
        "(collective matmul; needs --sequence-parallel, so not with --cp or --experts)",
    )
    p.add_argument(
        "--tp-chunks",
        type=int,
        default=2,
        help="batch chunks per micro-batch with --tp-overlap chunks (must divide it)",
    )


def _dryrun_parser(sub: argparse._SubParsersAction) -> None:
    """`dryrun` (lesson 13): train's model and layout flags, plus --vocab and --rank."""
    dr = sub.add_parser(
        "dryrun",
        help="one rank of a large layout on the meta device: memory and traffic of one step",
    )
    _model_flags(dr)
    dr.add_argument(
        "--vocab", type=int, default=50257, help="vocabulary size (no tokenizer is loaded)"
    )
    dr.add_argument("--tp", type=int, default=1)
    _layout_flags(dr)
    dr.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        default="fp32",
        help="as train's: fp32, or bf16 (autocast's casts, imitated on meta tensors); not fp16",
    )
    dr.add_argument(
        "--rank",
        nargs="+",
        default=None,
        help="global ranks to dry-run (default: rank 0 and the first rank of the last "
        "stage), or `all` for a one-line summary of every rank",
    )
    dr.set_defaults(resume=None)
