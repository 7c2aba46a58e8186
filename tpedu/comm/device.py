"""Course infrastructure: the device this rank computes on, from its process group's backend."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def device() -> torch.device:
    """The device this rank computes on: its own GPU under NCCL, else the CPU, unless
    $TPEDU_DEVICE=cuda puts every gloo rank's tensors on GPU 0: with one GPU (NCCL refuses
    two ranks on one device) that still runs multi-rank code on CUDA tensors, over gloo's CUDA
    collectives, so device-placement bugs show (tpedu.course.gpu_check uses it)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if os.environ.get("TPEDU_DEVICE") == "cuda":
        return torch.device("cuda", 0)
    return torch.device("cpu")
