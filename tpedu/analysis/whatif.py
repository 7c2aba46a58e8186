"""Lesson 15: cluster what-if, the step time and MFU of a GPT on real hardware, from FLOPs and
the α-β model.

    step = compute + TP communication + PP bubble + PP send/recv + (1 - overlap)·DP all-reduce

compute      model FLOPs per GPU / (peak · efficiency). FLOPs per token (forward + backward):
             6·N + 12·L·s·h, N = 12·L·h² + V·h (attention/MLP weights + embedding; norms and
             biases ignored: `ModelShape.matmul_params`), the 12·L·s·h being q·kᵀ and probs·v
             (not in 6N: they have no weights). With full recomputation every block's forward runs twice (the LM head's
             does not): 8·N - 2·V·h + 16·L·s·h executed.
TP           4 all-reduces of b·s·h elements per layer per micro-batch (2 forward, 2 backward);
             sequence parallelism moves the same bytes. Priced by `Hardware.all_reduce`: a ring
             on NVLink while the group fits in a node; across nodes, two levels (see below).
PP           1F1B with v interleaved chunks and m micro-batches runs (v·m + pp - 1) slots of
             the slowest stage's time per micro-batch: bubble = that - the average busy time,
             i.e. (pp-1)/(v·m) of it for equal stages. Layers split evenly (Megatron's default),
             so the last stage, which also runs the head (6·V·h FLOPs per token, `head_blocks`
             blocks' worth), is the slowest. 2 sends of b·s·h per micro-batch and boundary.
DP           1 all-reduce of the GPU's gradients (N/(tp·pp) elements) per step, overlapped with
             backward by the fraction `dp_overlap`; its ranks are tp·pp GPUs apart.

An all-reduce across nodes, with g of the group's ranks in each node: reduce-scatter inside the
node (NVLink), all-reduce of each rank's 1/g shard across the nodes (every GPU on its own NIC),
all-gather inside the node. The network carries nbytes/g per GPU, not nbytes: the node's g NICs
work at once. NCCL's rings and trees reach about this by running one channel per NIC. A single
ring over all ranks at one NIC's bandwidth would be ~g× too slow: it predicted a 32× drop of
tokens/s/GPU from tp 2 to tp 32 where the Ultra-Scale Playbook measured 6.5×.

Assumptions (stated, not hidden): one number for matmul efficiency (`efficiency`, the fraction
of peak that the GEMMs reach; small GEMMs at large tp reach less, which this ignores), bf16
activations and gradients (2 bytes), TP communication never overlapped, α-β ring collectives
(tpedu.comm.cost_model) with the link bandwidth per GPU in ONE direction (NVLink 4: 900 GB/s is
both directions together, 450 GB/s each way), bandwidth a NCCL ring actually reaches
(`bus_efficiency`, ~0.8 of the link), one 400 Gb/s NIC per GPU, the two levels of a cross-node
all-reduce not overlapped (NCCL pipelines them, so this errs on the slow side).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tpedu.analysis.memory import activation_bytes_per_layer
from tpedu.analysis.shape import ModelShape
from tpedu.comm.cost_model import AlphaBeta
from tpedu.cp.traffic import ring_messages

if TYPE_CHECKING:
    import ipywidgets


@dataclass(frozen=True)
class Hardware:
    """One GPU type and its links. Bandwidths: bytes/s per GPU, one direction."""

    name: str
    peak_flops: float  # dense bf16/fp16 tensor-core FLOP/s
    intra_bw: float  # NVLink / NVSwitch (or PCIe) per GPU
    inter_bw: float  # network per GPU (InfiniBand / RoCE)
    gpus_per_node: int = 8
    intra_alpha: float = 5e-6  # seconds per ring step (NCCL, NVLink)
    inter_alpha: float = 10e-6
    bus_efficiency: float = 0.8  # fraction of the link a ring all-reduce reaches
    # Small messages: NCCL's own estimate for its ring with the low-latency (LL) protocol
    # (src/graph/tuning.cc): a base latency per call, a hardware latency per ring step (NVLink's;
    # PCIe's is 1 µs), and LL's bus bandwidth (Hopper's; the others' differ, and matter little
    # for the few KB a decode step all-reduces).
    ll_alpha: float = 6.6e-6
    ll_step_alpha: float = 0.6e-6
    ll_bus_bw: float = 87.7e9

    @property
    def intra(self) -> AlphaBeta:
        """α-β of a ring inside a node (NVLink / NVSwitch, or PCIe)."""
        return AlphaBeta(self.intra_alpha, 1 / (self.intra_bw * self.bus_efficiency))

    @property
    def inter(self) -> AlphaBeta:
        """α-β of a ring across nodes, one GPU per node on its own NIC."""
        return AlphaBeta(self.inter_alpha, 1 / (self.inter_bw * self.bus_efficiency))

    def link(self, group_span: int) -> AlphaBeta:
        """α-β of a ring over `group_span` consecutive GPUs (inside one node or across)."""
        return self.intra if group_span <= self.gpus_per_node else self.inter

    def all_reduce(self, nbytes: float, ranks: int, stride: int = 1) -> float:
        """Seconds to all-reduce `nbytes` over `ranks` GPUs, `stride` GPUs apart.

        Inside one node: a ring on NVLink. Across nodes, with g = ranks per node: reduce-scatter
        over the g (NVLink), all-reduce of nbytes/g across the nodes (each GPU's own NIC),
        all-gather over the g. With g = 1 (stride >= GPUs per node), one ring on the network.
        """
        if ranks == 1:
            return 0.0
        per_node = max(1, min(ranks, self.gpus_per_node // stride))
        nodes = -(-ranks // per_node)
        if nodes == 1:
            return self.intra.predict("all_reduce", nbytes, ranks)
        t = self.inter.predict("all_reduce", nbytes / per_node, nodes)
        if per_node > 1:
            t += self.intra.predict("reduce_scatter", nbytes, per_node)
            t += self.intra.predict("all_gather", nbytes, per_node)
        return t

    def small_all_reduce(self, nbytes: float, ranks: int) -> float:
        """Seconds for one all-reduce of `nbytes` over `ranks` GPUs of one node as NCCL prices
        its LL protocol: ll_alpha + 2(t-1)·ll_step_alpha + 2(t-1)/t·nbytes / ll_bus_bw. For the
        few KB of a decode step it is several times below the α-β ring's 2(t-1)·α, which
        charges every ring step what a whole NCCL call costs."""
        if ranks == 1:
            return 0.0
        steps = 2 * (ranks - 1)
        return self.ll_alpha + steps * self.ll_step_alpha + steps / ranks * nbytes / self.ll_bus_bw


GB = 1e9
H100_SXM = Hardware("H100 SXM, NVLink 4, 400 Gb/s IB", 989e12, 450 * GB, 50 * GB)
H100_PCIE = Hardware(
    "H100 PCIe 5 (no NVLink), 400 Gb/s", 756e12, 64 * GB, 50 * GB, ll_step_alpha=1.0e-6
)
A100_SXM = Hardware("A100 SXM, NVLink 3, 200 Gb/s HDR IB", 312e12, 300 * GB, 25 * GB)
# Megatron-LM 2019: DGX-2H, 16 V100 on NVSwitch, 8 × 100 Gb/s IB per 16 GPUs.
V100_DGX2 = Hardware(
    "V100 DGX-2H, NVSwitch, 8x100 Gb/s per node", 125e12, 150 * GB, 6.25 * GB, gpus_per_node=16
)
HARDWARE = {
    "H100 SXM": H100_SXM,
    "H100 PCIe": H100_PCIE,
    "A100 SXM": A100_SXM,
    "V100 DGX-2H": V100_DGX2,
}


@dataclass(frozen=True)
class Parallel:
    """Layout and batch: tp·pp·dp GPUs, `batch` sequences per step, micro-batches of `micro`."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    batch: int = 512
    micro: int = 1
    chunks: int = 1  # interleaved pipeline: virtual stages per GPU
    recompute: bool = False
    dp_overlap: float = 0.0  # fraction of the DP all-reduce hidden behind backward

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def n_micro(self) -> int:
        """Micro-batches per pipeline per step: batch / (dp · micro)."""
        if self.batch % (self.dp * self.micro):
            raise ValueError(
                f"batch {self.batch} is not divisible by dp·micro = {self.dp}·{self.micro}"
            )
        return self.batch // (self.dp * self.micro)


@dataclass(frozen=True)
class Prediction:
    """Seconds per step, split by cause, and what they mean per GPU."""

    compute: float
    tp: float
    bubble: float
    pp: float
    dp: float
    model_flops: float  # 6N + attention, the whole step (MFU counts only these)
    tokens: int
    gpus: int
    peak_flops: float

    @property
    def step(self) -> float:
        return self.compute + self.tp + self.bubble + self.pp + self.dp

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: model FLOPs / (step · GPUs · peak)."""
        return self.model_flops / (self.step * self.gpus * self.peak_flops)

    @property
    def tokens_per_gpu(self) -> float:
        return self.tokens / self.step / self.gpus

    def row(self) -> str:
        ms = lambda x: f"{1e3 * x:9.1f}"
        return (
            f"{ms(self.step)} {ms(self.compute)} {ms(self.tp)} {ms(self.bubble)} "
            f"{ms(self.pp)} {ms(self.dp)} {100 * self.mfu:6.1f}% {self.tokens_per_gpu:10,.0f}"
        )


HEADER = (
    f"{'step ms':>9} {'compute':>9} {'TP':>9} {'bubble':>9} {'PP p2p':>9} {'DP':>9} "
    f"{'MFU':>7} {'tok/s/GPU':>10}"
)


@dataclass(frozen=True)
class Volumes:
    """What the what-if prices, per GPU and step (lesson 13's dry run sets it beside a trace).

    tp_all_reduces    all-reduces of one [b, s, h] message over the TP group: 4 per layer and
                      micro-batch (6 with full recomputation), for the GPU's L/pp layers
    pp_sends          sends of one [b, s, h] message: 2 per micro-batch and model chunk
    message_bytes     b·s·h·bytes_per_value, the size of each of those messages
    dp_bytes          the one DP all-reduce: N/(tp·pp) gradients (N = matmul_params)
    """

    tp_all_reduces: int
    pp_sends: int
    message_bytes: float
    dp_bytes: float


def volumes(model: ModelShape, par: Parallel, bytes_per_value: int = 2) -> Volumes:
    """The messages `predict` prices for `model` under `par` (see `Volumes`)."""
    m = par.n_micro
    layers_here = model.n_layers // par.pp
    passes = 6 if par.recompute else 4  # recomputation repeats the forward's 2 all-reduces
    return Volumes(
        tp_all_reduces=m * passes * layers_here,
        pp_sends=0 if par.pp == 1 else 2 * m * par.chunks,
        message_bytes=par.micro * model.seq_len * model.hidden * bytes_per_value,
        dp_bytes=model.matmul_params / (par.tp * par.pp) * bytes_per_value,
    )


def predict(
    model: ModelShape,
    par: Parallel,
    hw: Hardware = H100_SXM,
    efficiency: float = 0.7,
    bytes_per_value: int = 2,
) -> Prediction:
    """Predicted step time of `model` under layout `par` on `hw` (see the module docstring)."""
    if model.n_heads % par.tp:
        raise ValueError(f"{model.n_heads} heads are not divisible by tp={par.tp}")
    if model.n_layers % (par.pp * par.chunks):
        raise ValueError(
            f"{model.n_layers} layers do not split into pp·chunks = "
            f"{par.pp}·{par.chunks} equal stages"
        )
    m = par.n_micro
    tokens = par.batch * model.seq_len
    model_flops = tokens * model.flops_per_token(recompute=False)
    executed = tokens * model.flops_per_token(recompute=par.recompute)
    compute = executed / par.gpus / (hw.peak_flops * efficiency)

    vol = volumes(model, par, bytes_per_value)
    act = vol.message_bytes
    tp = vol.tp_all_reduces * hw.all_reduce(act, par.tp)

    busy = compute + tp  # per GPU, on average
    # The last stage's share of compute: its layers plus the head, against the average stage's.
    head = model.head_blocks(par.recompute)
    last = (model.n_layers + par.pp * head) / (model.n_layers + head)
    slots = par.chunks * m + par.pp - 1
    bubble = slots / (par.chunks * m) * (compute * last + tp) - busy
    pp_link = hw.link(par.tp * par.pp)
    pp = 0.0 if par.pp == 1 else vol.pp_sends * pp_link.predict("send", act, 2)

    grads = vol.dp_bytes
    dp = (1 - par.dp_overlap) * hw.all_reduce(grads, par.dp, stride=par.tp * par.pp)
    return Prediction(compute, tp, bubble, pp, dp, model_flops, tokens, par.gpus, hw.peak_flops)


def tp_efficiency(
    model: ModelShape, tp: int, hw: Hardware = H100_SXM, batch: int = 32, efficiency: float = 0.7
) -> float:
    """Speed-up of tp GPUs over one, divided by tp (the seeds' "80-90% of linear")."""
    one = predict(model, Parallel(batch=batch), hw, efficiency).step
    return one / (tp * predict(model, Parallel(tp=tp, batch=batch), hw, efficiency).step)


def table(rows: list[tuple[str, Prediction]]) -> str:
    """Fixed-width table of predictions, one labelled row each."""
    w = max(len(label) for label, _ in rows)
    lines = [f"{'':<{w}} {HEADER}"]
    lines += [f"{label:<{w}} {p.row()}" for label, p in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- published runs

# Megatron-LM (Shoeybi et al. 2019), Table 1 / Fig. 1: 1.2B on 1 GPU = 39 TFLOP/s (30% of peak);
# 8.3B with tp 8 × dp 64 on 512 GPUs: 15.1 PFLOP/s, 76% weak-scaling efficiency.
MEGATRON_2019_SMALL = ModelShape(
    n_layers=40, hidden=1536, n_heads=16, vocab_size=51200, seq_len=1024
)
MEGATRON_2019_8B = ModelShape(n_layers=72, hidden=3072, n_heads=32, vocab_size=51200, seq_len=1024)
# Narayanan et al. 2021, Table 1: 1T parameters, 3072 A100s, tp 8, pp 64, dp 6, batch 3072,
# 163 TFLOP/s per GPU = 52% of peak (their FLOPs count the recomputation).
NARAYANAN_1T = ModelShape(n_layers=128, hidden=25600, n_heads=160, vocab_size=51200, seq_len=2048)
NARAYANAN_1T_LAYOUT = Parallel(tp=8, pp=64, dp=6, batch=3072, micro=1, chunks=1, recompute=True)


def published_comparison(efficiency: float = 0.7) -> str:
    """Predictions next to three published results (text table)."""
    lines = []
    # 1. Megatron 2019 weak scaling: calibrate efficiency on the 1-GPU run (30% of peak).
    one = predict(MEGATRON_2019_SMALL, Parallel(batch=8, micro=8), V100_DGX2, efficiency=0.30)
    big = predict(
        MEGATRON_2019_8B, Parallel(tp=8, dp=64, batch=512, micro=8), V100_DGX2, efficiency=0.30
    )
    weak = (big.model_flops / big.step / 512) / (one.model_flops / one.step)
    lines.append(
        f"Megatron-LM 2019, 8.3B on 512 V100 (tp 8 x dp 64): weak-scaling efficiency "
        f"predicted {100 * weak:.0f}%, published 76%"
    )
    # 2. Narayanan 2021: 1T on 3072 A100; FLOPs counted with recomputation, as the paper does.
    p = predict(NARAYANAN_1T, NARAYANAN_1T_LAYOUT, A100_SXM, efficiency=efficiency)
    hw_flops = p.model_flops * NARAYANAN_1T.flops_per_token(True) / NARAYANAN_1T.flops_per_token()
    frac = hw_flops / (p.step * p.gpus * p.peak_flops)
    lines.append(
        f"Narayanan 2021, 1T on 3072 A100 (tp 8, pp 64, dp 6): {100 * frac:.0f}% of "
        f"peak predicted, published 52%"
    )
    # 3. Ultra-Scale Playbook TP sweep (their model: ~8B Llama-like, seq 4096; an assumption).
    llama8b = ModelShape(
        n_layers=32, hidden=4096, n_heads=32, vocab_size=128256, seq_len=4096, ffn_hidden=14336
    )
    sweep = {
        t: predict(llama8b, Parallel(tp=t, batch=32, micro=1), H100_SXM, efficiency)
        for t in (2, 32)
    }
    lines.append(
        f"Ultra-Scale Playbook TP 2 -> 32: tokens/s/GPU drop x"
        f"{sweep[2].tokens_per_gpu / sweep[32].tokens_per_gpu:.1f} predicted, "
        f"published x{13923 / 2146:.1f} (13,923 -> 2,146)"
    )
    return "\n".join(lines)


# The widget's model: a Llama-3-8B-like shape.
WIDGET_MODEL = ModelShape(
    n_layers=32, hidden=4096, n_heads=32, vocab_size=128256, seq_len=4096, ffn_hidden=14336
)


def widget_static(model: ModelShape = WIDGET_MODEL, gpus: int = 128, hw: str = "H100 SXM") -> None:
    """What the widget explores, as a picture that stays in a saved notebook: the predicted
    step of every tp × dp = `gpus` layout (pp 1, batch 64 per replica), split by cause."""
    import matplotlib.pyplot as plt

    parts = ("compute", "tp", "bubble", "pp", "dp")
    rows = []
    for tp in (1, 2, 4, 8, 16, 32):
        par = Parallel(tp=tp, pp=1, dp=gpus // tp, batch=64 * (gpus // tp))
        try:
            rows.append((tp, predict(model, par, HARDWARE[hw], 0.7)))
        except ValueError:
            continue
    _, ax = plt.subplots(figsize=(8, 3))
    for i, (_, p) in enumerate(rows):
        bottom = 0.0
        for k, part in enumerate(parts):
            v = getattr(p, part)
            ax.bar(i, v, bottom=bottom, color=f"C{k}", label=part if i == 0 else None)
            bottom += v
        ax.text(i, bottom, f"{100 * p.mfu:.0f}%", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(rows)), [f"tp {tp}\ndp {gpus // tp}" for tp, _ in rows])
    ax.set_ylabel("predicted seconds per step")
    ax.set_title(f"{gpus} {hw}, pp 1, 64 sequences per replica (MFU above each bar)", fontsize=9)
    ax.legend(fontsize=8)
    plt.tight_layout()
    plt.show()


def widget(model: ModelShape | None = None) -> ipywidgets.VBox:
    """Sliders for tp, pp, dp, micro-batch and hardware; prints the prediction (lesson 15)."""
    import ipywidgets as w
    from IPython.display import display

    model = model or WIDGET_MODEL
    pow2 = lambda hi: [2**i for i in range(hi)]
    tp = w.SelectionSlider(options=pow2(7), value=8, description="tp")
    pp = w.SelectionSlider(options=pow2(6), value=1, description="pp")
    dp = w.SelectionSlider(options=pow2(10), value=16, description="dp")
    hw = w.Dropdown(options=list(HARDWARE), value="H100 SXM", description="GPU")
    eff = w.FloatSlider(value=0.7, min=0.3, max=0.9, step=0.05, description="GEMM eff.")
    out = w.Output()

    def show(_: object = None) -> None:
        out.clear_output()
        with out:
            par = Parallel(tp=tp.value, pp=pp.value, dp=dp.value, batch=64 * dp.value)
            try:
                p = predict(model, par, HARDWARE[hw.value], eff.value)
            except ValueError as e:
                print(e)
                return
            print(f"{par.gpus} GPUs, global batch {par.batch} x {model.seq_len} tokens")
            print(table([(f"tp {tp.value} pp {pp.value} dp {dp.value}", p)]))

    for s in (tp, pp, dp, hw, eff):
        s.observe(show, names="value")
    show()
    box = w.VBox([w.HBox([tp, pp, dp]), w.HBox([hw, eff]), out])
    display(box)
    return box


# Decoding (lesson 17): one new token per sequence per step is bound by reading memory, not by
# FLOPs. Datasheet HBM bandwidths, bytes/s per GPU.
HBM_BANDWIDTH = {"H100 SXM": 3.35e12, "A100 SXM": 2.0e12}


def decode_prediction(
    shape: ModelShape,
    hw: Hardware,
    hbm: float,
    tp: int,
    batch: int,
    context: int,
    eff: float = 0.8,
) -> dict[str, float]:
    """Seconds per decode step of `batch` sequences at `context` cached positions, per part.

    Each TP rank reads its share of the bf16 weights (2·N/tp bytes) and of the KV cache (its own
    KV heads, or one replica of a head when tp > kv_heads), from HBM at hbm·eff bytes/s, and runs
    2·layers + 1 all-reduces of batch·hidden bf16 values, each at the cheaper of the α-β ring
    (`Hardware.all_reduce`) and NCCL's small-message estimate (`small_all_reduce`), as NCCL picks
    its protocol by size; `ring_comm` is the ring's price alone. The matmuls
    (batch·2N/tp FLOPs) hide under the reads at small batch and are not counted.
    Returns weights, kv, comm, total, ring_comm (seconds) and bytes_per_token (weight bytes per
    rank per generated token: 2·N/(tp·batch)).
    """
    weights = 2 * shape.n_params / tp  # bf16 bytes this rank reads
    kv_heads_r = max(1.0, shape.kv_heads / tp)
    kv = 2 * 2 * shape.n_layers * batch * context * kv_heads_r * shape.head_dim  # K and V, bf16
    n, calls = 2 * batch * shape.hidden, 2 * shape.n_layers + 1
    comm = calls * min(hw.all_reduce(n, tp), hw.small_all_reduce(n, tp))
    out = {"weights": weights / (hbm * eff), "kv": kv / (hbm * eff), "comm": comm}
    out["total"] = sum(out.values())
    out["bytes_per_token"] = weights / batch
    out["ring_comm"] = calls * hw.all_reduce(n, tp)
    return out


# Long context (lesson 09): context parallelism splits the sequence, so activations and TP
# messages shrink by cp, while the ring's K/V blocks are what CP sends instead.


def long_context(
    model: ModelShape,
    tp: int,
    cp: int,
    hw: Hardware = H100_SXM,
    sp: bool = False,
    efficiency: float = 0.7,
    bytes_per_value: int = 2,
) -> dict[str, float]:
    """Per GPU, one micro-batch of `model.micro_batch` sequences of `model.seq_len` on tp·cp
    GPUs (TP groups inside, CP ranks tp GPUs apart, as in tpedu's mesh), ring attention.

    activations  bytes saved for backward, all layers: Korthikanti's per-layer formula at s/cp
                 with flash attention (no s² terms: `activation_bytes_per_layer`'s "selective")
    compute      FLOPs per token · tokens / (tp·cp) / (peak · efficiency): a zig-zag layout
                 gives every CP rank the same share of the causal attention
    tp_comm      4 all-reduces per layer of b·(s/cp)·h values over tp (`Hardware.all_reduce`)
    cp_comm      the ring's sends per layer (tpedu.cp.traffic.ring_messages: 2(cp − 1) forward,
                 4cp − 2 backward) of one [b, kv_heads/tp, s/cp, d] block each, α-β priced on
                 the link spanning tp·cp GPUs; not overlapped (RingAttention overlaps each
                 step's send with its block's attention, so this is the exposed time at worst)
    cp_sends     those sends per step; kv_block_bytes the size of each.
    """
    if model.n_heads % tp or model.kv_heads % tp and tp % model.kv_heads:
        raise ValueError(
            f"{model.n_heads} heads / {model.kv_heads} KV heads do not split over tp={tp}"
        )
    if model.seq_len % (2 * cp):
        raise ValueError(
            f"seq_len {model.seq_len} is not divisible by 2·cp = {2 * cp} (the zig-zag layout)"
        )
    s, b, h, n_layers = model.seq_len // cp, model.micro_batch, model.hidden, model.n_layers
    per_layer = activation_bytes_per_layer(s, b, h, model.n_heads, tp, sp, "selective")
    tokens = b * model.seq_len
    compute = tokens * model.flops_per_token() / (tp * cp) / (hw.peak_flops * efficiency)
    tp_comm = 4 * n_layers * hw.all_reduce(b * s * h * bytes_per_value, tp)
    kv_heads = max(1, model.kv_heads // tp)
    msgs = ring_messages(b, kv_heads, model.seq_len, cp, model.head_dim, bytes_per_value, n_layers)
    sends = msgs["forward"][0] + msgs["backward"][0]
    block = b * kv_heads * s * model.head_dim * bytes_per_value
    cp_comm = sends * hw.link(tp * cp).predict("send", block, 2) if cp > 1 else 0.0
    return {
        "activations": n_layers * per_layer,
        "compute": compute,
        "tp_comm": tp_comm,
        "cp_comm": cp_comm,
        "cp_sends": sends,
        "kv_block_bytes": block,
    }
