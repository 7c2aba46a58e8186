"""Lesson 00 exercise: the memory ledger (显存账本).

Fill in the three functions, then run `make grade EX=l00`. The notebook
00_why_parallelism.ipynb uses each function through `pick("l00_memory_ledger")` once you have
written it (the reference until then).
"""

from __future__ import annotations


def training_bytes(
    n_params: int, weight_bytes: int = 2, grad_bytes: int = 2, optimizer_bytes: int = 12
) -> int:
    """Bytes of training state (weights + gradients + optimizer states) for `n_params` params.

    Activations are not included. The defaults are mixed-precision AdamW: a bf16 weight (2 bytes),
    a bf16 gradient (2 bytes) and three fp32 tensors kept by the optimizer (master weight, Adam m,
    Adam v: 12 bytes). Example: training_bytes(35 * 10**9) == 560 * 10**9 (560 GB).
    Return an int.
    """
    raise NotImplementedError(
        "l00: count the training state's bytes; hint: tpedu.grading.hint('l00', 1)"
    )


def embedding_bytes(vocab: int, hidden: int, bytes_per_param: int = 2) -> int:
    """Bytes of a token-embedding table of shape [vocab, hidden] at `bytes_per_param` each.

    Example: a 50_000 x 4096 table has 204.8M parameters, 409.6 MB in bf16. Return an int.
    """
    raise NotImplementedError(
        "l00: count the embedding table's bytes; hint: tpedu.grading.hint('l00', 1)"
    )


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
    """Exact parameter count of a GPT-2-style decoder (pre-LayerNorm, GELU MLP), as an int.

    Each of the n_layers blocks has (h = hidden, f = ffn_hidden, default 4h):
      - LayerNorm (weight [h] and bias [h]) before attention and another before the MLP
      - Q and out-proj: Linear(h, h) each; K and V: Linear(h, kv_dim) each, where
        kv_dim = kv_heads * (h // heads) (grouped-query attention; kv_heads defaults to heads,
        heads defaults to 1, so kv_dim = h for plain multi-head attention)
      - MLP: Linear(h, f) then Linear(f, h)
    With f = 4h and kv_dim = h that is 12h² + 13h per layer.
    Outside the blocks: a [vocab, h] token embedding, a [seq_len, h] learned position table
    (seq_len = 0 means none), a final LayerNorm, and, if tied_embeddings is False, an LM head
    Linear(h, vocab) without bias.
    bias=False removes every Linear bias AND every LayerNorm bias (LayerNorms keep the weight).
    """
    raise NotImplementedError("l00: count the GPT's parameters; hint: tpedu.grading.hint('l00', 1)")
