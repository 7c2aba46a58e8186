"""Lesson 19: what hiding TP's communication buys on an H100 node, priced from a step recorded
on CPU ranks.

    logs = tpedu.launch(record_block, tp, config, batch)[0]       # {way: every rank's log}
    rows = priced(logs, config, batch, hidden=4096, seq=4096)       # {way: Priced}
    print(table(rows))

One TP block of the small model runs forward and backward on tp real ranks, once per way
(WAYS: plain TP, micro-batch-split chunks, sequence parallelism, SP with collective matmul),
under the rank recorder (tpedu.comm.recorder). The replay (tpedu.analysis.clock.replay) then
prices the same spans as a 7B-like layer on H100 SXM:

    compute      every span × one factor per rank and way, so that the rank's recorded CPU
                 seconds become its 1/t of the layer's FLOPs (6·N + 12·s·h per token,
                 N = 12h², as tpedu.analysis.shape) at 70 % of the GPU's bf16 peak
                 (links.device_factor); every way and rank gets the same compute, only its
                 order and its cuts differ
    messages     every recorded message × (b·s·h·2 bytes of the big layer in bf16) / (the
                 small run's b·s·h·4 bytes in fp32): the same calls, the same count (so the
                 same α per message), each as large as the big layer's; the CPU time a
                 rank spent inside a call (gloo moving the data) is dropped: the link prices it
    links        the α-β NVLink preset of the cluster what-if (links.LINKS["nvlink"])

The assumption: a CPU span's share of the step is its share on the GPU (both are mostly
matmuls of the same shapes, cut the same way). What it leaves out: a GPU computing and
communicating at once slows both a little (NCCL takes SMs), which the papers' figures include.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tpedu.analysis.clock import links, replay
from tpedu.comm import recorder
from tpedu.comm.recorder import Comm, RankLog, Span, Wait
from tpedu.model.config import GPTConfig
from tpedu.model.dense import DenseGPT
from tpedu.model.gpt import TPGPT
from tpedu.model.options import RunOptions

WAYS = {  # name: (options, the way it is measured against)
    "tp": (RunOptions(), None),
    "tp, 2 chunks": (RunOptions(tp_overlap="chunks", tp_chunks=2), "tp"),
    "tp, 4 chunks": (RunOptions(tp_overlap="chunks", tp_chunks=4), "tp"),
    "sp": (RunOptions(sequence_parallel=True), None),
    "sp, ring": (RunOptions(sequence_parallel=True, tp_overlap="ring"), "sp"),
}


def layer_flops(hidden: int, seq: int, batch: int = 1) -> float:
    """Training FLOPs (forward + backward) of one GPT-2-style layer on batch × seq tokens:
    per token 6·12h² (the matmuls, 3 × 2 per weight) + 12·s·h (attention's two products)."""
    return batch * seq * (72 * hidden * hidden + 12 * seq * hidden)


def record_block(
    config: GPTConfig, batch: int, ways: tuple[str, ...] = tuple(WAYS), warmup: int = 2
) -> dict[str, list[RankLog]]:
    """On every rank of the launched job (tp = world size): one forward + backward of the
    first block of `config` per way in `ways`, x [batch, s, H] (SP ways: this rank's
    [batch, s/t, H]), recorded after `warmup` unrecorded steps. Returns {way: every rank's
    log} (collective: recorder.gather)."""
    torch.manual_seed(0)
    dense = DenseGPT(config)
    t, r = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, config.seq_len, config.hidden, generator=g)
    out = {}
    for way in ways:
        options = WAYS[way][0]
        block = TPGPT(dense, options=options).blocks[0]
        n = config.seq_len // t
        xin = x[:, r * n : (r + 1) * n] if options.sequence_parallel else x
        for i in range(warmup + 1):
            xi = xin.clone().requires_grad_()
            dist.barrier()  # every way starts together (outside the recorder)
            if i < warmup:
                block(xi).sum().backward()
                continue
            with recorder.Recorder(recorder.run_id()) as rec:
                block(xi).sum().backward()
        out[way] = recorder.gather(rec.log)
    return out


def _for_device(span: Span, factor: float) -> Span:
    if isinstance(span, Comm):
        return dataclasses.replace(span, nbytes=round(span.nbytes * factor), cpu=0.0)
    return dataclasses.replace(span, cpu=0.0) if isinstance(span, Wait) else span


def scale_bytes(logs: list[RankLog], factor: float) -> list[RankLog]:
    """Copies of `logs` for a device: every message's bytes × `factor` (the same calls,
    larger), and no CPU time inside communication calls (on CPU ranks that is gloo moving and
    adding the data, which the link's α-β time prices; on a GPU the call only launches it)."""
    return [
        dataclasses.replace(log, spans=[_for_device(s, factor) for s in log.spans]) for log in logs
    ]


@dataclass
class Priced:
    """One way's step on the priced clock (seconds, means over the ranks) and its messages."""

    way: str
    step: float
    compute: float
    exposed: float
    hidden: float
    messages: int  # communication calls per rank (collectives, sends and receives)
    base: str | None  # the way it is measured against

    @property
    def comm(self) -> float:
        """Seconds a rank's link is busy: exposed + hidden."""
        return self.exposed + self.hidden

    @property
    def hidden_share(self) -> float:
        return self.hidden / self.comm if self.comm else 0.0


def price(
    logs: list[RankLog],
    flops: float,
    byte_factor: float,
    link: str = "nvlink",
    device: str = links.DEVICE,
    efficiency: float = links.EFFICIENCY,
) -> replay.Timeline:
    """The replay of `logs` with compute priced as `flops` (the whole layer's; each of the t
    ranks does 1/t of them, so each rank's recorded CPU seconds become flops/t on `device` at
    `efficiency` of its peak: one rank's noise on the shared cores does not make the others
    wait) and messages × `byte_factor` on `link`."""
    share = flops / len(logs)
    factor = {
        log.rank: links.device_factor(share, log.compute_seconds(), device, efficiency)
        for log in logs
    }
    return replay.replay(scale_bytes(logs, byte_factor), link, factor)


def priced_timelines(
    logs: dict[str, list[RankLog]],
    config: GPTConfig,
    batch: int,
    hidden: int = 4096,
    seq: int = 4096,
    big_batch: int = 1,
    link: str = "nvlink",
) -> dict[str, replay.Timeline]:
    """{way: its priced replay} for the recorded `logs` of record_block(config, batch), as a
    layer of `hidden` and `seq` on `big_batch` sequences (bf16 messages), H100 SXM, `link`."""
    small = batch * config.seq_len * config.hidden * 4  # fp32
    factor = big_batch * seq * hidden * 2 / small  # bf16
    flops = layer_flops(hidden, seq, big_batch)
    return {way: price(ranks, flops, factor, link) for way, ranks in logs.items()}


def priced(logs: dict[str, list[RankLog]], *args: object, **kwargs: object) -> dict[str, Priced]:
    """{way: Priced}: priced_timelines(logs, ...) summed up per way (means over the ranks)."""
    out = {}
    for way, t in priced_timelines(logs, *args, **kwargs).items():
        calls = sum(len(log.comms()) for log in logs[way]) / len(logs[way])
        busy = sum(t.busy) / len(t.ranks)
        out[way] = Priced(way, t.step, busy, t.exposed, t.hidden, round(calls), WAYS[way][1])
    return out


def table(rows: dict[str, Priced]) -> str:
    """The priced rows as a table (ms on the priced clock; speed-up against each way's base)."""
    lines = [
        f"{'way':<14} {'step ms':>8} {'compute':>8} {'comm':>7} {'exposed':>8} {'hidden':>7} "
        f"{'messages':>8} {'speed-up':>9}"
    ]
    for r in rows.values():
        base = rows.get(r.base) if r.base else None
        speed = f"{base.step / r.step:.2f}x vs {r.base}" if base else ""
        lines.append(
            f"{r.way:<14} {r.step * 1e3:>8.3f} {r.compute * 1e3:>8.3f} {r.comm * 1e3:>7.3f} "
            f"{r.exposed * 1e3:>8.3f} {r.hidden * 1e3:>7.3f} {r.messages:>8d} {speed:>9}"
        )
    return "\n".join(lines)
