"""Grades exercises/l19_ring_allgather_matmul.py: all-gather ─► matmul as a ring.

Exactness: x and the weight are random integers stored as float64, so every product is an exact
integer whatever the kernel or the order: the result must equal all_gather(x) @ weightᵀ bit for
bit (0.0). The ranks' shards differ, so a shard's rows in the wrong place cannot pass. The rank
recorder (tpedu.comm.recorder) shows every message with its peer and every wait, so the ring's
direction, its t-1 sends of one shard, and the matmul done while the next shard travels are
checked too; an all-gather (the library's, or none traced at all) fails them. tpedu's own ring
(tpedu.tp.collective_matmul) refuses to run while the learner's function does, through any
reference to it, so a wrapper or an alias of it fails too.
"""

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

import tpedu
from tests.exercises import parity_group, refusing
from tpedu.comm import recorder
from tpedu.comm.recorder import Comm, Wait
from tpedu.course.grading import implementation
from tpedu.tp import collective_matmul

NAME = "l19_ring_allgather_matmul"
TWINS = (
    collective_matmul.ring_gather_apply,
    collective_matmul.ring_reduce_scatter_apply,
    collective_matmul.RingAllGatherLinear.forward,
)
B, N, H, OUT = 2, 3, 5, 4  # x [B, N, H] per rank: s = N·t; weight [OUT, H]
MATMULS = {
    torch.matmul,
    torch.mm,
    torch.bmm,
    torch.einsum,
    torch.tensordot,
    torch.nn.functional.linear,
    torch.Tensor.__matmul__,
    torch.Tensor.__rmatmul__,
    torch.Tensor.matmul,
    torch.Tensor.mm,
    torch.Tensor.bmm,
}


def ints(seed: int, shape: tuple) -> torch.Tensor:
    """Random integers in [-9, 9] as float64; any rank can rebuild any other rank's tensor."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-9, 10, shape, generator=g).double().to(tpedu.device())


def _check(worker, world_sizes) -> None:
    for t in world_sizes:
        for rank, bad in enumerate(tpedu.launch(worker, t, timeout=30)):  # a hung ring: 30 s
            assert not bad, f"world size {t}, rank {rank}: " + "; ".join(bad)


def _diff(got: torch.Tensor, want: torch.Tensor) -> list[str]:
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        return [f"result {shape}, expected shape {tuple(want.shape)}"]
    if torch.equal(got, want):
        return []
    rows = [i for i in range(want.shape[1]) if not torch.equal(got[:, i], want[:, i])]
    return [f"rows {rows} of the sequence differ from all_gather(x) @ weightᵀ"]


@refusing(*TWINS)
def _values_worker() -> list[str]:
    m = implementation(NAME)
    t, r = dist.get_world_size(), dist.get_rank()
    shards = [ints(10 + q, (B, N, H)) for q in range(t)]
    weight = ints(99, (OUT, H))
    got = m.ring_all_gather_matmul(shards[r].clone(), weight)
    return _diff(got, torch.cat(shards, dim=1) @ weight.T)


def test_ring_equals_the_gathered_matmul() -> None:
    """Every rank gets all_gather(x) @ weightᵀ, rows in rank order, on 1 to 4 ranks."""
    _check(_values_worker, (1, 2, 3, 4))


class _Matmuls(TorchFunctionMode):
    """Logs, at every matmul, how many receives had been posted and how many waited for."""

    def __init__(self, rec: recorder.Recorder) -> None:
        super().__init__()
        self.rec, self.seen = rec, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in MATMULS:
            spans = self.rec.log.spans
            recvs = {i for i, s in enumerate(spans) if isinstance(s, Comm) and s.op == "recv"}
            waited = sum(isinstance(s, Wait) and s.comm in recvs for s in spans)
            self.seen.append((len(recvs), waited))
        return func(*args, **(kwargs or {}))


@refusing(*TWINS)
def _ring_worker() -> list[str]:
    m = implementation(NAME)
    t, r = dist.get_world_size(), dist.get_rank()
    x, weight = ints(20 + r, (B, N, H)), ints(98, (OUT, H))
    with recorder.Recorder(recorder.run_id()) as rec:
        m.ring_all_gather_matmul(x, weight)
    comms = rec.log.comms()
    bad = []
    others = sorted({c.op for c in comms} - {"send", "recv"})
    if others:
        bad.append(f"uses {others}: only send/recv (C.isend/C.irecv) are allowed")
    sends = [c for c in comms if c.op == "send"]
    recvs = [c for c in comms if c.op == "recv"]
    if len(sends) != t - 1 or len(recvs) != t - 1:
        bad.append(f"{len(sends)} sends and {len(recvs)} receives traced; the ring has t-1 each")
    if any(c.nbytes != x.numel() * x.element_size() for c in sends):
        bad.append(f"sent {[c.nbytes for c in sends]} bytes; each send is one shard of x")
    if any(c.peer != (r + 1) % t for c in sends) or any(c.peer != (r - 1) % t for c in recvs):
        bad.append(
            f"sent to {sorted({c.peer for c in sends})}, received from "
            f"{sorted({c.peer for c in recvs})}: rank {r} sends right to {(r + 1) % t} and "
            f"receives from the left, {(r - 1) % t}"
        )
    return bad


def test_ring_sends_one_shard_right_each_step() -> None:
    """Only sends and receives: t-1 of each, a whole shard each, to (r+1) and from (r-1)."""
    _check(_ring_worker, (2, 3, 4))


@refusing(*TWINS)
def _overlap_worker() -> list[str]:
    m = implementation(NAME)
    t, r = dist.get_world_size(), dist.get_rank()
    x, weight = ints(30 + r, (B, N, H)), ints(97, (OUT, H))
    with recorder.Recorder(recorder.run_id()) as rec, _Matmuls(rec) as mm:
        m.ring_all_gather_matmul(x, weight)
    want = [(min(k + 1, t - 1), k) for k in range(t)]  # posted, waited at matmul k
    if mm.seen != want:
        return [
            f"at each matmul (receives posted, receives waited for) was {mm.seen}; expected "
            f"{want}: one matmul per shard, the next shard's receive posted before it and "
            "waited for after it"
        ]
    return []


def test_each_shard_is_multiplied_while_the_next_travels() -> None:
    _check(_overlap_worker, (2, 3))


@refusing(*TWINS)
def _group_worker() -> list[str]:
    m = implementation(NAME)
    rank = dist.get_rank()
    group, members = parity_group()
    shards = {q: ints(40 + q, (B, N, H)) for q in members}
    weight = ints(96, (OUT, H))
    got = m.ring_all_gather_matmul(shards[rank].clone(), weight, group)
    bad = _diff(got, torch.cat([shards[q] for q in members], dim=1) @ weight.T)
    return [f"on group {members}: {b} (send/recv take global ranks)" for b in bad]


def test_group_argument() -> None:
    """On groups {0, 2} and {1, 3} of 4 ranks each ring runs within its group."""
    _check(_group_worker, (4,))
