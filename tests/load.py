"""Run a command on a busy machine: two CPU-bound processes beside it, stopped when it ends.

    python -m tests.load [--hogs 2] -- COMMAND...

`make test-load` runs the multi-rank tests this way. A learner's laptop is rarely idle, and on 2
cores two busy processes take half of every second from each rank: a test whose wait was tuned
on a quiet machine fails here first. The exit code is the command's.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hogs", type=int, default=2, help="CPU-bound processes to run beside")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)]
    start = time.monotonic()
    try:
        print(
            f"tests.load: {args.hogs} CPU-bound processes beside: {' '.join(command)}", flush=True
        )
        code = subprocess.call(command)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    load = os.getloadavg()[0]
    print(f"tests.load: exit {code} after {time.monotonic() - start:.0f} s, load {load:.1f}")
    return code


if __name__ == "__main__":
    sys.exit(main())
