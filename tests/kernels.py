"""Which CPU kernels torch runs here, in torch's, MKL's and oneDNN's own words.

    python -m tests.kernels               print them
    python -m tests.kernels --expect low  also fail (exit 1) unless LOW_KERNELS took effect

The stored notebook outputs must hold on any CPU torch supports. `make test-portable` runs the
notebooks with LOW_KERNELS in the environment, the SSE-level code an old or small CPU runs, and
calls this first, so a setting that was silently ignored cannot pass for a portable run. The
reports are printed by the libraries themselves (MKL's and oneDNN's verbose banners go to the C
stdout), so they are read from a child process.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

LOW_KERNELS = {
    "ATEN_CPU_CAPABILITY": "default",  # torch's own vectorised kernels: plain C++ loops
    "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",  # MKL's BLAS: no AVX code paths
    "ONEDNN_MAX_CPU_ISA": "SSE41",  # oneDNN's primitives: SSE4.1 at most
}

PROBE = """
import torch
print("torch:", torch.backends.cpu.get_cpu_capability(), flush=True)
a = torch.randn(16, 16)
with torch.backends.mkl.verbose(torch.backends.mkl.VERBOSE_ON):
    a @ a
with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
    torch.relu(torch.randn(1, 3, 8, 8).to_mkldnn())  # any oneDNN primitive prints its isa
"""


def report() -> dict[str, str | None]:
    """{"torch": capability, "mkl": the processors MKL's banner names, "onednn": its isa}; None
    where this torch build has no such library (MKL and oneDNN are x86 only)."""
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, check=True
    ).stdout
    torch_cap = re.search(r"^torch: (\S+)", out, re.M)
    mkl = re.search(r"^MKL_VERBOSE oneMKL.* architecture (.*?) processors", out, re.M)
    onednn = re.search(r"^onednn_verbose,.*isa:(.*)$", out, re.M)
    return {
        "torch": torch_cap.group(1) if torch_cap else None,
        "mkl": mkl.group(1) if mkl else None,
        "onednn": onednn.group(1).strip() if onednn else None,
    }


def low_problems(found: dict[str, str | None]) -> list[str]:
    """What in `found` says that LOW_KERNELS did not take effect."""
    problems = []
    if found["torch"] != "DEFAULT":
        problems.append(f"torch runs {found['torch']} kernels, not DEFAULT")
    if found["mkl"] is not None and "AVX" in found["mkl"]:
        problems.append(f"MKL runs its code for {found['mkl']}")
    if found["onednn"] is not None and re.search(r"AVX|AMX", found["onednn"]):
        problems.append(f"oneDNN runs {found['onednn']}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--expect", choices=["low"], help="fail unless LOW_KERNELS took effect")
    args = parser.parse_args(argv)
    found = report()
    names = {"torch": "torch CPU capability", "mkl": "MKL code path", "onednn": "oneDNN isa"}
    for key, value in found.items():
        print(f"{names[key]:<21} {value or '(not in this build)'}")
    if args.expect == "low":
        missing = {k: v for k, v in LOW_KERNELS.items() if os.environ.get(k) != v}
        problems = [f"{k}={v} is not set" for k, v in missing.items()] + low_problems(found)
        if problems:
            print("the lower kernels are not in effect: " + "; ".join(problems), file=sys.stderr)
            return 1
        print("lower kernels in effect: " + " ".join(f"{k}={v}" for k, v in LOW_KERNELS.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
