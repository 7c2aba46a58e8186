"""Lesson 07: a GPT in two forms: `DenseGPT` (plain torch, one process) and `TPGPT` (tensor
parallel).

One config expresses GPT-2 (LayerNorm, learned positions, GELU, tied embeddings, biases) and a
Llama-style model (RMSNorm, RoPE, SwiGLU, grouped-query attention, no biases). `TPGPT` is built
from a DenseGPT's state dict, sharded per rank, so TP=N starts identical to TP=1, and
`gather_state_dict()` gives the dense state dict back.

Per transformer block, tensor parallelism costs exactly (b·s·H elements each):
    forward:  2 all-reduces (attention out-projection, MLP fc2)
    backward: 2 all-reduces (the f in front of QKV, the f in front of fc1)
plus, with a vocab-parallel embedding and loss: 1 all-reduce forward for the embedding, 1
backward for the LM head's input, and 3 small all-reduces (b·s elements) in the loss.

How the model runs is given to TPGPT as one `RunOptions` (tpedu.model.options; a training run's
comes from tpedu.parallel.config.ParallelConfig's `model_options()`), never stored in the
GPTConfig. `sequence_parallel` (lesson 08): between the
TP regions every rank keeps only its s/t positions; each all-reduce becomes a reduce-scatter
(forward) and each f an all-gather, see tpedu/tp/sequence_parallel.py. `sync_grads()` then also
sums the gradients of the replicated parameters that saw only a sequence shard. `recompute`
(lesson 10): "selective" recomputes the attention core in backward, "full" the whole block from
its input. `overlap_comm` (lesson 15): f's backward all-reduce runs while dL/dW is computed.
`tp_overlap` (lesson 19): "chunks" runs each block as `tp_chunks` batch chunks, one chunk's
all-reduce on the wire while the next computes (tpedu.tp.chunked; with CP each chunk's
attention is CP's, with experts only the attention half is chunked); "ring" (with sequence
parallelism, so not with CP or experts) does every block's and the head's all-gather and
reduce-scatter as ring steps under their matmuls (tpedu.tp.collective_matmul).
`context` (context parallelism, a tpedu.cp.context.ContextParallel): each CP rank feeds its
positions of the sequence (zig-zag or contiguous), learned positions and RoPE use the global
positions, attention is ring or Ulysses attention over the CP group, and the loss is the mean
over the whole sequence (2 small all-reduces over CP). Each
CP rank's gradients cover its positions only: their sum over CP is not the model's to run but
the reducer's (tpedu.cp.gradients: alone, or folded into DP's reduction over dp·cp).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tpedu.comm import collectives, tracer
from tpedu.comm.placement import Placements, sharded_on
from tpedu.cp.context import ContextParallel
from tpedu.cp.ulysses import check_ulysses_heads
from tpedu.model.config import GPTConfig
from tpedu.model.dense import (
    ATTENTION_OUTPUT_DROPOUT_SITE,
    EMBEDDING_DROPOUT_SITE,
    DenseBlock,
    DenseGPT,
    embed,
    mlp_output,
)
from tpedu.model.options import RunOptions
from tpedu.model.state import dense_name, merge_shards, shard_map
from tpedu.moe.dense import DenseMoE
from tpedu.moe.expert_parallel import ExpertParallelMoE
from tpedu.tp.attention import ParallelAttention
from tpedu.tp.chunked import chunked_block
from tpedu.tp.collective_matmul import (
    ring_all_gather_linear,
    ring_attention_forward,
    ring_mlp_forward,
)
from tpedu.tp.dropout import derive_seed, index_dropout
from tpedu.tp.embedding import ReplicatedEmbedding, VocabParallelEmbedding
from tpedu.tp.kv_cache import KVCache, LayerCache, check_cache_usable
from tpedu.tp.layers import column_parallel_linear
from tpedu.tp.mlp import ParallelMLP
from tpedu.tp.sequence_parallel import (
    all_gather_linear,
    all_reduce_sequence_parallel_grads,
    check_sequence_length,
    gather_from_sp_region,
    mark_sequence_parallel,
    scatter_to_sp_region,
    sequence_dropout,
    sequence_offset,
    sequence_parallel_params,
)
from tpedu.tp.vocab_parallel import IGNORE, gather_logits, vocab_parallel_cross_entropy


def _embed_sequence_parallel(model: TPGPT, ids: torch.Tensor, step: int) -> torch.Tensor:
    """embed on this rank's positions: ids [b, s] -> [b, s/t, H], the dense result's slice.

    Vocab-parallel: the partial lookups are reduce-scattered along the sequence (1
    reduce-scatter; Megatron-LM does the same) rather than all-reduced and then cut.
    Replicated table: every rank looks up everything and keeps its chunk (no communication
    forward, 1 all-gather backward, so the table's gradient is complete on every rank).
    """
    s = ids.shape[1]
    check_sequence_length(s, model.tp)
    if model.config.vocab_parallel:
        x = model.tok_emb(ids, sequence_parallel=True)
    else:
        x = scatter_to_sp_region(model.tok_emb(ids), model.group)
    if model.pos_emb is not None:  # only this rank's rows: its gradient needs the SP all-reduce
        start = sequence_offset(s // model.tp, model.group)
        x = x + model.pos_emb(torch.arange(start, start + s // model.tp, device=ids.device))
    seed = derive_seed(model.config.seed, EMBEDDING_DROPOUT_SITE, step)
    return sequence_dropout(x, model.config.dropout, seed, model.group, model.training)


def check_ring_overlap(tp_overlap: str, cp: int = 1, experts: bool = False) -> None:
    """Raise a one-line ValueError: tp_overlap "ring" does not apply with context parallelism
    or a mixture of experts (it needs sequence parallelism, which neither runs with)."""
    if tp_overlap != "ring" or (cp == 1 and not experts):
        return
    what, flag = (
        ("context parallelism", "--cp") if cp > 1 else ("a mixture of experts", "--experts")
    )
    raise ValueError(
        f"tp_overlap 'ring' needs sequence parallelism, which {what} does not support; use "
        f"--tp-overlap chunks (or none) with {flag}"
    )


def check_context_parallel(
    config: GPTConfig, sequence_parallel: bool, strategy: str, tp: int, cp: int
) -> None:
    """Raise a ValueError for what context parallelism cannot run (before any forward; also
    ParallelConfig.check's)."""
    if config.dropout > 0:
        raise ValueError(
            "context parallelism with dropout > 0 is not supported: the masks are drawn from "
            "each element's index in the local sequence; use dropout = 0 with cp > 1"
        )
    if sequence_parallel:
        raise ValueError("context parallelism with sequence parallelism is not supported yet")
    if strategy == "ulysses":
        check_ulysses_heads(config.n_heads // tp, max(1, config.kv_heads // tp), cp)


def check_moe_options(sequence_parallel: bool, tp_overlap: str = "none") -> None:
    """Raise a ValueError if a model with experts cannot run so. tp_overlap "chunks" runs:
    the attention half chunked, the MoE half on the whole batch (tpedu.tp.chunked)."""
    check_ring_overlap(tp_overlap, experts=True)
    if sequence_parallel:
        raise ValueError(
            "sequence parallelism with a mixture of experts is not built: each expert, split "
            "over TP, needs the same tokens on every TP rank; drop --sequence-parallel"
        )


def context_of(options: RunOptions) -> ContextParallel | None:
    """The run's context parallelism, None when the sequence is not split (no group, or one
    rank)."""
    context = options.context
    return context if context is not None and context.size > 1 else None


def expert_parallel_moe(
    dense: DenseMoE, group: dist.ProcessGroup | None, options: RunOptions
) -> ExpertParallelMoE:
    """A block's mixture of experts: experts split over options.ep_group (None: a group of
    this rank alone, every expert here) and each expert over the TP `group`."""
    check_moe_options(options.sequence_parallel, options.tp_overlap)
    ep_group = options.ep_group if options.ep_group is not None else collectives.own_group("ep")
    return ExpertParallelMoE.from_dense(dense, ep_group, tp_group=group)


class TPBlock(nn.Module):
    """DenseBlock sharded over the TP group: norms replicated, attention and MLP split.

    x [b, s, H] -> [b, s, H]; with sequence_parallel, this rank's positions [b, s/t, H] ->
    [b, s/t, H] (norms, dropout and residual adds then run on the shard; the norms' parameters
    and the row-parallel biases are marked `sequence_parallel` for the gradient all-reduce).
    recompute: "none", "selective" (attention core) or "full" (only x is kept for backward).
    """

    def __init__(
        self, dense: DenseBlock, group: dist.ProcessGroup | None, options: RunOptions | None = None
    ) -> None:
        super().__init__()
        options = options or RunOptions()
        self.seed, self.p, self.group = dense.seed, dense.p, group
        sequence_parallel, self.recompute = options.sequence_parallel, options.recompute
        self.sequence_parallel = sequence_parallel
        # lesson 19: "chunks" (tpedu.tp.chunked) or "ring" (tpedu.tp.collective_matmul)
        self.tp_overlap, self.tp_chunks = options.tp_overlap, options.tp_chunks
        # Replicated: the same on every rank (copies: the TP model must not share the dense one's).
        self.norm1, self.norm2 = copy.deepcopy(dense.norm1), copy.deepcopy(dense.norm2)
        self.attn = ParallelAttention.from_dense(
            dense.attn,
            group,
            sequence_parallel=sequence_parallel,
            recompute_core=options.recompute == "selective",
            overlap_comm=options.overlap_comm,
            context=context_of(options),
        )
        self.moe_coefs, self.moe_stats = dense.moe_coefs, None
        if isinstance(dense.mlp, DenseMoE):
            self.mlp = expert_parallel_moe(dense.mlp, group, options)
        else:
            self.mlp = ParallelMLP.from_dense(
                dense.mlp,
                group,
                sequence_parallel=sequence_parallel,
                overlap_comm=options.overlap_comm,
            )
        if sequence_parallel:
            mark_sequence_parallel(
                [
                    *self.norm1.parameters(),
                    *self.norm2.parameters(),
                    self.attn.out.bias,
                    self.mlp.fc2.bias,
                ]
            )

    def forward(
        self,
        x: torch.Tensor,
        step: int = 0,
        positions: torch.Tensor | None = None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        """`cache`: this block's KV cache (inference; x holds the new tokens only)."""
        if self.recompute == "full" and torch.is_grad_enabled() and cache is None:
            # Keeps only x; backward reruns the block (its collectives and dropout masks too).
            return checkpoint(self._forward, x, step, positions, use_reentrant=False)
        return self._forward(x, step, positions, cache)

    def _forward(
        self,
        x: torch.Tensor,
        step: int,
        positions: torch.Tensor | None = None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        seed = derive_seed(self.seed, ATTENTION_OUTPUT_DROPOUT_SITE, step)
        overlap = self.tp_overlap if cache is None else "none"
        if overlap == "chunks":  # the same all-reduces, chunk by chunk, async
            # experts: the MoE half on the whole batch (routing and capacity see every token)
            moe = None
            if isinstance(self.mlp, ExpertParallelMoE):
                moe = lambda h: mlp_output(self, self.norm2(h), step)
            return chunked_block(x, step, self.tp_chunks, self, seed, positions, moe)
        if overlap == "ring":  # sequence parallel; each collective as ring steps under a matmul
            x = x + sequence_dropout(
                ring_attention_forward(self.attn, self.norm1(x), step),
                self.p,
                seed,
                self.group,
                self.training,
            )
            return x + ring_mlp_forward(self.mlp, self.norm2(x), step)
        a = self.attn(self.norm1(x), step, positions, cache)  # 1 all-reduce fwd, 1 bwd
        if self.sequence_parallel:  # this rank's slice of the dense mask
            x = x + sequence_dropout(a, self.p, seed, self.group, self.training)
        else:
            x = x + index_dropout(a, self.p, seed, training=self.training)  # full: offsets 0
        return x + mlp_output(self, self.norm2(x), step)  # 1 all-reduce forward, 1 backward


class TPGPT(nn.Module):
    """The tensor-parallel GPT, built from a DenseGPT (identical on every rank of `group`).

    ids [b, s] (the same on every rank) -> this rank's logits [b, s, Vp/t] when vocab-parallel,
    else the full logits [b, s, V]; with targets, the mean loss (the same on every rank).

    `layers` (default: all) makes this a pipeline *stage* holding only those blocks: the first
    stage (layers start at 0) also holds the embeddings and takes ids; the others take the
    previous stage's hidden states [b, s, H]. The last stage holds the final norm and the head
    and returns logits or the loss; the others return hidden states. With tied embeddings and
    more than one stage, the last stage keeps its own copy of the embedding table as the head;
    the two copies' gradients must be summed over the first and last stage (lesson 11).

    With sequence_parallel the hidden states between blocks (and between stages) are this
    rank's sequence shard [b, s/t, H]; ids, targets, logits and loss are as above.
    """

    def __init__(
        self,
        dense: DenseGPT,
        group: dist.ProcessGroup | None = None,
        layers: range | None = None,
        options: RunOptions | None = None,
    ) -> None:
        super().__init__()
        config, options = dense.config, options or RunOptions()
        self.config, self.group, self.options = config, group, options
        self.tp = dist.get_world_size(group)
        sequence_parallel = self.sequence_parallel = options.sequence_parallel
        config.check(self.tp)
        if sequence_parallel:  # the batch's own s is checked again at run time
            check_sequence_length(config.seq_len, self.tp)
        self.context = context_of(options)
        self.cp = self.context.size if self.context is not None else 1
        if self.context is not None:
            check_ring_overlap(options.tp_overlap, self.cp)
            check_context_parallel(
                config, sequence_parallel, self.context.strategy, self.tp, self.cp
            )
        layers = range(config.n_layers) if layers is None else layers
        if not (0 <= layers.start <= layers.stop <= config.n_layers and layers.step == 1):
            raise ValueError(
                f"layers must be a contiguous range within [0, {config.n_layers}), got {layers}"
            )
        self.layer_ids = list(layers)
        self.first, self.last = layers.start == 0, layers.stop == config.n_layers
        embedding = VocabParallelEmbedding if config.vocab_parallel else ReplicatedEmbedding

        def table(weight: torch.Tensor) -> nn.Module:
            return embedding(weight, group) if config.vocab_parallel else embedding(weight)

        self.tok_emb = table(dense.tok_emb.weight) if self.first else None
        self.pos_emb = copy.deepcopy(dense.pos_emb) if self.first else None  # replicated
        self.blocks = nn.ModuleList(TPBlock(dense.blocks[i], group, options) for i in layers)
        self.norm_f = copy.deepcopy(dense.norm_f) if self.last else None
        self.lm_head = None
        if self.last and dense.lm_head is not None:  # an untied head is split like the embedding
            self.lm_head = table(dense.lm_head.weight)
        elif self.last and not self.first:  # tied, on another stage: a copy of the table
            self.lm_head = table(dense.tok_emb.weight)
        if sequence_parallel:  # replicated, but each rank feeds them its positions only
            for m in (self.pos_emb, self.norm_f):
                mark_sequence_parallel(m.parameters() if m is not None else [])
        self._copies, self._placements = self._read_shard_map()

    @classmethod
    def from_state_dict(
        cls,
        config: GPTConfig,
        state: dict[str, torch.Tensor],
        group: dist.ProcessGroup | None = None,
        options: RunOptions | None = None,
    ) -> TPGPT:
        """Shard a dense state dict (e.g. loaded from disk, the same on every rank)."""
        dense = DenseGPT(config)
        dense.load_state_dict(state)
        return cls(dense, group, options=options)

    def forward(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor | None = None,
        step: int = 0,
        *,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """ids [b, s] (first stage) or hidden [b, s, H] -> logits / loss (last) or hidden.

        `cache` (inference, tpedu.tp.kv_cache.KVCache): ids [b, s] are the next s tokens of
        each sequence, at positions cache.lengths + 0 .. s-1; each block adds its K and V to
        the cache, which then counts s more positions. The communication is the uncached
        forward's for these s tokens: 2 all-reduces of b·s·H per block and 1 for a vocab-parallel
        embedding, so a decoded token (s = 1) costs 2·layers + 1 all-reduces of b·H.
        """
        if cache is not None:
            self._check_cache(cache, inputs)
            cache.begin(inputs.shape[1])  # positions and mask, once for every layer
        sp = self.sequence_parallel
        positions = None if self.context is None else self.context.positions(inputs.shape[1])
        if self.first:  # vocab-parallel: 1 all-reduce (SP: 1 reduce-scatter)
            if sp:
                x = _embed_sequence_parallel(self, inputs, step)
            else:
                # a copy, not a view of every rank's positions: the embedding then saves only
                # this rank's s/cp ids for backward, on any device (the dry run counts them)
                mine = None if positions is None else positions[self.context.rank].clone()
                if cache is not None:
                    mine = cache.step.positions  # [b, s]
                x = embed(self, inputs, step, mine)
        else:
            x = inputs
        for i, block in enumerate(self.blocks):
            x = block(x, step, positions, None if cache is None else cache.layer(i))
        if cache is not None:
            cache.advance(inputs.shape[1])
        if not self.last:
            return x
        h = self.norm_f(x)
        head = self.tok_emb if self.lm_head is None else self.lm_head
        if not self.config.vocab_parallel:
            if sp:  # a replicated head: every rank's dL/dh is already complete, no reduce-scatter
                h = gather_from_sp_region(h, self.group, tensor_parallel_output_grad=False)
            logits = F.linear(h, head.weight)
            if targets is None:
                return logits
            if self.context is None:
                return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
            losses = F.cross_entropy(
                logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="none"
            )
            return self._mean(losses, targets)
        # f: the head is column-parallel over the vocabulary, so dL/dh is all-reduced in backward
        # (SP: all-gathered along the sequence in forward, reduce-scattered in backward).
        if sp:  # [b, s, Vp/t]
            gather = (
                ring_all_gather_linear if self.options.tp_overlap == "ring" else all_gather_linear
            )
            logits = gather(h, [head.weight], [None], self.group)[0]
        else:
            logits = column_parallel_linear(
                h, head.weight, None, self.group, async_grad_all_reduce=self.options.overlap_comm
            )
        if targets is None:
            return logits
        # At least fp32 whatever the compute dtype (as F.cross_entropy under autocast): a bf16
        # sum of V/t exponentials keeps 8 bits. inplace: these logits are ours alone.
        if logits.dtype in (torch.bfloat16, torch.float16):
            logits = logits.float()
        losses = vocab_parallel_cross_entropy(
            logits, targets, self.config.vocab_size, self.group, IGNORE, inplace=True
        )
        return self._mean(losses, targets)

    def _check_cache(self, cache: KVCache, ids: torch.Tensor) -> None:
        """ValueErrors for a forward the KV cache cannot serve."""
        check_cache_usable(self.training, self.sequence_parallel, self.context)
        if not (self.first and self.last):
            raise ValueError(
                "a KV cache needs the whole model on each rank: build TPGPT without `layers` "
                "(pipeline stages) for generation"
            )
        if cache.capacity > self.config.seq_len:
            raise ValueError(
                f"KV cache capacity {cache.capacity} is more than the context length seq_len = "
                f"{self.config.seq_len}: make it with KVCache.for_model(model, batch)"
            )
        if ids.dim() != 2 or ids.shape[0] != cache.batch or len(cache.k) != len(self.blocks):
            raise ValueError(
                f"the cache was made for {cache.batch} sequences and {len(cache.k)} layers; got "
                f"ids of shape {tuple(ids.shape)} for {len(self.blocks)} layers: make it with "
                "KVCache.for_model(model, batch)"
            )

    def _mean(self, losses: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean loss over the counted tokens of the whole sequence. With context
        parallelism 2 all-reduces over the CP group (the sum and the count): the value is the
        global mean on every rank, the gradient flows through this rank's tokens only (the
        parameters' gradients are then summed over CP: tpedu.cp.gradients)."""
        count = (targets != IGNORE).sum()
        if self.context is None:
            return losses.sum() / count.clamp_min(1)
        return self.context.mean(losses.sum(), count)

    def local_sequence(self, t: torch.Tensor) -> torch.Tensor:
        """This CP rank's positions of ids or targets [b, s] -> [b, s/cp] (cp = 1: t itself)."""
        return t if self.context is None else self.context.local(t)

    def axes(self) -> dict[str, tuple[int, int]]:
        """{mesh axis: (its size, this rank's index on it)} of the axes this model's own groups
        span (tp, and cp): where a model saved alone, outside a mesh, places its rank."""
        cp_rank = 0 if self.context is None else self.context.rank
        return {"tp": (self.tp, dist.get_rank(self.group)), "cp": (self.cp, cp_rank)}

    def stage_positions(self) -> int:
        """The positions of the activations [b, s', H] one stage sends the next: s/tp with
        sequence parallelism, s/cp with context parallelism, else s."""
        split = self.tp if self.sequence_parallel else self.cp
        return self.config.seq_len // split

    def full_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary [b, s, V] on every rank (gathers if vocab-parallel)."""
        logits = self(ids)
        if self.config.vocab_parallel:
            return gather_logits(logits, self.config.vocab_size, self.group)
        return logits

    def grad_norm(self) -> torch.Tensor:
        """L2 norm of the whole (dense) model's gradient, on every rank, for this model alone
        (lesson 07: its TP group is the job; with CP each CP rank holds the same gradients and
        gets the same norm): `grad_norm` of its `weighted_grads`. 1 all-reduce over the TP group.
        Clipping with a norm that counts replicated parameters t times (or shards only once) is
        a bug."""
        return grad_norm(weighted_grads([self]), self.group)

    def norm_weight(self, name: str, replicas: Mapping[str, int] | None = None) -> Weight:
        """The gradient norm's weight of each element of local parameter `name`: 1 / the ranks
        of the whole job holding a copy of it, read off its placements, so that the sum over
        every rank counts each element once. `replicas`: {axis: size} of the mesh's axes beyond
        TP along which the job copies parameters (`Layout.copy_axes`; None: this model alone):
            tp  Replicate: t copies (a replicated KV head: its replicas, `copies_of`); Shard: 1
            cp  a copy on each CP rank (their gradients are summed, then equal)
            dp  a copy per replica; an expert (Shard on ep, which is carved from dp) one per
                dp/ep replicas of the same experts. Under ZeRO the caller leaves cp and dp out:
                ZeRO shards over dp·cp, each of those ranks holds its own piece of the gradient
            pp  each stage holds its own layers: 1; the last stage's copy of a tied embedding
                counts 0 (weight 0): after sync_tied_grads it equals the first stage's table.
        A number, or a tensor of the parameter's shape (replicated KV heads)."""
        if dense_name(name, self.layer_ids, self.config.tie_embeddings)[1]:
            return 0.0
        replicas = replicas or {}
        dp = replicas.get("dp", 1)
        if sharded_on(self._placements[name], "ep"):
            dp //= replicas.get("ep", 1)
        return 1.0 / (self.copies_of(name) * replicas.get("cp", 1) * max(dp, 1))

    def copies_of(self, name: str) -> float | torch.Tensor:
        """How many TP ranks hold each element of local parameter `name` (a number, or a
        tensor of its shape for replicated KV heads), on the parameter's device."""
        copies = self._copies.get(name, self.tp)
        device = self.get_parameter(name).device
        if isinstance(copies, torch.Tensor) and copies.device != device:
            # e.g. built on the CPU, then moved: build_model's .to(device())
            copies = self._copies[name] = copies.to(device)
        return copies

    def _read_shard_map(self) -> tuple[dict[str, float | torch.Tensor], dict[str, Placements]]:
        """{local parameter name: ranks holding a copy}, {local name: its placements}, from the
        shard map. Keyed by name, which survives .to() and to_empty() (they may replace the
        Parameter objects). The counts are on the device the model is built on;
        copies_of moves one to its parameter's device."""
        entries = shard_map(self)
        return {e.local: e.copies for e in entries}, {e.local: e.placements for e in entries}

    def grad_sync_params(self) -> list[nn.Parameter]:
        """The parameters whose gradients `sync_grads` changes: the replicated KV heads' fused
        QKV (tp > n_kv_heads) and, with SP, the sequence-parallel ones. A ZeRO wrapper
        reduce-scatters these over DP only after the fix-ups."""
        out = [p for b in self.blocks if b.attn.kv_replicas > 1 for p in b.attn.qkv_params()]
        return out + (sequence_parallel_params(self) if self.sequence_parallel else [])

    def sync_grads(self, sequence_parallel_grads: bool = True) -> None:
        """Gradient fix-ups TP needs after backward, over the TP group: replicated KV heads
        (tp > n_kv_heads; 1 all-reduce per block) and, with sequence parallelism, the parameters
        that saw only a sequence shard (norms, row-parallel biases, learned positions; 1
        all-reduce for all of them).

        sequence_parallel_grads=False skips the latter: the real bug lesson 08 demonstrates
        (Megatron-LM #1446, gpt-neox #1257). Never pass it otherwise.
        """
        for block in self.blocks:
            block.attn.all_reduce_replicated_kv_grads()
        if self.sequence_parallel and sequence_parallel_grads:
            with tracer.phase("grad_sync"):
                all_reduce_sequence_parallel_grads(sequence_parallel_params(self), self.group)

    def gather_state_dict(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """The dense state dict (or dense-layout gradients) with DenseGPT's keys. Collective:
        1 all-gather over the TP group per split parameter.

        A pipeline stage returns only the keys it holds (blocks under their global index); the
        last stage's copy of a tied embedding is left out (the first stage holds the table).
        """
        out: dict[str, torch.Tensor] = {}
        for e in shard_map(self):
            value = e.param.grad if grads else e.param
            if e.tied_copy or value is None:
                continue
            if e.kind in ("replicated", "sequence"):
                out[e.name] = value.detach().clone()
                continue
            shards = collectives.all_gather(value.detach().contiguous(), self.group, dim=0)
            rows = self.config.vocab_size if e.kind == "vocab" else None
            out[e.name] = merge_shards(shards.chunk(self.tp), e.kind, self.config, rows)
        return out


Weight = float | torch.Tensor  # a gradient-norm weight: one number, or one per element


def weighted_grads(
    chunks: Iterable[TPGPT], replicas: Mapping[str, int] | None = None
) -> list[tuple[torch.Tensor, Weight]]:
    """(gradient, `TPGPT.norm_weight`) of every parameter of this rank's chunks that has one:
    what `grad_norm` sums. No communication."""
    return [
        (p.grad, chunk.norm_weight(name, replicas))
        for chunk in chunks
        for name, p in chunk.named_parameters()
        if p.grad is not None
    ]


def grad_norm(
    grads: Iterable[tuple[torch.Tensor, Weight]], group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The one gradient norm: sqrt(Σ w·g²) over every element g, weight w, of every rank of
    `group` (None: the world), a float64 scalar on every rank. Each rank sums its own squares
    in float64, weighted by 1 / the ranks holding a copy (`TPGPT.norm_weight`; ZeRO's shards
    carry the same weights per element), then 1 all-reduce adds the ranks' sums."""
    grads = list(grads)
    sq = torch.zeros((), dtype=torch.float64, device=grads[0][0].device if grads else None)
    for g, w in grads:
        sq += (g.double().square() * w).sum()
    return collectives.all_reduce(sq, group).sqrt()
