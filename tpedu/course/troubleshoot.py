"""Lesson 16: tools for "my tensor-parallel run is wrong (or stuck): where?".

The strongest check there is: the same model, the same batch, once dense and once tensor
parallel, compared gradient by gradient. A bug in a TP region shows up in exactly the
parameters whose gradient flows through it (a missing backward all-reduce: everything *before*
the f that lost it; unsynchronised SP norms: only the norms), so the per-parameter table below
points at the layer to read. In float64 a correct TP model agrees with dense to ~1e-15 relative;
anything above ~1e-9 is a bug, not rounding.

    cmp = compare_with_dense(config, group, (ids, targets))  # on every rank of the TP group
    print(cmp.table())                                        # per-parameter gradient norms
    cmp.ok                                                    # loss and grads within tolerance

Other tools: `replica_divergence` (replicated parameters or gradients that differ across the
ranks holding them: dropout masks, unsynchronised norms), `debug_env` (the environment
variables that make PyTorch and NCCL say what they are doing), `GUIDE` (symptom -> cause), and
`reduction_order_gap` (how far TP and dense legitimately differ in fp32 / bf16).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tpedu.comm import collectives
from tpedu.comm.device import device
from tpedu.course.claims import within
from tpedu.model.dense import DenseGPT
from tpedu.model.gpt import TPGPT
from tpedu.model.options import RunOptions

# float64: a correct TP model differs from dense only by reordered sums (~1e-16 relative per
# operation, ~1e-15 after a few layers); a bug changes results at the 1e-3..1 level.
TOLERANCE = 1e-9


@dataclass
class Comparison:
    """The dense vs TP comparison of one step, as seen by one rank."""

    loss_dense: float
    loss_tp: float
    grads: list[tuple[str, float, float]] = field(default_factory=list)  # (name, ‖dense‖, ‖tp‖)
    grad_diff: dict[str, float] = field(default_factory=dict)  # name -> ‖tp - dense‖ / ‖dense‖

    @property
    def loss_diff(self) -> float:
        """|loss_tp - loss_dense| / |loss_dense|."""
        return abs(self.loss_tp - self.loss_dense) / max(abs(self.loss_dense), 1e-30)

    @property
    def worst(self) -> tuple[str, float]:
        """(parameter, relative difference) of the worst gradient."""
        if not self.grad_diff:
            return ("-", 0.0)
        name = max(self.grad_diff, key=self.grad_diff.__getitem__)
        return name, self.grad_diff[name]

    @property
    def ok(self) -> bool:
        """Loss and every gradient within TOLERANCE (relative)."""
        return self.loss_diff <= TOLERANCE and self.worst[1] <= TOLERANCE

    def summary(self) -> str:
        """The loss's and the worst gradient's relative differences, each as a claim."""
        return summary(self.loss_diff, *self.worst)

    def table(self, only_bad: bool = False) -> str:
        """Per-parameter gradient norms, dense vs TP, and their relative difference."""
        head = f"{'parameter':<28} {'|grad| dense':>12} {'|grad| tp':>12} {'rel diff':>9}"
        lines = [head, "-" * len(head)]
        for name, a, b in self.grads:
            d = self.grad_diff[name]
            if only_bad and d <= TOLERANCE:
                continue
            flag = "  <-" if d > TOLERANCE else ""
            lines.append(f"{name:<28} {a:>12.4e} {b:>12.4e} {within(d, TOLERANCE):>9}{flag}")
        lines.append(
            f"loss dense {self.loss_dense:.6f}  tp {self.loss_tp:.6f}  "
            f"rel diff {within(self.loss_diff, TOLERANCE)}"
        )
        return "\n".join(lines)


def summary(loss_diff: float, name: str, worst: float, tol: float = TOLERANCE) -> str:
    """One line for a step against dense: within `tol` the figures are the CPU's rounding and
    print as the bound; past it (a bug) the worst gradient is named with its difference."""
    grads = (
        f"every gradient {within(worst, tol)}"
        if worst <= tol
        else f"worst gradient {name} ({worst:.1e})"
    )
    return f"loss rel diff {within(loss_diff, tol)}, {grads}"


def compare_with_dense(
    config: object,
    group: dist.ProcessGroup | None,
    batch: tuple[torch.Tensor, torch.Tensor],
    step: int = 0,
    training: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    options: RunOptions | None = None,
) -> Comparison:
    """One forward+backward of DenseGPT and TPGPT (built from it) on the same batch; compare.

    Collective: call on every rank of `group`. batch: (ids, targets), each [b, s], the same on
    the group's ranks. `training=True` turns dropout on (the TP masks must equal the dense
    ones; `step` picks them); `seed` initialises the dense model, run in `dtype`; `options`:
    TPGPT's (e.g. RunOptions(sequence_parallel=True)). Runs `sync_grads()` as a training step
    does, then gathers the TP gradients into the dense layout (all-gathers) and compares each
    parameter's gradient with the dense one.
    """
    torch.manual_seed(seed)
    dense = DenseGPT(config).to(dtype)
    model = TPGPT(dense, group, options=options).to(dtype)
    dense.train(training)
    model.train(training)
    dev = device()  # built on the CPU (same init on every rank), run on this rank's device
    dense.to(dev)
    model.to(dev)
    ids, targets = (t.to(dev) for t in batch)
    loss_d = dense(ids, targets, step=step)
    loss_d.backward()
    loss_t = model(ids, targets, step=step)
    loss_t.backward()
    model.sync_grads()
    tp_grads = model.gather_state_dict(grads=True)
    cmp = Comparison(loss_d.item(), loss_t.item())
    for name, p in dense.named_parameters():
        if p.grad is None or name not in tp_grads:
            continue
        ref, got = p.grad.double(), tp_grads[name].double()
        a, b = ref.norm().item(), got.norm().item()
        cmp.grads.append((name, a, b))
        cmp.grad_diff[name] = (got - ref).norm().item() / max(a, 1e-30)
    return cmp


def replica_divergence(
    tensors: dict[str, torch.Tensor], group: dist.ProcessGroup | None = None
) -> dict[str, float]:
    """{name: max |x - x on the group's first rank|} for tensors that should be identical on
    every rank of `group` (replicated parameters, their gradients, replicated activations).

    Collective: 1 broadcast per tensor. A non-zero value means the replicas have drifted apart.
    """
    src = dist.get_global_rank(group, 0) if group is not None else 0
    out = {}
    for name, x in tensors.items():
        ref = collectives.broadcast(x.detach().clone().contiguous(), src, group)
        out[name] = (x.detach() - ref).abs().max().item()
    return out


def debug_env(backend: str = "nccl") -> dict[str, str]:
    """Environment variables that make a distributed run explain itself (set before launching).

    TORCH_DISTRIBUTED_DEBUG=DETAIL: checks that every rank calls the same collective with the
    same shapes (a mismatch becomes an error naming both, instead of a hang or garbage).
    NCCL_DEBUG=INFO: NCCL prints its rings/trees, transports (NVLink, IB, sockets) and errors.
    TORCH_NCCL_ASYNC_ERROR_HANDLING=1 + a short init timeout: a hang becomes an error.
    """
    env = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL", "TORCH_SHOW_CPP_STACKTRACES": "1"}
    if backend == "nccl":
        env.update(
            {
                "NCCL_DEBUG": "INFO",
                "NCCL_DEBUG_SUBSYS": "INIT,COLL",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
                "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            }
        )
    return env


GUIDE = """\
symptom                                     likely cause                                  tool
------------------------------------------  --------------------------------------------  ---------------------------------
loss at tp=N differs from tp=1 at step 0    forward bug: wrong split (fused QKV), wrong   compare_with_dense: loss diff
                                            group, padded vocab not masked, bias added t×
same loss, gradients differ (early layers)  a backward all-reduce is missing (f)          compare_with_dense: grads table
only norm / bias gradients differ           SP: replicated params not all-reduced         compare_with_dense, replica_divergence
replicated weights drift apart over steps   per-rank dropout masks / RNG, unsynced grads  replica_divergence
generated text differs per rank             argmax/sampling over one vocab shard          compare the ranks' tokens
run hangs at the first collective           ranks disagree on groups or on the order of   TORCH_DISTRIBUTED_DEBUG=DETAIL,
                                            collectives / sends                           NCCL_DEBUG=INFO, a timeout
TP collectives slow, or NCCL timeouts       TP group crosses a slow link (PCIe switch,    nvidia-smi topo -m: each TP group in one
                                            CPU socket, another node); NCCL P2P broken    NVLink domain; NCCL_DEBUG=INFO: transport;
                                            (driver/firmware); network jitter across      faster with NCCL_P2P_DISABLE=1 -> P2P is
                                            nodes                                         broken; fix: TP inside one node, a longer
                                                                                          timeout, check NIC drivers / switches
memory per GPU does not drop with tp        replicated embedding/LM head, the full dense  torch.cuda.max_memory_allocated() per
                                            model kept alive on every rank, activations   rank at tp 1, 2, 4 vs the ledger (lessons
                                            of replicated regions (no SP)                 00, 06, 08, 09); fix: vocab parallel, free
                                                                                          the dense copy, SP, recompute, smaller
                                                                                          micro-batch
NaN/inf in backward                         overflow (fp16/bf16), log(0), -inf - -inf     torch.autograd.detect_anomaly()
tiny loss gap (1e-7 fp32, 1e-3 bf16)        reduction order: NOT a bug                    reduction_order_gap
"""


def reduction_order_gap(
    config: object,
    group: dist.ProcessGroup | None,
    batch: tuple[torch.Tensor, torch.Tensor],
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16),
) -> dict[str, tuple[float, float]]:
    """{dtype: (|dense - float64| / |float64|, |tp - dense| / |float64|)} for the loss of
    batch = (ids, targets).

    Collective over `group`. Answers "is my loss difference a bug?" (Megatron-LM #1736): a
    correct TP model differs from the dense one by about as much as the dense one differs from
    the exact (float64) loss, because TP only reorders sums (partial matmuls, then an all-reduce).
    """
    torch.manual_seed(0)
    dense = DenseGPT(config)
    dev = device()
    ids, targets = (t.to(dev) for t in batch)
    with torch.no_grad():
        exact = DenseGPT(config).double()
        exact.load_state_dict(dense.state_dict())
        ref = exact.to(dev)(ids, targets).item()
        out = {}
        for dt in dtypes:
            d = DenseGPT(config).to(dt)
            d.load_state_dict(dense.state_dict())
            t = TPGPT(d, group).to(dev)
            d.to(dev)
            ld, lt = d(ids, targets).double().item(), t(ids, targets).double().item()
            out[str(dt).removeprefix("torch.")] = (
                abs(ld - ref) / abs(ref),
                abs(lt - ld) / abs(ref),
            )
    return out


def detect_anomaly() -> torch.autograd.detect_anomaly:
    """`with detect_anomaly(): loss.backward()` names the forward op whose backward made a NaN.

    Slow (it records a stack trace per op): for one debugging step, never for training.
    """
    return torch.autograd.detect_anomaly(check_nan=True)
