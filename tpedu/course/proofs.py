"""Lessons 00–15: the proofs, run on the exercise's code: the module `pick` returned (the
learner's functions where written, the reference's for the rest). Each prints whose code ran and
one line per claim, and a failed claim raises naming the bugs that usually cause it.

Lesson 00, the memory ledger:

    ledger(m, model)                 # training_bytes, embedding_bytes, gpt_params vs a TinyGPT

Lesson 04, the parallel MLP:

    par = ParallelMLP.from_dense(dense)
    route(m, par.fc1, par.fc2)       # the layers now run m.column_parallel_linear and m.row_...
    result = tpedu.launch(mlp_vs_dense, 2, m, "gelu", 6, 16, 2, 3)[0]
    show_mlp(m, result)              # one line per claim; raises with its likely causes

Lesson 12, buckets and ZeRO; lesson 15, the α-β price:

    buckets(m)                       # assign_buckets, all_reduce_bucket on 2 ranks
    zero(m)                          # reduce_scatter_mean, LazyParams, zero_bytes_per_rank
    alpha_beta(m, records, links)    # the ring by hand, a traced step, the fit
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.distributed as dist
from torch import nn

import tpedu
from tpedu.analysis.memory import GB
from tpedu.comm.tracer import CommTracer
from tpedu.course import claims
from tpedu.course.grading import ran
from tpedu.tp.dense import DenseMLP
from tpedu.tp.layers import ColumnParallelLinear, RowParallelLinear
from tpedu.tp.mlp import ParallelMLP
from tpedu.tp.operators import scatter_to_tp_region


def ledger(m: ModuleType, model: nn.Module) -> None:
    """Lesson 00: print and assert the ledger's claims on `m`'s functions (exercise l00, as
    `pick` returned it): 16 bytes per parameter, a [vocab, hidden] table, and gpt_params of
    `model`'s shape equal to its parameters counted as real tensors (`model`: a TinyGPT)."""
    print(f"{ran(m, 'training_bytes', 'embedding_bytes', 'gpt_params')}:")
    state = m.training_bytes(35 * 10**9)
    claims.claim(
        f"35B × 16 B = {state / GB:.1f} GB",
        state == 560 * GB,
        causes="a default byte count other than 2 + 2 + 12; the three not summed per parameter",
    )
    table = m.embedding_bytes(50_000, 4096, 1)
    claims.claim(
        f"50k × 4096 embedding = {table / 1e6:.1f}M params",
        table == 50_000 * 4096,
        causes="bytes_per_param ignored (the default used); the table not vocab × hidden",
    )
    c, real = model.config, sum(p.numel() for p in model.parameters())
    count = m.gpt_params(
        c.n_layers, c.hidden, c.vocab_size, c.seq_len, ffn_hidden=c.ffn_hidden,
        heads=c.n_heads, kv_heads=c.n_kv_heads, tied_embeddings=c.tie_embeddings, bias=c.bias,
    )  # fmt: skip
    claims.claim(
        f"gpt_params {count:,} == the real TinyGPT's {real:,} parameters",
        count == real,
        causes="a bias, a LayerNorm or the learned positions left out; the head counted "
        "although tied to the token table",
    )


TOL = 1e-12  # float64: reordered sums and BLAS kernel choice cost ~1e-15; a real bug costs O(1)

# What breaks each claim of lesson 04, in the words of the lesson.
BIAS_T_TIMES = "row bias added t times (before the all-reduce of the partial sums)"
NO_F = "f missing: no all-reduce of dL/dx in the column layer's backward (copy_to_tp_region)"
NO_FBAR = "f̄ missing: the row layer's partial sums never all-reduced (reduce_from_tp_region)"
FBAR_BACKWARD = "f̄ that all-reduces in backward too (its backward must be the identity)"
COLUMN_BIAS = "column bias not the slice of the weight's rows (use this rank's bias shard)"
CAUSES = {
    "column y_r - dense slice": f"{COLUMN_BIAS}; output gathered when gather_output is False",
    "row y - dense y": f"{BIAS_T_TIMES}; {NO_FBAR}",
    "y - dense y": f"{BIAS_T_TIMES}; {NO_FBAR}; {COLUMN_BIAS}",
    "dL/dx - dense": f"{NO_F}; {FBAR_BACKWARD}",
    "dL/dW1 (gathered) - dense": FBAR_BACKWARD,
    "dL/db1 (gathered) - dense": FBAR_BACKWARD,
    "dL/dW2 (gathered) - dense": FBAR_BACKWARD,
    "dL/db2 - dense": f"{BIAS_T_TIMES}; {FBAR_BACKWARD}",
    "forward": f"{NO_FBAR}; an all-gather in the column layer when gather_output is False",
    "backward": f"{NO_F}; {FBAR_BACKWARD}",
}


def route(m: ModuleType, *layers: nn.Module) -> None:
    """Make tpedu's ColumnParallelLinear / RowParallelLinear `layers` run the functions of `m`
    (exercise l04, as `pick` returned it) on their own shards, instead of tpedu's."""
    for layer in layers:
        if isinstance(layer, ColumnParallelLinear):
            if layer.sequence_parallel or layer.inverse_order is not None:
                raise ValueError("route: the exercise's column layer has no SP or row_order")

            def column(x: torch.Tensor, layer: ColumnParallelLinear = layer) -> torch.Tensor:
                return m.column_parallel_linear(
                    x, layer.weight, layer.bias, layer.group, layer.gather_output
                )

            layer.forward = column
        elif isinstance(layer, RowParallelLinear):
            if layer.sequence_parallel:
                raise ValueError("route: the exercise's row layer has no sequence parallelism")

            def row(x: torch.Tensor, layer: RowParallelLinear = layer) -> torch.Tensor:
                if not layer.input_is_parallel:  # the layer keeps its own chunk, as tpedu's
                    x = scatter_to_tp_region(x, layer.group)
                return m.row_parallel_linear(x, layer.weight, layer.bias, layer.group)

            layer.forward = row
        else:
            raise TypeError(f"route: {type(layer).__name__} is not a tpedu parallel linear layer")


def _randn(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(tpedu.device())


def mlp_vs_dense(
    m: ModuleType, activation: str, hidden: int, ffn: int, batch: int, seq: int
) -> dict:
    """On every rank: a ParallelMLP whose layers run `m`'s functions (route) against the dense
    MLP it was built from, dropout on: max |parallel - dense| of the output, dL/dx and every
    weight and bias gradient (shards gathered), and the collectives traced per phase."""
    torch.manual_seed(0)
    dense = DenseMLP(
        hidden, ffn, activation, hidden_dropout=0.2, output_dropout=0.1, seed=7,
        dtype=torch.float64,
    ).to(tpedu.device())  # fmt: skip
    par = ParallelMLP.from_dense(dense)  # training mode: dropout is ON in both
    route(m, par.fc1, par.fc2)  # SwiGLU feeds gate and up itself (one f), so fc1 runs for GeLU
    x, g = _randn(3, (batch, seq, hidden)), _randn(4, (batch, seq, hidden))
    xd, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    (dense(xd, step=0) * g).sum().backward()
    with CommTracer() as trace:
        y = par(xp, step=0)
        (y * g).sum().backward()

    def gap(a: torch.Tensor, b: torch.Tensor) -> float:
        return (a - b).abs().max().item()

    fc1, fc2 = par.fc1, par.fc2
    return {
        "activation": activation,
        "diffs": {
            "y - dense y": gap(y, dense(x, step=0)),
            "dL/dx - dense": gap(xp.grad, xd.grad),
            "dL/dW1 (gathered) - dense": gap(fc1.dense_weight(grad=True), dense.fc1.weight.grad),
            "dL/db1 (gathered) - dense": gap(fc1.dense_bias(grad=True), dense.fc1.bias.grad),
            "dL/dW2 (gathered) - dense": gap(fc2.dense_weight(grad=True), dense.fc2.weight.grad),
            "dL/db2 - dense": gap(fc2.dense_bias(grad=True), dense.fc2.bias.grad),
        },
        "dropped": int((y == 0).sum()),
        "outputs": y.numel(),
        "calls": {p: trace.count(op="all_reduce", phase=p) for p in ("forward", "backward")},
        "others": trace.count() - trace.count(op="all_reduce"),
        "table": trace.table(),
        "tp": dist.get_world_size(),
    }


def show_mlp(m: ModuleType, result: dict, tol: float = TOL) -> None:
    """Print and assert lesson 04's claims on one `mlp_vs_dense` result: parallel == dense for
    the output and every gradient, and exactly 1 all-reduce forward and 1 backward. A failed
    claim raises AssertionError naming its likely causes."""
    pieces = ["row_parallel_linear"]
    if result["activation"] != "swiglu":
        pieces.insert(0, "column_parallel_linear")
    print(
        f"{result['activation']}, tp={result['tp']}, dropout on ({result['dropped']} of "
        f"{result['outputs']} outputs dropped), {ran(m, *pieces)}:"
    )
    for name, diff in result["diffs"].items():
        claims.check("", diff, tol, name, causes=CAUSES[name])
    for phase, calls in result["calls"].items():
        claims.claim(
            f"{phase}: {calls} all-reduce",
            calls == 1 and result["others"] == 0,
            f"{calls} all-reduce(s) and {result['others']} other collective(s), want exactly 1",
            CAUSES[phase],
        )
    print(result["table"], "\n")


def _bucket_worker(m: ModuleType) -> tuple[list, int, int]:
    """On every rank: rank r's gradients are (r + 1)·[ones(2, 3), arange(4)]; the bucket's
    means, and the all-reduces and other collectives it took."""
    r, dev = dist.get_rank(), tpedu.device()
    grads = [torch.full((2, 3), float(r + 1), device=dev), torch.arange(4.0, device=dev) * (r + 1)]
    with CommTracer() as trace:
        out = m.all_reduce_bucket(grads)
    calls = trace.count(op="all_reduce")
    return [o.tolist() for o in out], calls, trace.count() - calls


def buckets(m: ModuleType) -> None:
    """Lesson 12: print and assert the claims on `m`'s bucket pieces (exercise
    l12_bucketed_allreduce, as `pick` returned it): buckets filled from the last parameter, and
    a bucket averaged over 2 ranks with one all-reduce."""
    print(f"{ran(m, 'assign_buckets', 'all_reduce_bucket')}:")
    got = m.assign_buckets([7, 3, 5, 2], 6)
    claims.claim(
        "assign_buckets([7, 3, 5, 2], 6) = [[3, 2], [1, 0]], the last parameters first",
        got == [[3, 2], [1, 0]],
        f"got {got}",
        "buckets filled from the first parameter (backward finishes the last first); a bucket "
        "closed before it holds bucket_numel elements",
    )
    want = [[[1.5] * 3] * 2, [0.0, 1.5, 3.0, 4.5]]
    runs = tpedu.launch(_bucket_worker, 2, m)
    claims.claim(
        "all_reduce_bucket on 2 ranks: 1 all-reduce; means 1.5 and [0.0, 1.5, 3.0, 4.5]",
        all(out == want and calls == 1 and others == 0 for out, calls, others in runs),
        f"rank 0 got {runs[0][0]} with {runs[0][1]} all-reduce(s), {runs[0][2]} other(s)",
        "one all-reduce per tensor, not one per bucket; the sum not divided by the number of "
        "ranks; the flat buffer not cut back into the tensors' shapes",
    )


def _zero_worker(m: ModuleType) -> tuple[list, int, list, int, int]:
    """On every rank: (r + 1)·arange(5) reduce-scattered; that shard as a LazyParams of 5
    elements: (shard, bytes at rest, gathered values, bytes gathered, bytes after free)."""
    flat = torch.arange(5.0, device=tpedu.device()) * (dist.get_rank() + 1)  # pad 1 on 2 ranks
    shard = m.reduce_scatter_mean(flat)
    lazy = m.LazyParams(shard, 5)
    rest = lazy.held_bytes()
    whole = lazy.gather().tolist()
    held = lazy.held_bytes()
    lazy.free()
    return shard.tolist(), rest, whole, held, lazy.held_bytes()


PAPER = (120.0, 31.4, 16.6, 1.9)  # ZeRO's Figure 1: GB per rank, 7.5 B parameters, 64 ranks


def zero(m: ModuleType) -> None:
    """Lesson 12: print and assert the claims on `m`'s ZeRO pieces (exercise l12_zero, as
    `pick` returned it) on 2 ranks: the shards of the mean, the bytes LazyParams holds at rest,
    gathered and freed, and zero_bytes_per_rank against the paper's Figure 1."""
    print(f"{ran(m, 'reduce_scatter_mean', 'LazyParams', 'zero_bytes_per_rank')}:")
    runs = tpedu.launch(_zero_worker, 2, m)
    shards = [r[0] for r in runs]
    claims.claim(
        "reduce_scatter_mean: rank 0 [0.0, 1.5, 3.0], rank 1 [4.5, 6.0, 0.0]",
        shards == [[0.0, 1.5, 3.0], [4.5, 6.0, 0.0]],
        f"got {shards}",
        "the sum not divided by the number of ranks; no padding to a multiple of N (the last "
        "shard short); the shards not in rank order",
    )
    seen = [r[1:] for r in runs]
    claims.claim(
        "LazyParams: 0 bytes whole at rest, 24 gathered ([0.0, 1.5, 3.0, 4.5, 6.0]), 0 after free",
        all(s == (0, [0.0, 1.5, 3.0, 4.5, 6.0], 24, 0) for s in seen),
        f"(at rest, gathered, held, after free) per rank: {seen}",
        "the whole buffer kept at rest or after free (resize its storage to 0); the padding "
        "not cut off by gather",
    )
    gb = [sum(m.zero_bytes_per_rank(7.5e9, 64, k)) / 1e9 for k in range(4)]
    claims.claim(
        f"7.5 B parameters on 64 ranks, GB per rank, ZeRO-0..3: {list(PAPER)} (the paper's)",
        all(abs(g - p) <= 0.05 for g, p in zip(gb, PAPER, strict=True)),  # its digits
        f"got {gb}",
        "a stage that shards the wrong part (1: the optimizer states, 2: and the gradients, 3: "
        "and the weights); bytes per parameter other than 2 + 2 + 12",
    )


def alpha_beta(m: ModuleType, records: list, links: dict) -> None:
    """Lesson 15: print and assert the claims on `m`'s pieces (exercise l15_alpha_beta, as
    `pick` returned it): the ring all-reduce by hand, step_comm_seconds on a step's tracer
    `records` against cost_model's price under each AlphaBeta of `links`, and α, β fitted back
    from exact times."""
    print(f"{ran(m, 'ring_all_reduce_seconds', 'step_comm_seconds', 'fit_alpha_beta')}:")
    # 4 ranks, 8 bytes: 6 steps of one 2-byte chunk, each 0.5 + 2 * 0.25 = 1 s
    ring = m.ring_all_reduce_seconds(8, 4, 0.5, 0.25)
    claims.claim(
        "ring all-reduce, 8 bytes on 4 ranks at α 0.5 s, β 0.25 s/B: 6.0 s",
        ring == 6.0,
        f"got {ring} s",
        "N - 1 steps instead of 2(N - 1); each step sending all n bytes, not a chunk of n/N",
    )
    for name, ab in links.items():
        got = m.step_comm_seconds(records, ab.alpha, ab.beta)
        want = sum(ab.predict(r.op, r.bytes, r.group_size) for r in records)
        claims.check(
            f"{name:<20} {1e3 * want:8.3f} ms, relative",
            abs(got - want) / want,
            1e-12,
            "step_comm_seconds - cost_model",
            causes="an op priced with another's steps (all-reduce 2(N - 1), all-gather and "
            "reduce-scatter N - 1); a one-rank group not free; the bytes not split n/N",
        )
    sizes = [2**k for k in range(10, 21, 2)]  # 1 KiB to 1 MiB, the CPU box's link
    alpha, beta = m.fit_alpha_beta(sizes, [5e-4 + n / 0.5e9 for n in sizes])
    claims.check(
        "fitted from exact times: α 500 µs, 1/β 0.5 GB/s, relative",
        max(abs(alpha - 5e-4) / 5e-4, abs(beta - 2e-9) / 2e-9),
        1e-12,
        "fit - truth",
        causes="α and β swapped (α is the constant term, β the one per byte); a fit that "
        "clips α or β to 0 when the data need neither",
    )
