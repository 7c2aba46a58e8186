"""The tpedu command line. Every subcommand works two ways:

    python -m tpedu hello --nprocs 2                       # launches its own local ranks
    torchrun --nproc_per_node 2 -m tpedu hello             # joins the ranks torchrun started

Subcommands:
    hello       every rank reports in; an all-reduce is checked against its formula
    commbench   time collectives, fit the α-β model, print predicted vs measured
"""

from __future__ import annotations

import argparse
import os
import sys

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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tpedu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = p.add_subparsers(dest="command", required=True)
    for name, helptext in (("hello", "check that ranks start and talk"),
                           ("commbench", "fit the α-β collective cost model")):  # fmt: skip
        s = sub.add_parser(name, help=helptext)
        s.add_argument("--nprocs", type=int, default=2, help="local ranks (ignored under torchrun)")
        s.add_argument("--backend", choices=["gloo", "nccl"], default=None)
        s.add_argument("--timeout", type=float, default=120.0, help="seconds before a hang errors")
    bench = sub.choices["commbench"]
    bench.add_argument("--sizes", type=int, nargs="+", default=[4096, 65536, 1 << 20, 1 << 22])
    bench.add_argument("--repeats", type=int, default=5)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not under_torchrun():
        cores = os.cpu_count() or 1
        if args.nprocs < 1:
            _fail(f"--nprocs must be at least 1, got {args.nprocs}")
        if args.backend != "nccl" and args.nprocs > 4 * cores:
            _fail(f"--nprocs {args.nprocs} is more than 4 ranks per core on this {cores}-core "
                  "machine; use fewer ranks or a bigger machine")  # fmt: skip
    if args.command == "hello":
        fn, fn_args = hello, ()
    else:
        fn, fn_args = commbench, (args.sizes, args.repeats)
    try:
        run(fn, args.nprocs, *fn_args, backend=args.backend, timeout=args.timeout)
    except RankError as e:
        print(f"tpedu {args.command}: {e}", file=sys.stderr)
        return 1
    return 0


def _fail(message: str) -> None:
    print(f"tpedu: error: {message}", file=sys.stderr)
    raise SystemExit(2)


if __name__ == "__main__":
    sys.exit(main())
