"""Reference for exercises/l00_memory_ledger.py: the memory ledger, written out."""

from __future__ import annotations


def training_bytes(
    n_params: int, weight_bytes: int = 2, grad_bytes: int = 2, optimizer_bytes: int = 12
) -> int:
    """Bytes of weights + gradients + optimizer states: the same cost for every parameter."""
    return n_params * (weight_bytes + grad_bytes + optimizer_bytes)


def embedding_bytes(vocab: int, hidden: int, bytes_per_param: int = 2) -> int:
    """A [vocab, hidden] table: one parameter per (token, feature)."""
    return vocab * hidden * bytes_per_param


def gpt_params(
    n_layers: int,
    hidden: int,
    vocab: int,
    seq_len: int,
    ffn_hidden: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    tied_embeddings: bool = True,
    bias: bool = True,
) -> int:
    """Parameters of a GPT-2-style decoder: n_layers blocks plus the tables outside them."""
    h = hidden
    f = 4 * h if ffn_hidden is None else ffn_hidden
    heads = heads or 1
    kv_heads = heads if kv_heads is None else kv_heads
    kv = kv_heads * (h // heads)  # K and V outputs each (= h without grouped-query attention)

    def linear(n_in: int, n_out: int) -> int:
        return n_in * n_out + (n_out if bias else 0)

    norm = 2 * h if bias else h  # weight (+ bias)
    attention = linear(h, h) + 2 * linear(h, kv) + linear(h, h)  # Q, K, V, out-proj
    mlp = linear(h, f) + linear(f, h)
    block = attention + mlp + 2 * norm
    outside = vocab * h + seq_len * h + norm  # token table, learned positions, final norm
    if not tied_embeddings:
        outside += vocab * h  # the LM head has its own [vocab, h] weight, no bias
    return n_layers * block + outside
