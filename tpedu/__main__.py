"""The tpedu command line. Every subcommand works two ways:

    python -m tpedu hello --nprocs 2                       # launches its own local ranks
    torchrun --nproc_per_node 2 -m tpedu hello             # joins the ranks torchrun started

Subcommands:
    hello       every rank reports in; an all-reduce is checked against its formula
    commbench   time collectives, fit the α-β model, print predicted vs measured
    train       train the tensor-parallel GPT on 红楼梦 (--tp N ranks), print a JSON summary
    generate    continue a prompt with a trained model (--model DIR --prompt ...)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from tpedu import collectives as C
from tpedu import cost_model
from tpedu.launcher import RankError, device, run, under_torchrun


def hello() -> dict:
    """Each rank prints who it is; the sum of all ranks is checked against t(t-1)/2."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.tensor([float(rank)], device=device())
    C.all_reduce(x)
    expected = world * (world - 1) / 2
    ok = x.item() == expected
    print(
        f"rank {rank} of {world} on {dist.get_backend()}: all_reduce(rank) = {x.item():g} "
        f"(expected {expected:g}) {'✓' if ok else '✗'}"
    )
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
    s.add_argument("--timeout", type=float, default=600.0, help="seconds before a hang errors")


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
    tr.add_argument("--eval-every", type=int, default=50)
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--out", default=None, help="directory to save the trained model in")
    tr.add_argument("--json", default=None, help="also write the full summary (all losses) here")

    gen = sub.add_parser("generate", help="continue a prompt with a trained model")
    _common(gen, "--tp")
    gen.add_argument("--model", required=True, help="directory written by `train --out`")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new-tokens", type=int, default=100)
    gen.add_argument("--temperature", type=float, default=0.8)
    gen.add_argument("--top-k", type=int, default=50)
    gen.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _check_ranks(args)
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
    except RankError as e:
        print(f"tpedu {args.command}: {e}", file=sys.stderr)
        return 1
    return 0


def _check_ranks(args: argparse.Namespace) -> None:
    flag = "--tp" if args.command in ("train", "generate") else "--nprocs"
    if args.nprocs < 1:
        _fail(f"{flag} must be at least 1, got {args.nprocs}")
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if flag == "--tp" and args.nprocs != world:
            _fail(f"--tp {args.nprocs} does not match torchrun's world size {world}; "
                  f"pass --tp {world} or start {args.nprocs} processes")  # fmt: skip
        args.nprocs = world
        return
    cores = os.cpu_count() or 1
    if args.backend != "nccl" and args.nprocs > 4 * cores:
        _fail(f"{flag} {args.nprocs} is more than 4 ranks per core on this {cores}-core "
              "machine; use fewer ranks or a bigger machine")  # fmt: skip


def _train(args: argparse.Namespace) -> int:
    from tpedu.model import GPTConfig
    from tpedu.train import TrainConfig, novel_data, train

    try:
        tok, train_ids, val_ids = novel_data(args.tokenizer, args.bpe_vocab)
    except FileNotFoundError as e:
        _fail(str(e))
    preset = GPTConfig.llama_like if args.arch == "llama" else GPTConfig.gpt2_like
    kv = {"n_kv_heads": args.kv_heads} if args.kv_heads or args.arch == "gpt2" else {}
    config = preset(tok.vocab_size, seq_len=args.seq, n_layers=args.layers, hidden=args.hidden,
                    n_heads=args.heads, dropout=args.dropout,
                    vocab_parallel=not args.replicated_embedding, **kv)  # fmt: skip
    try:
        config.check(args.nprocs)
    except ValueError as e:
        _fail(str(e))
    cfg = TrainConfig(steps=args.steps, batch=args.batch, lr=args.lr, min_lr=args.lr / 10,
                      warmup=min(20, args.steps // 10 + 1), eval_every=args.eval_every,
                      seed=args.seed)  # fmt: skip
    results = run(train, args.nprocs, config, cfg, train_ids, val_ids, args.out, tok,
                  backend=args.backend, timeout=args.timeout, stream=True)  # fmt: skip
    if int(os.environ.get("RANK", "0")) == 0:
        summary = results[0]
        if args.json:
            Path(args.json).write_text(json.dumps(summary, indent=2))
        print(json.dumps({k: v for k, v in summary.items() if k != "losses"}, indent=2))
    return 0


def _generate(args: argparse.Namespace) -> int:
    from tpedu.train import generate, load_model_files

    if not args.prompt.strip():
        _fail("--prompt is empty; give some text to continue, e.g. --prompt '宝玉'")
    try:
        config, state, tok = load_model_files(args.model)
        config.check(args.nprocs)
    except (FileNotFoundError, ValueError) as e:
        _fail(str(e))
    prompt = tok.encode(args.prompt)
    results = run(generate, args.nprocs, config, state, prompt, args.max_new_tokens,
                  args.temperature, args.top_k, args.seed, backend=args.backend,
                  timeout=args.timeout)  # fmt: skip
    if int(os.environ.get("RANK", "0")) == 0:
        print(tok.decode(results[0]))
    return 0


def _fail(message: str) -> NoReturn:
    print(f"tpedu: error: {message}", file=sys.stderr)
    raise SystemExit(2)


if __name__ == "__main__":
    sys.exit(main())
