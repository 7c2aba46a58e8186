"""Lesson 00: an interactive memory calculator (used again in lessons 10, 13), widgets wired to
tpedu.analysis.memory.ledger and nothing more.

    from tpedu.analysis.calculator import memory_calculator
    memory_calculator()                       # in a notebook cell

Pick a model shape (or type a parameter count and the layer count follows), the parallel sizes
tp/pp/dp, sequence parallelism, recomputation and ZeRO-1; it draws the per-device stacked bar
(weights, gradients, optimizer states, activations), prints the ledger table and says whether it
fits on the chosen GPU. All arithmetic lives in tpedu/analysis/memory.py.

Hook for later lessons: `memory_calculator(on_measure=f)` adds a "measure" button that calls
`f(config, settings)` (config: the tpedu.analysis.shape.ModelShape on screen; settings: dict of
tp, pp, dp, sp, recompute, zero: 0 or 1) and prints the string
it returns under the prediction, e.g. bytes measured on real ranks. If `f` returns
`(text, activation_bytes)`, the measured activations per device are also drawn over the
predicted bar (lesson 10: `tpedu.analysis.activation_memory.calculator_overlay`).
"""

from __future__ import annotations

from collections.abc import Callable

import ipywidgets as widgets
import matplotlib.pyplot as plt

from tpedu.analysis.memory import GB, RECOMPUTE, Ledger, ledger
from tpedu.analysis.shape import ModelShape

PARTS = ("weights", "gradients", "optimizer", "activations")
COLORS = ("#4c72b0", "#55a868", "#c44e52", "#8172b2")
SIZES = [1, 2, 4, 8, 16, 32, 64]
MeasureHook = Callable[[ModelShape, dict], "str | tuple[str, float]"]
# What the calculator shows first; `memory_calculator_static()` draws the same.
DEFAULT_SHAPE = ModelShape(
    n_layers=17, hidden=4096, n_heads=32, vocab_size=50_000, seq_len=2048, micro_batch=4
)
DEFAULT_SETTINGS = {"tp": 1, "pp": 1, "dp": 1, "sp": False, "recompute": "none", "zero": 0}
DEFAULT_GPU_GB = 80.0


def plot_ledgers(
    ledgers: list[Ledger],
    labels: list[str] | None = None,
    gpu_gb: float = 80.0,
    ax: plt.Axes | None = None,
) -> plt.Axes:
    """Stacked per-device bars (GB) for each ledger, with the GPU capacity as a dashed line."""
    if ax is None:
        _, ax = plt.subplots(figsize=(1.3 * len(ledgers) + 3, 3.6))
    labels = labels or [lg.label for lg in ledgers]
    xs = range(len(ledgers))
    bottom = [0.0] * len(ledgers)
    for part, color in zip(PARTS, COLORS, strict=True):
        heights = [getattr(lg, part) / GB for lg in ledgers]
        ax.bar(xs, heights, bottom=bottom, color=color, label=part, width=0.6)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.axhline(gpu_gb, color="black", linestyle="--", linewidth=1)
    ax.text(len(ledgers) - 0.5, gpu_gb, f" {gpu_gb:g} GB GPU", va="bottom", ha="right")
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("GB per device")
    ax.legend(fontsize=8, loc="upper right")
    return ax


class MemoryCalculator:
    """The widgets and their wiring; `memory_calculator()` returns `.widget`."""

    def __init__(self, on_measure: MeasureHook | None = None) -> None:
        style = {"description_width": "110px"}
        w = widgets
        shape, settings = DEFAULT_SHAPE, DEFAULT_SETTINGS
        self.params_b = w.BoundedFloatText(
            value=round(shape.n_params / 1e9, 2),
            min=0.01,
            max=2000,
            step=0.5,
            description="params (B)",
            style=style,
        )
        self.syncing = False  # update() writing the count back into params_b
        self.layers = w.IntSlider(
            value=shape.n_layers, min=1, max=160, description="layers", style=style
        )
        self.hidden = w.Dropdown(
            options=[512, 1024, 2048, 4096, 5120, 8192, 12288],
            value=shape.hidden,
            description="hidden",
            style=style,
        )
        self.heads = w.Dropdown(
            options=[8, 16, 32, 64, 96, 128], value=shape.n_heads, description="heads", style=style
        )
        self.vocab = w.BoundedIntText(
            value=shape.vocab_size, min=1, max=10**6, description="vocab", style=style
        )
        self.seq = w.Dropdown(
            options=[512, 1024, 2048, 4096, 8192, 32768],
            value=shape.seq_len,
            description="seq len",
            style=style,
        )
        self.batch = w.IntSlider(
            value=shape.micro_batch, min=1, max=32, description="micro-batch", style=style
        )
        self.tp = w.Dropdown(options=SIZES, value=settings["tp"], description="tp", style=style)
        self.pp = w.Dropdown(options=SIZES, value=settings["pp"], description="pp", style=style)
        self.dp = w.Dropdown(options=SIZES, value=settings["dp"], description="dp", style=style)
        self.sp = w.Checkbox(value=settings["sp"], description="sequence parallel")
        self.zero1 = w.Checkbox(value=settings["zero"] == 1, description="ZeRO-1 (optimizer / dp)")
        self.recompute = w.Dropdown(
            options=RECOMPUTE, value=settings["recompute"], description="recompute", style=style
        )
        self.gpu_gb = w.BoundedFloatText(
            value=DEFAULT_GPU_GB, min=1, max=1000, description="GPU GB", style=style
        )
        self.info = w.HTML()
        self.out = w.Output()
        self.measured = w.Output()

        self.params_b.observe(self._from_params, names="value")
        for control in self._shape() + self._settings() + [self.gpu_gb]:
            control.observe(lambda _change: self.update(), names="value")

        left = w.VBox([self.params_b, *self._shape(), self.info])
        right = w.VBox([*self._settings(), self.gpu_gb])
        rows: list[widgets.Widget] = [w.HBox([left, right]), self.out]
        if on_measure is not None:
            button = w.Button(description="measure", icon="play")
            button.on_click(lambda _b: self._measure(on_measure))
            rows += [button, self.measured]
        self.widget = w.VBox(rows)
        self.widget.calculator = self  # reachable from the returned widget (tests, later lessons)
        self.update()

    def _shape(self) -> list[widgets.Widget]:
        return [self.layers, self.hidden, self.heads, self.vocab, self.seq, self.batch]

    def _settings(self) -> list[widgets.Widget]:
        return [self.tp, self.pp, self.dp, self.sp, self.recompute, self.zero1]

    def config(self) -> ModelShape:
        return ModelShape(
            n_layers=self.layers.value,
            hidden=self.hidden.value,
            n_heads=self.heads.value,
            vocab_size=self.vocab.value,
            seq_len=self.seq.value,
            micro_batch=self.batch.value,
        )

    def settings(self) -> dict:
        return {
            "tp": self.tp.value,
            "pp": self.pp.value,
            "dp": self.dp.value,
            "sp": self.sp.value,
            "recompute": self.recompute.value,
            "zero": int(self.zero1.value),
        }

    def ledger(self) -> Ledger:
        return ledger(self.config(), **self.settings())

    def _from_params(self, change: dict) -> None:
        """Typing a parameter count sets the layer count (the slider then triggers update)."""
        if self.syncing:
            return
        layers = self.config().with_params(change["new"] * 1e9).n_layers
        self.layers.max = max(self.layers.max, layers)
        self.layers.value = layers

    def update(self) -> None:
        config = self.config()
        self.info.value = f"<b>{config.n_params / 1e9:.3f}B</b> parameters"
        self.syncing = True  # the box shows the shape's count, whichever control changed it
        try:
            self.params_b.value = round(config.n_params / 1e9, 2)
        finally:
            self.syncing = False
        self.out.clear_output(wait=True)
        with self.out:
            show_ledger(config, self.settings(), self.gpu_gb.value)

    def _measure(self, on_measure: MeasureHook) -> None:
        self.measured.clear_output(wait=True)
        with self.measured:
            result = on_measure(self.config(), self.settings())
            text, measured = (result, None) if isinstance(result, str) else result
            print(text)
            if measured is not None:
                self._draw_overlay(measured)

    def _draw_overlay(self, measured_activations: float) -> None:
        """The predicted bar with the measured activations outlined (hatched) over it."""
        current = self.ledger()
        fig, ax = plt.subplots(figsize=(4.5, 3.6))
        plot_ledgers([current], [current.label], self.gpu_gb.value, ax)
        static = (current.weights + current.gradients + current.optimizer) / GB
        ax.bar(
            0,
            measured_activations / GB,
            bottom=static,
            width=0.6,
            fill=False,
            hatch="//",
            edgecolor="black",
            label="activations, measured",
        )
        ax.legend(fontsize=8, loc="upper right")
        plt.show()
        plt.close(fig)


def show_ledger(config: ModelShape, settings: dict, gpu_gb: float) -> None:
    """What the calculator draws and prints for these controls: the bars (one device, and this
    layout), the ledger table and the verdict; an invalid layout prints its error instead."""
    try:
        current = ledger(config, **settings)
    except ValueError as err:
        print(f"✗ {err}")
        return
    fig, ax = plt.subplots(figsize=(6, 3.6))
    single = ledger(config, recompute=settings["recompute"])
    plot_ledgers([single, current], ["1 device", current.label], gpu_gb, ax)
    plt.show()
    plt.close(fig)  # the inline backend already showed it; elsewhere it would pile up
    print(current.table())
    gb = current.total / GB
    verdict = "fits" if current.fits(gpu_gb) else "does NOT fit"
    print(f"{gb:.1f} GB per device: {verdict} on a {gpu_gb:g} GB GPU")


def memory_calculator_static() -> None:
    """The calculator's first picture without widgets (it stays in a saved notebook): its
    parameter count, bars, table and verdict at the default controls."""
    print(f"{DEFAULT_SHAPE.n_params / 1e9:.3f}B parameters")
    show_ledger(DEFAULT_SHAPE, DEFAULT_SETTINGS, DEFAULT_GPU_GB)


def memory_calculator(on_measure: MeasureHook | None = None) -> widgets.VBox:
    """The calculator widget; display it (last line of a cell) to use it. See the module doc."""
    return MemoryCalculator(on_measure).widget


__all__ = [
    "MemoryCalculator",
    "memory_calculator",
    "memory_calculator_static",
    "plot_ledgers",
    "show_ledger",
]
