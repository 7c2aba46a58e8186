"""The benchmark GPT written for PyTorch's native tensor parallelism (DTensor).

Same shapes, parameters and arithmetic as tpedu's DenseGPT with CONFIG (LayerNorm, learned
positions, GELU, biases, untied head, the same attention core), but with separate
q/k/v projections: `ColwiseParallel` splits a weight into t row blocks, which would cut a fused
[q|k|v] matrix in the wrong places (lesson 05's bug). `parallelize` applies the plan that
torchtitan uses for Llama: ColwiseParallel / RowwiseParallel, a vocab-parallel embedding and
head, loss_parallel, and optionally SequenceParallel for the norms. The attention core runs on
local tensors (ColwiseParallel hands back this rank's heads), so it can call the same fused
kernel as tpedu: `GPT(config, fused_attention=True)` (the default, like DenseGPT's) uses
F.scaled_dot_product_attention, as tpedu does without dropout; False, the explicit softmax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from tpedu.model.config import GPTConfig


class Block(nn.Module):
    def __init__(self, c: GPTConfig, fused_attention: bool = True) -> None:
        super().__init__()
        h = c.hidden
        self.head_dim = h // c.n_heads
        self.norm1, self.norm2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.attn = Attention(h, self.head_dim, fused_attention)
        self.mlp = MLP(h, c.ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Attention(nn.Module):
    def __init__(self, h: int, d: int, fused: bool) -> None:
        super().__init__()
        self.d, self.fused = d, fused
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(h, h) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1: the heads this rank holds (all of them without TP)
        q, k, v = (w(x).view(b, s, -1, self.d).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        if self.fused:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.wo(out.transpose(1, 2).reshape(b, s, -1))
        scores = q @ k.transpose(-2, -1) / self.d**0.5
        future = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        return self.wo((probs @ v).transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, h: int, f: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(h, f), nn.Linear(f, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig, fused_attention: bool = True) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(c.vocab_size, c.hidden)
        self.pos_emb = nn.Embedding(c.seq_len, c.hidden)
        self.blocks = nn.ModuleList(Block(c, fused_attention) for _ in range(c.n_layers))
        self.norm_f = nn.LayerNorm(c.hidden)
        self.lm_head = nn.Linear(c.hidden, c.vocab_size, bias=False)
        self.positions: tuple[int, int] | None = None  # SP: (first, count) of this rank's rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        start, n = self.positions or (0, ids.shape[1])
        x = self.tok_emb(ids) + self.pos_emb(torch.arange(start, start + n, device=ids.device))
        for blk in self.blocks:
            x = blk(x)
        return self.lm_head(self.norm_f(x))


def parallelize(model: GPT, mesh: DeviceMesh, sequence_parallel: bool = False) -> GPT:
    """Shard `model` in place over the 1-D `mesh` (the TP group)."""
    sp = sequence_parallel
    seq = Shard(1) if sp else Replicate()  # layout of the residual stream between blocks
    parallelize_module(
        model,
        mesh,
        {
            "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
            "lm_head": ColwiseParallel(
                input_layouts=seq, output_layouts=Shard(-1), use_local_output=False
            ),  # DTensor logits: loss_parallel
            **({"norm_f": SequenceParallel()} if sp else {}),
        },
    )
    if sp:  # learned positions of this rank's rows; their gradient needs an all-reduce
        n = model.pos_emb.num_embeddings // mesh.size()
        model.positions = (mesh.get_local_rank() * n, n)
    for blk in model.blocks:
        plan = {
            "attn.wq": ColwiseParallel(),
            "attn.wk": ColwiseParallel(),
            "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=seq),
            "mlp.fc1": ColwiseParallel(),
            "mlp.fc2": RowwiseParallel(output_layouts=seq),
        }
        if sp:
            plan.update(
                {
                    "norm1": SequenceParallel(),
                    "norm2": SequenceParallel(),
                    "attn": PrepareModuleInput(
                        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                    ),
                    "mlp": PrepareModuleInput(
                        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                    ),
                }
            )
        parallelize_module(blk, mesh, plan)
    return model
