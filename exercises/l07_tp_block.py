"""Exercise l07: assemble a tensor-parallel transformer block from tpedu's layers (seed §4.3).

`tpedu.model.dense.DenseBlock` is a pre-norm block (LayerNorm or RMSNorm, dropout as `index_dropout`):

    x -> x + drop(attn(norm1(x)))        (attention's out projection: 1 all-reduce forward)
      -> x + mlp(norm2(x))               (the MLP drops its own output; fc2: 1 all-reduce forward)

Its tensor-parallel version replaces the parts, nothing else (seed §4.3: "替换零件"):

    norm1, norm2   replicated: a COPY on every rank (copy.deepcopy), never the dense module itself
    attn           tpedu.tp.attention.ParallelAttention.from_dense(dense.attn, group)
    mlp            tpedu.tp.mlp.ParallelMLP.from_dense(dense.mlp, group)

The residual stream x [b, s, H] stays full and identical on every rank, so the block adds no
communication of its own: exactly 2 all-reduces of b·s·H forward and 2 backward, all inside the
layers. Dropout after attention must drop exactly what the dense block drops: the same mask,
a function of the block's seed, the step and the call site (tpedu.tp.dropout: derive_seed,
index_dropout; tpedu.model.dense: ATTENTION_OUTPUT_DROPOUT_SITE). The attention output is
whole on every rank, so the dense mask applies to it as it is.

Keep the attribute names norm1, norm2, attn, mlp, seed, p: the tests read the gradients through
them. Fill in both methods, then run `make grade EX=l07`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tpedu.model.dense import DenseBlock


class TPBlock(nn.Module):
    """DenseBlock sharded over the TP group `group`: norms replicated, attention and MLP split.

    forward x [b, s, H] (the same on every rank) -> [b, s, H] (the same on every rank), equal to
    `dense(x, step)`. Forward: 2 all-reduces of b·s·H; backward: 2 all-reduces of b·s·H.
    """

    def __init__(self, dense: DenseBlock, group: dist.ProcessGroup | None) -> None:
        """Build from `dense` (identical on every rank); keep its dropout seed and probability."""
        raise NotImplementedError(
            "l07: build the block's parts; hint: tpedu.grading.hint('l07', 1)"
        )

    def forward(self, x: torch.Tensor, step: int = 0) -> torch.Tensor:
        """x [b, s, H] -> [b, s, H]; `step` selects this step's dropout masks."""
        raise NotImplementedError(
            "l07: write the block's forward; hint: tpedu.grading.hint('l07', 1)"
        )
