"""Lesson 10: the measured activation ledger (激活显存账本), what one transformer layer saves for
backward.

`SavedTensorCounter` hooks autograd (torch.autograd.graph.saved_tensors_hooks): every tensor an
operation saves for its backward passes through the pack hook, which records its storage ONCE
(q, k and v are views of one QKV buffer; softmax's output is also what the dropout multiplies)
and the sub-module that saved it. Parameters are not activations and are skipped.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", §4)
count per layer, with 16-bit activations and 1-byte dropout masks (s sequence, b micro-batch,
h hidden, a heads, t tensor-parallel size):

    attention  11sbh + 5as²b: QKV input 2sbh, Q and K 4sbh, V 2sbh, softmax output 2as²b, its
               dropout mask as²b and output 2as²b, out-projection input 2sbh, dropout mask sbh
    MLP        19sbh: fc1 input 2sbh, GELU input 8sbh, fc2 input 8sbh, dropout mask sbh
    norms       4sbh: the two LayerNorm inputs

    no parallelism   sbh(34 + 5as/h)           TP + SP      sbh/t · (34 + 5as/h)
    TP               sbh(10 + 24/t + 5as/(ht))  selective    sbh(10 + 24/t), SP: 34sbh/t
    full recompute   2sbh (the layer input; 2sbh/t with SP)

A `LayerCase` is one row of that table at one shape: a tpedu.analysis.shape.ModelShape (its
seq_len, micro_batch, hidden, n_heads are the paper's s, b, h, a) with tp (t), sp and recompute;
`LayerCase.from_symbols(s, b, h, a, t, sp, recompute)` writes it in the paper's symbols.
`measure_layer` runs one tpedu TPBlock (gpt2-like: LayerNorm, GELU, biases, dropout on) in
bfloat16 and returns the measured bytes by category; `paper_terms` is the same table split the
same way. What tpedu saves beyond the paper, every byte accounted for by `known_extras`:

    dropout masks      index_dropout computes x · mask.to(x.dtype) / (1 - p): autograd keeps the
                       mask in the activation dtype, 2 bytes, not the paper's 1-byte mask. (Its
                       mask is a hash of the element index, so it could be recomputed for free
                       in backward and store nothing at all; that would be a custom Function.)
    norm statistics    LayerNorm also saves its per-position mean and 1/std: 2 · b·s numbers
                       per norm (the paper ignores these O(sb) terms).
    causal mask        masked_fill saves the [s, s] bool mask: s² bytes (not per batch or head).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch._dynamo  # see below
import torch.distributed as dist
from torch import nn

from tpedu.analysis.memory import RECOMPUTE, activation_bytes_per_layer, ledger
from tpedu.analysis.shape import ModelShape
from tpedu.model.config import GPTConfig
from tpedu.model.dense import DenseBlock
from tpedu.model.gpt import TPBlock
from tpedu.model.options import RunOptions
from tpedu.tp.sharding import divisors

# torch.utils.checkpoint imports torch._dynamo on its first call: seconds. Importing it here, in
# the parent process, lets every rank forked by tpedu.launch inherit it instead of paying again.

CATEGORIES = (
    "norms",
    "attention",
    "mlp",
    "block input",
    "dropout masks",
    "norm statistics",
    "causal mask",
)


@dataclass(frozen=True)
class Saved:
    """One storage saved for backward: who saved it, its category, shape, dtype and bytes."""

    module: str
    category: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


def _category(module: str, t: torch.Tensor) -> str:
    """Which ledger line a saved tensor belongs to (see the module docstring)."""
    if t.dtype == torch.bool:
        return "causal mask"
    top = module.split(".")[0]
    if not t.requires_grad:  # a constant: a dropout mask, or a LayerNorm statistic
        return "norm statistics" if top.startswith("norm") else "dropout masks"
    if top.startswith("norm"):
        return "norms"
    return {"attn": "attention", "mlp": "mlp"}.get(top, "block input")


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """(device, storage identity) of `t`: equal for every view of one storage.

    The identity is the address of the storage object itself (`_cdata`), not of its data:
    tensors on the meta device have no data, every one of their `data_ptr()`s is 0, and keying
    by it would count a whole meta model's saved tensors as one (lesson 13's dry run counts
    them). For real tensors the two keys pick out the same storages.
    """
    return str(t.device), t.untyped_storage()._cdata


class SavedTensorCounter:
    """Count the bytes autograd saves for backward while the context is active.

        with SavedTensorCounter(block) as counter:
            y = block(x)
        counter.total, counter.by_category(), counter.records

    Each storage counts once (keyed by `storage_key`; saved storages stay pinned while the
    context is active, so a key is never reused meanwhile). Works on the meta device too: the
    bytes are the shapes' (lesson 13's dry run). `root`'s parameters are skipped, and
    each record names the innermost sub-module of `root` that was running when it was saved.
    """

    def __init__(self, root: nn.Module | None = None) -> None:
        self.root = root
        self.records: list[Saved] = []
        self._seen: set[tuple[str, int]] = set()
        self._alive: list[torch.Tensor] = []  # pinned while counting: no address is reused
        self._stack: list[str] = [""]
        self._handles: list = []
        self._params = {storage_key(p) for p in root.parameters()} if root else set()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage_key(t)
        if storage.nbytes() and key not in self._seen and key not in self._params:
            self._seen.add(key)
            self._alive.append(t)
            module = self._stack[-1]
            self.records.append(
                Saved(module, _category(module, t), tuple(t.shape), t.dtype, storage.nbytes())
            )
        return t

    def _enter(self, name: str) -> None:
        self._stack.append(name)

    def _leave(self) -> None:  # a forward hook returning non-None would replace the output
        self._stack.pop()

    def __enter__(self) -> SavedTensorCounter:
        if self.root is not None:
            for name, m in self.root.named_modules():
                if name:
                    pre = m.register_forward_pre_hook(lambda *_, n=name: self._enter(n))
                    post = m.register_forward_hook(lambda *_: self._leave())
                    self._handles += [pre, post]
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
        self._alive.clear()
        for h in self._handles:
            h.remove()

    @property
    def total(self) -> int:
        """Bytes of all distinct storages saved."""
        return sum(r.nbytes for r in self.records)

    def by_category(self) -> dict[str, int]:
        """{category: bytes} for the categories that saved anything, in CATEGORIES order."""
        out: dict[str, int] = defaultdict(int)
        for r in self.records:
            out[r.category] += r.nbytes
        return {c: out[c] for c in CATEGORIES if c in out}

    def table(self) -> str:
        """One line per saved storage (deterministic): module, category, shape, dtype, bytes."""
        lines = [f"{'module':<14} {'category':<16} {'shape':<22} {'dtype':<9} {'bytes':>10}"]
        for r in self.records:
            dtype = str(r.dtype).removeprefix("torch.")
            lines.append(
                f"{r.module or '(block)':<14} {r.category:<16} {str(list(r.shape)):<22} "
                f"{dtype:<9} {r.nbytes:>10,}"
            )
        return "\n".join(lines)


def saved_bytes(fn: Callable[..., Any], *args: Any, skip: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages autograd saves for backward while fn(*args) runs.

    Each storage counts once however many saved tensors view it; the storages of `skip` (e.g.
    a module's parameters: weights are not activations) are not counted.
    """
    counter = SavedTensorCounter()
    counter._params = {storage_key(t) for t in skip}
    with counter:
        fn(*args)
    return counter.total


@contextmanager
def count_saved(root: nn.Module | None = None) -> Iterator[SavedTensorCounter]:
    """`with count_saved(model) as c:` — the same as SavedTensorCounter(model)."""
    with SavedTensorCounter(root) as counter:
        yield counter


# --- the paper's table, split like the measurement ---------------------------------------------


@dataclass(frozen=True)
class LayerCase:
    """One layer of `shape` at tensor-parallel size tp, with or without sequence parallelism,
    under a recompute policy: one row of the paper's table (only seq_len, micro_batch, hidden
    and n_heads of the shape matter; the paper's layer has ffn 4·hidden and no GQA)."""

    shape: ModelShape
    tp: int = 1
    sp: bool = False
    recompute: str = "none"

    @classmethod
    def from_symbols(
        cls, s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False, recompute: str = "none"
    ) -> LayerCase:
        """The case in the paper's symbols: sequence s, micro-batch b, hidden h, heads a, tp t."""
        return cls(ModelShape(seq_len=s, micro_batch=b, hidden=h, n_heads=a), t, sp, recompute)

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE}, got {self.recompute!r}")
        s, _, h, a, t = _symbols(self)
        if h % a or a % t or (4 * h) % t:
            raise ValueError(
                f"h = {h}, a = {a}, t = {t}: need a | h and t | a "
                f"(valid t: {', '.join(str(d) for d in divisors(a))})"
            )
        if self.shape.ffn != 4 * h or self.shape.kv_heads != a:
            raise ValueError(
                f"the paper's layer has ffn_hidden = 4·hidden and no GQA; got "
                f"ffn {self.shape.ffn}, {self.shape.kv_heads} KV heads"
            )
        if self.sp and s % t:
            raise ValueError(f"sequence parallelism needs t | s; s = {s}, t = {t}")

    def label(self) -> str:
        par = "no parallelism" if self.tp == 1 else f"TP t={self.tp}" + (" + SP" if self.sp else "")
        return par + ("" if self.recompute == "none" else f", {self.recompute} recompute")


def _symbols(case: LayerCase) -> tuple[int, int, int, int, int]:
    """(s, b, h, a, t) of a case: the paper's names for seq_len, micro_batch, hidden, n_heads, tp."""
    c = case.shape
    return c.seq_len, c.micro_batch, c.hidden, c.n_heads, case.tp


def paper_terms(case: LayerCase) -> dict[str, float]:
    """Korthikanti et al.'s bytes per layer by category (16-bit values, 1-byte dropout masks).

    Sums to tpedu.analysis.memory.activation_bytes_per_layer(s, b, h, a, t, sp, recompute) exactly.
    """
    s, b, h, a, t = _symbols(case)
    sbh, scores = s * b * h, a * s * s * b / t  # [b, a/t, s, s] per rank
    rep = t if case.sp else 1  # what plain TP replicates, SP shards
    if case.recompute == "full":
        return {"block input": 2 * sbh / rep}
    core = 0.0 if case.recompute == "selective" else 4 * scores  # softmax out + dropout out
    out = {
        "norms": 4 * sbh / rep,
        "attention": 2 * sbh / rep + 6 * sbh / t + 2 * sbh / t + core,  # QKV in, Q K V, out in
        "mlp": 2 * sbh / rep + 16 * sbh / t,  # fc1 input, GELU input, fc2 input
        "dropout masks": 2 * sbh / rep + (0.0 if case.recompute == "selective" else scores),
    }
    return out


def known_extras(
    case: LayerCase, mask_itemsize: int = 2, stat_itemsize: int = 4
) -> dict[str, float]:
    """What tpedu's layer saves beyond `paper_terms`, by category (see the module docstring).

    mask_itemsize: bytes of a saved dropout mask element (the activation dtype's: 2 for bf16);
    stat_itemsize: bytes of a LayerNorm mean / rstd element (float32 on CUDA; the CPU kernel
    keeps them in the input dtype).
    """
    if case.recompute == "full":
        return {}
    paper = paper_terms(case)
    s, b, _, _, t = _symbols(case)
    rep = t if case.sp else 1
    out = {
        "dropout masks": paper["dropout masks"] * (mask_itemsize - 1),  # the paper's are 1 byte
        "norm statistics": 2 * 2 * b * s / rep * stat_itemsize,  # 2 norms x (mean, rstd)
    }
    if case.recompute == "none":
        out["causal mask"] = s * s  # bool, 1 byte; selective recompute drops it with the core
    return out


def formula_bytes(case: LayerCase) -> float:
    """The paper's per-layer total (tpedu.analysis.memory.activation_bytes_per_layer)."""
    return activation_bytes_per_layer(*_symbols(case), case.sp, case.recompute)


# --- measuring ----------------------------------------------------------------------------------


@dataclass
class LayerMeasurement:
    """Bytes one layer saved on one rank, by category, with the records behind them."""

    case: LayerCase
    by_category: dict[str, int]
    records: list[Saved] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.by_category.values())

    def itemsize(self, category: str, default: int) -> int:
        """The element size of the storages saved under `category` (default if none)."""
        sizes = {r.dtype.itemsize for r in self.records if r.category == category}
        if len(sizes) > 1:
            raise ValueError(f"mixed dtypes under {category!r}: {sizes}")
        return sizes.pop() if sizes else default

    def expected(self) -> dict[str, float]:
        """paper_terms + known_extras by category, with the measured element sizes."""
        extras = known_extras(
            self.case, self.itemsize("dropout masks", 2), self.itemsize("norm statistics", 4)
        )
        out = dict(paper_terms(self.case))
        for k, v in extras.items():
            out[k] = out.get(k, 0.0) + v
        return out


def layer_config(case: LayerCase, dropout: float = 0.1) -> GPTConfig:
    """A gpt2-like one-layer config with the case's h, a, s (the architecture of the paper)."""
    c = case.shape
    return GPTConfig.gpt2_like(
        64,
        seq_len=c.seq_len,
        n_layers=1,
        hidden=c.hidden,
        n_heads=c.n_heads,
        dropout=dropout,
        activation="gelu_tanh",
    )


def measure_layer(
    case: LayerCase,
    group: dist.ProcessGroup | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
) -> LayerMeasurement:
    """Run one TPBlock forward on this rank (inside tpedu.launch with case.tp ranks) and count
    what it saves for backward. Collective: every rank of `group` must call it.

    x: [b, s, h] (sp: this rank's [b, s/t, h]) in `dtype`, dropout p = 0.1, training mode.
    """
    t = dist.get_world_size(group)
    if t != case.tp:
        raise ValueError(f"case.tp = {case.tp} but the group has {t} ranks; launch {case.tp}")
    if device is None:
        from tpedu import device as rank_device

        device = rank_device()
    torch.manual_seed(0)
    config = layer_config(case)
    options = RunOptions(sequence_parallel=case.sp, recompute=case.recompute)
    block = TPBlock(DenseBlock(config, 0), group, options).to(device, dtype)
    block.train()
    s, b, h, _, _ = _symbols(case)
    s_local = s // t if case.sp else s
    x = torch.randn(b, s_local, h, device=device, dtype=dtype, requires_grad=True)
    with SavedTensorCounter(block) as counter:
        y = block(x)
    y.float().sum().backward()  # the graph is real: it must run (and frees what was saved)
    return LayerMeasurement(case, counter.by_category(), counter.records)


def measure_rows(
    cases: list[LayerCase], group: dist.ProcessGroup | None = None
) -> list[LayerMeasurement]:
    """measure_layer for each case (all with the group's t). Collective."""
    return [measure_layer(c, group) for c in cases]


def ledger_table(measurements: list[LayerMeasurement]) -> str:
    """Paper formula, tpedu's known extras and the measurement per row (deterministic text)."""
    head = (
        f"{'row':<34} {'formula':>11} {'+ extras':>10} {'= expected':>11} {'measured':>11} {'':>2}"
    )
    lines = [head, "-" * len(head)]
    for m in measurements:
        formula = formula_bytes(m.case)
        expected = sum(m.expected().values())
        ok = "✓" if m.total == expected else "✗"
        lines.append(
            f"{m.case.label():<34} {formula:>11,.0f} {expected - formula:>10,.0f} "
            f"{expected:>11,.0f} {m.total:>11,} {ok:>2}"
        )
    return "\n".join(lines)


def category_table(m: LayerMeasurement) -> str:
    """One row per category: paper, extras, measured (deterministic text)."""
    paper, expected = paper_terms(m.case), m.expected()
    head = f"{'category':<16} {'paper':>10} {'tpedu extra':>12} {'measured':>10}"
    lines = [head, "-" * len(head)]
    for c in CATEGORIES:
        if c in expected or c in m.by_category:
            p, e = paper.get(c, 0.0), expected.get(c, 0.0)
            lines.append(f"{c:<16} {p:>10,.0f} {e - p:>12,.0f} {m.by_category.get(c, 0):>10,}")
    return "\n".join(lines)


# --- the calculator's "measure" button ---------------------------------------------------------

# small enough for CPU ranks; 8 heads allow t <= 8
TINY = ModelShape(seq_len=32, micro_batch=1, hidden=64, n_heads=8)


def _measure_worker(case: LayerCase) -> LayerMeasurement:
    return measure_layer(case)


def calculator_measure(config: ModelShape, settings: dict) -> str:
    """`memory_calculator(on_measure=calculator_measure)`: measure a tiny layer with the chosen
    tp, sp and recompute on real ranks and set it beside the prediction for the chosen shape.

    The measured tiny layer checks the formula (plus tpedu's known extras) on real saved
    tensors; the same extras are then evaluated at the calculator's shape. pp and dp do not
    change the bytes of one layer (pp changes how many layers and micro-batches a rank holds).
    """
    return _measure_for_calculator(config, settings)[0]


def calculator_overlay(config: ModelShape, settings: dict) -> tuple[str, float] | str:
    """`memory_calculator(on_measure=calculator_overlay)`: calculator_measure's text, plus the
    activation bytes per device tpedu really saves at the chosen shape and layout (the ledger's
    activations scaled by measured / formula per layer), which the calculator draws over its
    predicted bar."""
    text, formula, measured = _measure_for_calculator(config, settings)
    if formula is None:
        return text
    return text, ledger(config, **settings).activations * measured / formula


def _measure_for_calculator(config: ModelShape, settings: dict) -> tuple[str, float | None, float]:
    """(report, formula bytes per layer at the chosen shape, bytes tpedu saves there)."""
    from tpedu.launcher import launch

    t, sp, recompute = settings["tp"], settings["sp"], settings["recompute"]
    if t > 8:
        return f"measure: tp = {t} would launch {t} CPU ranks; choose tp <= 8", None, 0.0
    tiny = LayerCase(TINY, t, sp, recompute)
    m = launch(_measure_worker, t, tiny)[0]
    expected = sum(m.expected().values())
    big = LayerCase(config, t, sp, recompute)
    big_formula = formula_bytes(big)
    extras = known_extras(big, m.itemsize("dropout masks", 2), m.itemsize("norm statistics", 4))
    big_extra = sum(extras.values())
    ok = "✓" if m.total == expected else "✗"
    text = "\n".join(
        [
            f"measured one tiny layer (s={TINY.seq_len}, b={TINY.micro_batch}, h={TINY.hidden}, "
            f"a={TINY.n_heads}; "
            f"{tiny.label()}), bf16, on {t} rank(s):",
            f"  formula {formula_bytes(tiny):,.0f} B + tpedu extras {expected - formula_bytes(tiny):,.0f} B"
            f" = {expected:,.0f} B; measured {m.total:,} B {ok}",
            f"at your shape (s={config.seq_len}, b={config.micro_batch}, h={config.hidden}, "
            f"a={config.n_heads}), per layer and rank:",
            f"  formula {big_formula / 1e9:.3f} GB; tpedu would save {(big_formula + big_extra) / 1e9:.3f} GB"
            f" (+{100 * big_extra / big_formula:.1f}%: "
            + ", ".join(f"{k} {v / 1e9:.3f} GB" for k, v in extras.items())
            + ")",
        ]
    )
    return text, big_formula, big_formula + big_extra


__all__ = [
    "CATEGORIES",
    "LayerMeasurement",
    "LayerCase",
    "SavedTensorCounter",
    "calculator_measure",
    "category_table",
    "count_saved",
    "formula_bytes",
    "known_extras",
    "layer_config",
    "ledger_table",
    "measure_layer",
    "measure_rows",
    "paper_terms",
    "saved_bytes",
]
