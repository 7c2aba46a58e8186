"""Reference for exercises/l07_tp_block.py: a transformer block with its parts swapped for TP."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from tpedu.model.dense import ATTENTION_OUTPUT_DROPOUT_SITE, DenseBlock
from tpedu.tp.attention import ParallelAttention
from tpedu.tp.dropout import derive_seed, index_dropout
from tpedu.tp.mlp import ParallelMLP


class TPBlock(nn.Module):
    def __init__(self, dense: DenseBlock, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.seed, self.p = dense.seed, dense.p
        # Replicated, as copies: the TP block must not share parameters with the dense one.
        self.norm1, self.norm2 = copy.deepcopy(dense.norm1), copy.deepcopy(dense.norm2)
        self.attn = ParallelAttention.from_dense(dense.attn, group)  # heads split
        self.mlp = ParallelMLP.from_dense(dense.mlp, group)  # fc1 by columns, fc2 by rows

    def forward(self, x: torch.Tensor, step: int = 0) -> torch.Tensor:
        a = self.attn(self.norm1(x), step)  # [b, s, H], whole on every rank after f̄
        seed = derive_seed(self.seed, ATTENTION_OUTPUT_DROPOUT_SITE, step)  # the dense mask
        x = x + index_dropout(a, self.p, seed, training=self.training)
        return x + self.mlp(self.norm2(x), step)
