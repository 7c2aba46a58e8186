"""Lesson 11: the links a replay prices communication on: α-β models (tpedu.comm.cost_model) by name.

    free         α = β = 0: communication costs nothing (what the schedules' formulas assume)
    loopback     gloo over this machine's loopback, as `tpedu commbench` fits it (pass the
                 fitted AlphaBeta, or `measure_loopback()` on the ranks; the stored default
                 is one 2-core laptop's fit)
    nvlink       H100 SXM inside a node (NVLink 4, 450 GB/s one way · 0.8 a ring reaches)
    pcie         H100 PCIe inside a node (PCIe 5, 64 GB/s)
    infiniband   across nodes, one 400 Gb/s NIC per GPU

The presets are the cluster what-if's (tpedu.analysis.whatif), so a replay and the what-if
price the same link the same way. Compute can be priced too: `device_factor` turns a rank's
FLOPs at a named GPU's efficiency into the factor a replay multiplies CPU time by.
"""

from __future__ import annotations

import torch.distributed as dist

from tpedu.analysis.whatif import H100_PCIE, H100_SXM, HARDWARE
from tpedu.comm.cost_model import AlphaBeta, fit, measure

# One fit of `tpedu commbench --nprocs 2` on a 2-core AMD EPYC laptop (gloo, loopback):
# latency-bound (0.3-1.5 ms per step between runs), so measure on the machine when it matters.
LOOPBACK = AlphaBeta(alpha=450e-6, beta=1 / 0.9e9)

LINKS: dict[str, AlphaBeta] = {
    "free": AlphaBeta(0.0, 0.0),
    "loopback": LOOPBACK,
    "nvlink": H100_SXM.intra,
    "pcie": H100_PCIE.intra,
    "infiniband": H100_SXM.inter,
}


def link(name: str | AlphaBeta) -> AlphaBeta:
    """The α-β model named `name` (one of LINKS), or `name` itself if it is one already."""
    if isinstance(name, AlphaBeta):
        return name
    if name not in LINKS:
        raise ValueError(f"unknown link {name!r}; use one of {', '.join(LINKS)} or an AlphaBeta")
    return LINKS[name]


def measure_loopback(
    sizes: tuple[int, ...] = (4096, 65536, 1 << 20), group: dist.ProcessGroup | None = None
) -> AlphaBeta:
    """Fit α and β of this machine's link on the ranks of `group` (a collective, as
    `tpedu commbench`: all-reduce, all-gather and reduce-scatter at each size)."""
    samples = []
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        samples += measure(op, list(sizes), group=group, repeats=5)
    return fit(samples)


# The device a priced replay stands for by default, at this share of its peak (the what-if's).
DEVICE, EFFICIENCY = "H100 SXM", 0.7


def device_factor(
    flops: float, cpu_seconds: float, device: str = DEVICE, efficiency: float = EFFICIENCY
) -> float:
    """The factor that turns `cpu_seconds` of recorded compute into the time `flops` take on
    `device` (a name of tpedu.analysis.whatif.HARDWARE) at `efficiency` of its peak."""
    if device not in HARDWARE:
        raise ValueError(f"unknown device {device!r}; use one of {', '.join(HARDWARE)}")
    if cpu_seconds <= 0:
        raise ValueError("device_factor needs the recorded compute's CPU seconds (> 0)")
    return flops / (HARDWARE[device].peak_flops * efficiency) / cpu_seconds
