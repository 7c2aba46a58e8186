"""Lesson 07: `GPTConfig`, everything that fixes a GPT's shapes and arithmetic.

One config expresses GPT-2 (LayerNorm, learned positions, GELU, tied embeddings, biases) and a
Llama-style model (RMSNorm, RoPE, SwiGLU, grouped-query attention, no biases). How the model
*runs* (sequence parallelism, recompute, the pipeline, ...) is not here but in
tpedu.parallel.config.ParallelConfig: nothing in GPTConfig changes with the layout. `check(tp)`
raises a ValueError naming the problem when the config cannot run at tp, and `to_dict` /
`from_dict` are what model directories and checkpoints store.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from tpedu.moe.dense import check_moe_activation
from tpedu.moe.router import check_capacity_factor, check_top_k
from tpedu.tp.attention import check_heads
from tpedu.tp.sharding import check_divisible

RECOMPUTE = ("none", "selective", "full")

# Stored in GPTConfig by tpedu 0.1; the last five are ParallelConfig fields now.
LEGACY = (
    "extra",
    "sequence_parallel",
    "recompute",
    "fused_attention",
    "overlap_comm",
    "stage_split",
)


class Widths:
    """`kv_heads` and `ffn` of a shape whose `n_kv_heads` / `ffn_hidden` may be None (plain
    multi-head attention, 4 · hidden): GPTConfig's and tpedu.analysis.shape.ModelShape's."""

    n_heads: int
    hidden: int
    n_kv_heads: int | None
    ffn_hidden: int | None

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def ffn(self) -> int:
        return 4 * self.hidden if self.ffn_hidden is None else self.ffn_hidden


@dataclass
class GPTConfig(Widths):
    """Everything that fixes the model's shapes and arithmetic."""

    vocab_size: int
    seq_len: int = 128
    n_layers: int = 2
    hidden: int = 64
    n_heads: int = 4
    n_kv_heads: int | None = None  # None: = n_heads (multi-head attention)
    ffn_hidden: int | None = None  # None: 4 · hidden
    norm: str = "layernorm"  # or "rmsnorm"
    position: str = "learned"  # or "rope"
    activation: str = "gelu"  # "gelu", "gelu_tanh" (GPT-2), "swiglu", ...
    bias: bool = True
    tie_embeddings: bool = True
    vocab_parallel: bool = True  # False: every rank keeps the whole embedding (the seeds' start)
    dropout: float = 0.0
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    seed: int = 0  # dropout masks
    # Mixture of experts (tpedu.moe, lesson 18): 0 experts keeps every MLP dense.
    experts: int = 0  # routed experts of each MoE layer
    top_k: int = 2  # experts per token: 1 (Switch) or 2 (GShard, Mixtral)
    moe_every: int = 1  # layer i is an MoE layer when (i + 1) % moe_every == 0
    expert_ffn_hidden: int | None = None  # each expert's hidden width; None: ffn
    shared_expert: bool = False  # one more MLP every token goes through (DeepSeek)
    capacity_factor: float | None = None  # None: dropless; else C = ceil(cf · T · k / E)
    router_renormalize: bool = True  # top-k weights renormalised to sum to 1 (Mixtral)
    aux_loss_coef: float = 0.01  # the load-balancing loss's weight (Switch's 0.01)
    z_loss_coef: float = 0.0  # the router z-loss's weight (ST-MoE's 0.001 when used)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block `layer` (0-based) has a mixture of experts instead of an MLP."""
        return self.experts > 0 and (layer + 1) % self.moe_every == 0

    @property
    def expert_ffn(self) -> int:
        return self.ffn if self.expert_ffn_hidden is None else self.expert_ffn_hidden

    def check(self, tp: int = 1) -> None:
        """Raise a ValueError naming the problem (and the fix) if this config cannot run at `tp`."""
        for name, choices in (
            ("norm", ("layernorm", "rmsnorm")),
            ("position", ("learned", "rope")),
        ):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")
        check_heads(self.n_heads, self.kv_heads, tp)  # first: the checks below divide by n_heads
        if self.hidden % self.n_heads:
            raise ValueError(f"hidden = {self.hidden} is not divisible by n_heads = {self.n_heads}")
        if self.position == "rope" and (self.hidden // self.n_heads) % 2:
            raise ValueError("RoPE needs an even head dimension")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(
                f"dropout = {self.dropout} must be in [0, 1): the probability of "
                "zeroing an activation (1 would zero them all)"
            )
        check_divisible(self.ffn, tp, "ffn_hidden")
        if self.experts:
            check_moe(self, tp)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, fields: dict) -> GPTConfig:
        """A config from `to_dict()`'s output, also as tpedu 0.1 stored it: with an unused
        `extra` field and the run-time fields that now live in ParallelConfig (`LEGACY`),
        dropped here (tpedu.checkpoint reads the latter into a ParallelConfig)."""
        return cls(**{k: v for k, v in fields.items() if k not in LEGACY})

    @classmethod
    def gpt2_like(cls, vocab_size: int, **overrides: object) -> GPTConfig:
        return cls(vocab_size, **{"activation": "gelu_tanh", **overrides})

    @classmethod
    def llama_like(cls, vocab_size: int, **overrides: object) -> GPTConfig:
        base = {
            "norm": "rmsnorm",
            "position": "rope",
            "activation": "swiglu",
            "bias": False,
            "n_kv_heads": 2,
            "tie_embeddings": False,
        }
        return cls(vocab_size, **{**base, **overrides})


def check_moe(config: GPTConfig, tp: int) -> None:
    """Raise a ValueError naming the problem if the MoE fields cannot run at `tp`."""
    if config.experts < 0 or config.moe_every < 1:
        raise ValueError(
            f"experts = {config.experts} and moe_every = {config.moe_every}: use experts ≥ 0 "
            "(0: no mixture of experts) and moe_every ≥ 1 (1: every layer)"
        )
    check_top_k(config.top_k, config.experts)
    check_capacity_factor(config.capacity_factor)
    check_moe_activation(config.activation)
    check_divisible(config.expert_ffn, tp, "expert_ffn_hidden")
