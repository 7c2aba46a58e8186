"""tpedu: tensor parallelism, built from one split matmul up to a 3D-parallel GPT.

Modules, one idea each:
    launcher      run a function on N ranks (notebook, test, CLI, torchrun)
    collectives   traced wrappers over torch.distributed collectives
    tracer        CommTracer: count calls and bytes per group, op and phase
    cost_model    the α-β model of collective time, fitted on this machine
    memory        the training-memory ledger (weights, gradients, optimizer, activations)
    matmul_split  column and row splits of one matmul, on one process
    ring          a ring all-reduce written with send/recv
    grading       the exercise grader behind `make grade`
"""

from tpedu.launcher import LaunchTimeout, RankError, device, launch, run

__version__ = "0.1.0"
__all__ = ["LaunchTimeout", "RankError", "device", "launch", "run", "__version__"]
