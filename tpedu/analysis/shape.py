"""Lesson 00: `ModelShape` (used again in lessons 10, 13 and 15), the one description of a GPT's
shape that every analysis in tpedu.analysis takes, with its parameter counts and FLOPs per token.

Its field names are tpedu.model.config.GPTConfig's wherever they mean the same thing:

    vocab_size, seq_len, n_layers, hidden, n_heads, n_kv_heads (None: n_heads),
    ffn_hidden (None: 4·hidden), bias, tie_embeddings          as in GPTConfig
    micro_batch                                                 sequences per micro-batch (b)

and `ModelShape.from_config(config)` reads a GPTConfig. Resolved values, as GPTConfig names them:
`kv_heads`, `ffn`, plus `head_dim` (hidden / n_heads) and `kv_dim` (kv_heads · head_dim).

    memory.ledger(shape, tp=.., pp=.., dp=..)     bytes per device (lessons 00, 13)
    activation_memory.LayerCase(shape, tp, ..)    what one layer saves for backward (lesson 10)
    whatif.predict(shape, whatif.Parallel(..))    step time and MFU on a cluster (lesson 15)

(whatif's layouts carry their own micro-batch, `Parallel.micro`; it ignores `micro_batch`.)

Two parameter counts, for two purposes:

    n_params        exact, for a GPT-2-style decoder (pre-LayerNorm, biases, GELU MLP): per layer
                    12h² + 13h, plus V·h token embeddings, s·h learned positions, a final
                    LayerNorm (2h) and an untied LM head if any (`gpt_params`). The ledger
                    counts the bytes of these.
    matmul_params   N = L·(2h² + 2·h·kv_dim + 2·h·ffn) + V·h (= L·(4h² + 2·h·ffn) + V·h for
                    multi-head attention): the weights the matmuls multiply, the (tied) embedding
                    as the LM head; norms, biases and positions left out. Training costs 6·N
                    FLOPs per token plus attention's 12·L·s·h (`flops_per_token`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tpedu.model.config import GPTConfig, Widths


def embedding_params(vocab: int, hidden: int) -> int:
    """Parameters of a [vocab, hidden] token-embedding table: 50_000 × 4096 = 204.8M."""
    return vocab * hidden


def layer_params(hidden: int, ffn_hidden: int, kv_dim: int, bias: bool) -> tuple[int, int]:
    """(sharded, replicated) parameters of one block under Megatron-style tensor parallelism.

    Sharded: every matrix, plus the biases of the column-parallel layers (Q, K, V, fc1).
    Replicated on every TP rank: the biases of the row-parallel layers (out-proj, fc2; added
    once, after the all-reduce) and both LayerNorms.
    """
    h, f = hidden, ffn_hidden
    matrices = h * h + 2 * h * kv_dim + h * h + 2 * h * f  # Q, K, V, out-proj, fc1, fc2
    if not bias:
        return matrices, 2 * h  # LayerNorm weights only (nanoGPT's bias=False)
    column_biases = h + 2 * kv_dim + f
    replicated = h + h + 2 * 2 * h  # out-proj bias, fc2 bias, two LayerNorms (weight + bias)
    return matrices + column_biases, replicated


def gpt_params(shape: ModelShape) -> int:
    """Exact parameter count of a GPT-2-style decoder (pre-LayerNorm, GELU MLP) of `shape`.

    Per layer (ffn_hidden = 4h, n_kv_heads = n_heads, bias=True): 12h² + 13h, i.e.
    Q, K, V, out-proj 4h² + 4h; fc1, fc2 8h² + 5h; two LayerNorms 4h.
    Plus: V·h token embeddings, s·h learned positions (seq_len=0: none, e.g. RoPE), a final
    LayerNorm (2h, or h without bias), and an untied [V, h] LM head when tie_embeddings=False.
    Grouped-query attention: K and V have kv_heads · (h / n_heads) outputs each.
    bias=False drops every Linear bias and the LayerNorm biases (nanoGPT's convention).
    (Lesson 00's exercise writes it out with one argument per field. `ModelShape.n_params`
    calls it.)
    """
    h = shape.hidden
    kv_dim = shape.kv_heads * (h // shape.n_heads)
    sharded, replicated = layer_params(h, shape.ffn, kv_dim, shape.bias)
    embeddings = embedding_params(shape.vocab_size, h) * (1 if shape.tie_embeddings else 2)
    final_norm = 2 * h if shape.bias else h
    return shape.n_layers * (sharded + replicated) + embeddings + shape.seq_len * h + final_norm


@dataclass(frozen=True, kw_only=True)
class ModelShape(Widths):
    """A GPT-2-style model's shape and the micro-batch it trains on (see the module docstring).

    Keyword-only. The defaults are a 6.6B-parameter GPT (h 4096, 32 layers and heads, V 50,000)
    at s = 2048, b = 4.
    """

    vocab_size: int = 50_000
    seq_len: int = 2048
    n_layers: int = 32
    hidden: int = 4096
    n_heads: int = 32
    n_kv_heads: int | None = None  # None: n_heads (plain multi-head attention)
    ffn_hidden: int | None = None  # None: 4 * hidden
    bias: bool = True
    tie_embeddings: bool = True
    micro_batch: int = 4

    @classmethod
    def from_config(cls, config: GPTConfig, **overrides: object) -> ModelShape:
        """The shape of a GPT-2-style GPTConfig (LayerNorm, learned positions, two-matrix MLP);
        `overrides` set other fields (micro_batch, ...). Other architectures raise: n_params and
        the FLOP counts here are those of the GPT-2-style block."""
        c = config
        odd = [
            f"{name}={value!r}"
            for name, value, ok in (
                ("norm", c.norm, c.norm == "layernorm"),
                ("position", c.position, c.position == "learned"),
                ("activation", c.activation, c.activation != "swiglu"),
            )
            if not ok
        ]
        if odd:
            raise ValueError(
                f"ModelShape counts GPT-2-style blocks (LayerNorm, learned positions, "
                f"a two-matrix MLP); this config has {', '.join(odd)}"
            )
        fields = {
            "vocab_size": c.vocab_size,
            "seq_len": c.seq_len,
            "n_layers": c.n_layers,
            "hidden": c.hidden,
            "n_heads": c.n_heads,
            "n_kv_heads": c.n_kv_heads,
            "ffn_hidden": c.ffn_hidden,
            "bias": c.bias,
            "tie_embeddings": c.tie_embeddings,
        }
        return cls(**{**fields, **overrides})

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads

    @property
    def kv_dim(self) -> int:
        """Outputs of K (and of V): kv_heads · hidden / n_heads (= hidden without GQA)."""
        return self.kv_heads * self.hidden // self.n_heads

    @property
    def n_params(self) -> int:
        """Exact parameter count (see gpt_params)."""
        return gpt_params(self)

    def with_params(self, n_params: float) -> ModelShape:
        """The same shape family scaled to about `n_params`: n_layers = params / (12h² + 13h)."""
        per_layer = 12 * self.hidden**2 + 13 * self.hidden
        return replace(self, n_layers=max(1, round(n_params / per_layer)))

    def _block_matmul_params(self) -> int:
        """Q, K, V, out-proj and MLP weights of one block: 2h² + 2·h·kv_dim + 2·h·ffn."""
        h = self.hidden
        return 2 * h * h + 2 * h * self.kv_dim + 2 * h * self.ffn

    @property
    def matmul_params(self) -> int:
        """N = L·(2h² + 2·h·kv_dim + 2·h·ffn) + V·h: the weights of attention, MLP and the
        (tied) embedding, what 6·N FLOPs per token multiply."""
        return self.n_layers * self._block_matmul_params() + self.vocab_size * self.hidden

    def head_blocks(self, recompute: bool = False) -> float:
        """The LM head's training FLOPs per token in blocks: 6·V·h over a block's
        6·(2h² + 2·h·kv_dim + 2·h·ffn) + 12·s·h (× 8/6 with recomputation, which repeats the
        blocks' forward but not the head's). `pipeline.head_cost` is the same ratio for a real
        GPTConfig, with its exact q/k/v and MLP widths."""
        block = 6 * self._block_matmul_params() + 12 * self.seq_len * self.hidden
        if recompute:
            block *= 8 / 6
        return 6 * self.vocab_size * self.hidden / block

    def flops_per_token(self, recompute: bool = False) -> float:
        """Training FLOPs per token: 6·N + 12·L·s·h (N = matmul_params). With full
        recomputation every block's forward runs twice (+2·(N - V·h) + 4·L·s·h; the LM head is
        not recomputed), which is Narayanan et al.'s 96·L·h²·(1 + s/(6h) + V/(16·L·h))."""
        n = self.matmul_params
        lsh = self.n_layers * self.seq_len * self.hidden
        flops = 6 * n + 12 * lsh
        if recompute:
            flops += 2 * (n - self.vocab_size * self.hidden) + 4 * lsh
        return flops


__all__ = ["ModelShape", "embedding_params", "gpt_params", "layer_params"]
