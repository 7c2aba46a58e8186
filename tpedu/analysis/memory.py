"""Lesson 00: the training-memory ledger (显存账本), what one device holds while a GPT trains.

Four lines, all in bytes:

    weights       the parameters the forward reads (bf16: 2 bytes each)
    gradients     one per parameter (bf16: 2 bytes each)
    optimizer     AdamW in mixed precision keeps fp32 master weight, m and v: 12 bytes each
    activations   what the forward saves for the backward, per layer, per micro-batch in flight

So mixed-precision AdamW costs 2 + 2 + 12 = 16 bytes per parameter, and a 35B-parameter model
needs 35e9 · 16 B = 560 GB before a single activation: seven 80 GB GPUs just for the state.
Plain fp32 AdamW also costs 16 (4 weight + 4 grad + 8 for m and v; the weight is its own master
copy, so master = 0). Every byte count below is a parameter, so other recipes are one call away.

Parameter counts are exact for a GPT-2-style block (pre-LayerNorm, biases, GELU MLP): per layer
12h² + 13h, plus V·h token embeddings, s·h learned positions and a final LayerNorm (2h). They
live with the model's shape (tpedu.analysis.shape: `gpt_params`, `ModelShape.n_params`) and are
re-exported here. `TinyGPT` builds that model from plain torch.nn so tests can check the formula
against `sum(p.numel())`, and `measure_training_bytes` checks the byte counts against real storage.

Activation formulas are those of Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", Table 2 (16-bit activations, 1-byte dropout masks, per layer, for
sequence s, micro-batch b, hidden h, heads a, tensor-parallel size t).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from tpedu.analysis.shape import ModelShape, embedding_params, layer_params
from tpedu.analysis.shape import gpt_params as gpt_params  # re-exported: lesson 00 counts with it
from tpedu.model.config import RECOMPUTE
from tpedu.tp.sharding import divisors

GB = 1e9  # decimal gigabytes, as GPU data sheets (80 GB) and the seed (560 GB) count them


def training_bytes(
    n_params: int, weight_bytes: int = 2, grad_bytes: int = 2, optimizer_bytes: int = 12
) -> int:
    """Bytes of weights + gradients + optimizer state for `n_params` parameters (no activations).

    Defaults are mixed-precision AdamW: bf16 weight (2) + bf16 grad (2) + fp32 master, m, v (12).
    fp32 AdamW: weight_bytes=4, grad_bytes=4, optimizer_bytes=8 (m, v; no separate master).
    """
    return n_params * (weight_bytes + grad_bytes + optimizer_bytes)


def embedding_bytes(vocab: int, hidden: int, bytes_per_param: int = 2) -> int:
    """Bytes of a [vocab, hidden] embedding table at `bytes_per_param` (2 for bf16 weights).

    Pass bytes_per_param=16 for its whole training state under mixed-precision AdamW.
    """
    return embedding_params(vocab, hidden) * bytes_per_param


# --- activations (Korthikanti et al. 2022, Table 2) ---------------------------------------------


def activation_bytes_per_layer(
    seq_len: int,
    micro_batch: int,
    hidden: int,
    heads: int,
    tp: int = 1,
    sp: bool = False,
    recompute: str = "none",
) -> float:
    """Bytes one transformer layer saves for the backward, per Korthikanti et al. 2022.

    With s = seq_len, b = micro_batch, h = hidden, a = heads, t = tp, the paper's accounting
    (16-bit activations, 1-byte dropout masks) gives per layer:

        no parallelism           sbh(34 + 5as/h)            = TP at t=1
        tensor parallel          sbh(10 + 24/t + 5as/(ht))  (the 10 stays replicated, see below)
        tensor + sequence par.   sbh/t · (34 + 5as/h)       (everything sharded)
        selective recompute      drops the 5as/h term (softmax, its dropout, attention scores)
        full recompute           2sbh (only the layer input), 2sbh/t with sequence parallelism

    The 34 is 11 (attention, without the a·s² parts) + 19 (MLP) + 4 (two LayerNorms); the
    5as/h is the [b, a, s, s] softmax output (2 bytes), its dropout mask (1) and dropout output (2).
    Under TP the replicated 10 is: the two LayerNorm inputs (2 + 2), the QKV and fc1 inputs
    (2 + 2) and the two 1-byte dropout masks after attention and MLP (1 + 1).
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    _check_tp(tp)
    s, b, h, a, t = seq_len, micro_batch, hidden, heads, tp
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sp else 1)
    attention_scores = 0.0 if recompute == "selective" else 5 * a * s / h
    if sp:
        return sbh / t * (34 + attention_scores)
    return sbh * (10 + 24 / t + attention_scores / t)


def _check_tp(tp: int) -> None:
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive integer, got {tp!r}")


# --- the ledger -------------------------------------------------------------------------------


def check_parallel(config: ModelShape, tp: int = 1, pp: int = 1, dp: int = 1) -> None:
    """Raise a ValueError naming the problem and the fix if (tp, pp, dp) cannot split `config`."""
    for name, value in (("tp", tp), ("pp", pp), ("dp", dp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    c = config
    for what, n in (("heads", c.n_heads), ("kv heads", c.kv_heads), ("ffn hidden", c.ffn)):
        if n % tp:
            valid = ", ".join(str(d) for d in divisors(n) if d <= 64)
            raise ValueError(f"{n} {what} are not divisible by tp={tp}; valid tp values: {valid}")
    if config.hidden % config.n_heads:
        raise ValueError(f"hidden={config.hidden} is not divisible by heads={config.n_heads}")
    if pp > config.n_layers:
        raise ValueError(
            f"pp={pp} exceeds the {config.n_layers} layers; use pp <= {config.n_layers}"
        )


@dataclass(frozen=True)
class Ledger:
    """Per-device bytes of one training setup. `embedding` is already inside the first three."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    params: int  # parameters held by this device
    embedding: float  # bytes (weights + grads + optimizer) of the embedding share on this device
    label: str = ""

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations

    def fits(self, gpu_gb: float = 80.0) -> bool:
        return self.total <= gpu_gb * GB

    def table(self) -> str:
        """A fixed-format text table in GB (deterministic, for notebooks and tests)."""
        rows = [
            ("weights", self.weights),
            ("gradients", self.gradients),
            ("optimizer states", self.optimizer),
            ("activations", self.activations),
            ("total", self.total),
        ]
        lines = [f"per device: {self.label}"] if self.label else []
        lines += [f"{'':<34}{'GB':>10}", "-" * 44]
        for name, value in rows:
            if name == "total":
                lines.append("-" * 44)
            lines.append(f"{name:<34}{value / GB:>10.2f}")
        lines.append(f"{'  of which embedding (w+g+opt)':<34}{self.embedding / GB:>10.2f}")
        lines.append(f"{'parameters on this device':<34}{self.params / 1e9:>9.3f}B")
        return "\n".join(lines)


@dataclass(frozen=True)
class BytesPerParam:
    """What one parameter costs in each line of the state: the default is mixed-precision AdamW
    (bf16 weight and gradient, fp32 master + m + v: 2 + 2 + 12); fp32 AdamW is (4, 4, 8)."""

    weight: int = 2
    grad: int = 2
    optimizer: int = 12


def ledger(
    config: ModelShape,
    tp: int = 1,
    pp: int = 1,
    dp: int = 1,
    sp: bool = False,
    recompute: str = "none",
    zero: int = 0,
    per_param: BytesPerParam = BytesPerParam(),
) -> Ledger:
    """Per-device training memory of `config` under tensor/pipeline/data parallelism.

    Division rules (the device described is pipeline stage 0, the one with the most
    activations and the input embedding):

    - TP divides every per-layer matrix and the column-parallel biases by tp; the row-parallel
      biases and LayerNorms stay replicated. The token embedding (and an untied LM head) is
      vocab-parallel: ceil(V / tp) rows per rank (tpedu.tp.embedding.padded_vocab pads V to a
      multiple of tp).
      Learned positions and the final LayerNorm are replicated.
    - PP gives stage 0 ceil(L / pp) layers plus the input embedding and positions. With pp = 1
      the one stage also holds the final LayerNorm and the LM head; with pp > 1 those live on
      the last stage (which, for tied embeddings, keeps its own copy of the table).
    - DP divides nothing: every replica holds the full state, unless ZeRO shards it over the
      dp replicas (the ZeRO paper's 2Ψ + 2Ψ + KΨ, K = 12): stage 1 (`zero=1`) divides
      the optimizer states by dp, stage 2 the gradients too, stage 3 the weights too.
      (ZeRO-3's all-gathered block during a step is not counted: one layer's weights.)
    - Activations: per-layer bytes (activation_bytes_per_layer, for one micro-batch of
      config.micro_batch sequences) × layers on the stage × micro-batches in flight. Under the
      1F1B schedule stage 0 holds up to pp micro-batches, so the in-flight count is pp (this
      assumes at least pp micro-batches per step; pp = 1 gives 1). The embedding and logits
      activations are left out (the paper shows they are small next to L layers).

    `per_param` (BytesPerParam) holds the bytes of one parameter's weight, gradient and
    optimizer states.
    """
    check_parallel(config, tp, pp, dp)
    c = config
    sharded, replicated = layer_params(c.hidden, c.ffn, c.kv_dim, c.bias)
    layers = math.ceil(c.n_layers / pp)
    in_layers = layers * (sharded // tp + replicated)
    emb = math.ceil(c.vocab_size / tp) * c.hidden
    embedding = emb + c.seq_len * c.hidden
    if pp == 1:
        embedding += 0 if c.tie_embeddings else emb
        other = 2 * c.hidden if c.bias else c.hidden  # final LayerNorm
    else:
        other = 0
    params = in_layers + embedding + other
    w_div, g_div, o_div = (dp if zero >= k else 1 for k in (3, 2, 1))
    b = per_param
    each = b.weight / w_div + b.grad / g_div + b.optimizer / o_div  # bytes per parameter here
    acts = activation_bytes_per_layer(
        c.seq_len, c.micro_batch, c.hidden, c.n_heads, tp, sp, recompute
    )
    return Ledger(
        weights=params * b.weight / w_div,
        gradients=params * b.grad / g_div,
        optimizer=params * b.optimizer / o_div,
        activations=acts * layers * pp,
        params=params,
        embedding=embedding * each,
        label=f"tp={tp} pp={pp} dp={dp}"
        + (" sp" if sp else "")
        + (f" recompute={recompute}" if recompute != "none" else "")
        + (f" zero{zero}" if zero else ""),
    )


# --- measuring a real model --------------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self, c: ModelShape) -> None:
        super().__init__()
        h, hd = c.hidden, c.head_dim
        self.heads, self.kv_heads = c.n_heads, c.kv_heads
        self.ln1 = nn.LayerNorm(h, bias=c.bias)
        self.q = nn.Linear(h, h, bias=c.bias)
        self.kv_proj = nn.Linear(h, 2 * c.kv_heads * hd, bias=c.bias)  # K and V, each kv_heads·hd
        self.out = nn.Linear(h, h, bias=c.bias)
        self.ln2 = nn.LayerNorm(h, bias=c.bias)
        self.fc1 = nn.Linear(h, c.ffn, bias=c.bias)
        self.fc2 = nn.Linear(c.ffn, h, bias=c.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        y = self.ln1(x)
        q = self.q(y).view(b, s, self.heads, -1).transpose(1, 2)
        k, v = self.kv_proj(y).view(b, s, 2, self.kv_heads, -1).permute(2, 0, 3, 1, 4)
        rep = self.heads // self.kv_heads  # grouped-query attention: share each K, V head
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    """A GPT-2-style model in plain torch.nn whose parameter count is exactly gpt_params(config).

    Only for checking the ledger against real tensors; the course's model comes in later lessons.
    """

    def __init__(self, config: ModelShape) -> None:
        super().__init__()
        c = self.config = config
        check_parallel(c)
        self.tok = nn.Embedding(c.vocab_size, c.hidden)
        self.pos = nn.Embedding(c.seq_len, c.hidden) if c.seq_len else None
        self.blocks = nn.ModuleList(_Block(c) for _ in range(c.n_layers))
        self.ln_f = nn.LayerNorm(c.hidden, bias=c.bias)
        self.head = None if c.tie_embeddings else nn.Linear(c.hidden, c.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx [b, s] token ids -> logits [b, s, vocab]."""
        x = self.tok(idx)
        if self.pos is not None:
            x = x + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        return F.linear(x, self.tok.weight) if self.head is None else self.head(x)


@dataclass(frozen=True)
class MeasuredBytes:
    """Bytes a real model and optimizer hold, each storage counted once."""

    params: int  # parameter count
    weights: int  # bytes of parameter storage
    gradients: int  # bytes of .grad storage
    optimizer: int  # bytes of per-parameter optimizer state (AdamW: m and v)
    bookkeeping: int  # other optimizer state (AdamW: one scalar `step` per parameter tensor)

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.bookkeeping


def _nbytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (a tied weight counts once)."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[(str(t.device), s.data_ptr())] = s.nbytes()
    return sum(seen.values())


def measure_training_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> MeasuredBytes:
    """Measure the bytes of `model`'s parameters, gradients and `optimizer`'s state.

    Call it after at least one backward and optimizer.step() (AdamW creates m and v lazily).
    State tensors shaped like their parameter count as `optimizer`; the rest (AdamW's scalar
    step counters) as `bookkeeping`, so fp32 AdamW measures 4 + 4 + 8 bytes per parameter.
    """
    params = list(model.parameters())  # deduplicated by nn.Module: a tied weight appears once
    grads = [p.grad for p in params if p.grad is not None]
    per_param, other = [], []
    for p, state in optimizer.state.items():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                (per_param if value.shape == p.shape else other).append(value)
    return MeasuredBytes(
        params=sum(p.numel() for p in params),
        weights=_nbytes(params),
        gradients=_nbytes(grads),
        optimizer=_nbytes(per_param),
        bookkeeping=_nbytes(other),
    )


def adamw_step(model: TinyGPT, batch: int = 2, seed: int = 0) -> torch.optim.AdamW:
    """One real AdamW step on random tokens (so gradients and optimizer state exist)."""
    g = torch.Generator().manual_seed(seed)
    c = model.config
    dev = next(model.parameters()).device
    idx = torch.randint(c.vocab_size, (batch, c.seq_len or 8), generator=g).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    logits = model(idx[:, :-1])
    F.cross_entropy(logits.reshape(-1, c.vocab_size), idx[:, 1:].reshape(-1)).backward()
    opt.step()
    return opt


def peak_rss_growth(fn: Callable[[], object]) -> tuple[int, object]:
    """(bytes `fn()` added to this process's peak resident set, its result). Linux only: the
    peak (VmHWM) is reset to the current resident set first, through /proc/self/clear_refs."""

    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
        raise KeyError(key)

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS")
    result = fn()
    return status("VmHWM") - before, result
