"""Lesson 06: the loss and the sampler over logits split along the vocabulary (seed §2.4, §5.5).

With a vocab-parallel output layer, rank r holds logits [..., Vp/t]: columns [r·Vp/t, (r+1)·Vp/t)
of the padded vocabulary. Gathering the full [b, s, V] logits to compute the loss would move
b·s·V elements; the cross-entropy needs only three numbers per token, each an all-reduce of b·s
elements:

    m     = max_v z_v                      all-reduce(MAX) of the local maxima
    S     = sum_v exp(z_v - m)             all-reduce(SUM) of the local sums
    z_y   = the target's logit             all-reduce(SUM): the owner contributes it, others 0
    loss  = log S + m - z_y

The backward needs no communication: d loss / d z_v = softmax_v - [v == y], and each rank has its
own columns' softmax (exp(z_v - m) / S) and knows whether it owns y.

Padding columns (global id >= vocab_size) are set to -inf before anything else, so they never
touch the max, the sum, the gradient (exactly 0 there) or a sample.

Sampling: the seed's §5.5 trap is argmax over one shard, which returns that rank's best token,
not the model's. `vocab_parallel_argmax` compares every rank's best (value, id) instead, and
`vocab_parallel_sample` samples with the Gumbel-max trick, so a generator seeded the same on every
rank gives exactly the token that `sample` gives on the dense logits.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tpedu.comm import collectives

IGNORE = -100  # the target id that cross-entropy skips (padding, packing boundaries)


def _shard_info(
    logits_shard: torch.Tensor, vocab_size: int, group: dist.ProcessGroup | None
) -> tuple[int, int, int]:
    """(start, n, t): this rank's first global column, its shard width, the group size."""
    t, r = dist.get_world_size(group), dist.get_rank(group)
    n = logits_shard.shape[-1]
    if n * t < vocab_size:
        raise ValueError(
            f"logits shard has {n} columns × tp={t} = {n * t} < vocab_size = {vocab_size}; "
            f"each rank must hold padded_vocab(vocab_size, tp) / tp = {-(-vocab_size // t)} columns"
        )
    return r * n, n, t


def _mask_padding(logits_shard: torch.Tensor, start: int, vocab_size: int) -> torch.Tensor:
    """The shard with -inf in its padding columns, the ones past the last token id
    (vocab_size - 1); a copy if it has any."""
    n = logits_shard.shape[-1]
    if start + n <= vocab_size:
        return logits_shard
    cols = torch.arange(start, start + n, device=logits_shard.device)
    return logits_shard.masked_fill(cols >= vocab_size, float("-inf"))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits_shard: torch.Tensor,
        target: torch.Tensor,
        vocab_size: int,
        group: dist.ProcessGroup | None,
        ignore_index: int,
        inplace: bool,
    ) -> torch.Tensor:
        start, n, _ = _shard_info(logits_shard, vocab_size, group)
        bad = ((target < 0) | (target >= vocab_size)) & (target != ignore_index)
        # meta tensors (lesson 13's dry run) have shapes, no values to check; on a GPU the
        # check is a device-side assert: bool(bad.any()) would stall it every forward
        if target.device.type == "cuda":
            msg = f"targets must be in [0, {vocab_size}) or ignore_index={ignore_index}"
            torch._assert_async(~bad.any(), msg)
        elif target.device.type != "meta" and bool(bad.any()):
            raise ValueError(
                f"targets must be in [0, {vocab_size}) or ignore_index={ignore_index}; "
                f"found {target[bad][0].item()}"
            )
        z = _mask_padding(logits_shard, start, vocab_size)

        # 1. the global max, for a stable exp (without it exp(z) overflows for z > 88 in fp32)
        m = z.amax(dim=-1)  # not max(): that also computes the indices, 7× slower on CPU
        collectives.all_reduce(m, group, op=dist.ReduceOp.MAX)
        # The one [..., Vp/t] buffer that exp, softmax and the gradient reuse. A fresh one costs
        # more than the subtraction (a 32 MB buffer is new pages for the OS to fault in).
        writable = inplace or z is not logits_shard  # _mask_padding already made a copy
        z = z.sub_(m.unsqueeze(-1)) if writable else z - m.unsqueeze(-1)

        # 2. the target's (shifted) logit: only the owning rank has it, the others add 0
        owned = (target >= start) & (target < start + n)
        local_t = (target - start).masked_fill(~owned, 0)
        z_y = z.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0.0)
        collectives.all_reduce(z_y, group)

        # 3. the sum of exponentials
        e = z.exp_()
        s = e.sum(dim=-1)
        collectives.all_reduce(s, group)

        loss = s.log() - z_y  # = log S + m - z_y with the max already taken out of both
        ignored = target == ignore_index
        loss = loss.masked_fill(ignored, 0.0)
        ctx.save_for_backward(e.div_(s.unsqueeze(-1)), owned, local_t, ignored)
        ctx.backward_done = False
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.backward_done:
            raise RuntimeError(
                "vocab_parallel_cross_entropy's backward reuses its saved softmax in place and "
                "can run only once; recompute the loss instead of backward(retain_graph=True)"
            )
        ctx.backward_done = True
        softmax, owned, local_t, ignored = ctx.saved_tensors
        # d loss / d z_v = softmax_v - [v == y] (padding: exp(-inf) = 0). Written into the saved
        # softmax, as Megatron-LM does: a copy would be another [..., Vp/t] buffer per step.
        grad = softmax
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -owned.unsqueeze(-1).to(grad.dtype))
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor,
    target: torch.Tensor,
    vocab_size: int,
    group: dist.ProcessGroup | None = None,
    ignore_index: int = -100,
    inplace: bool = False,
) -> torch.Tensor:
    """Per-token cross-entropy from vocab-sharded logits, without gathering them.

    logits_shard: [..., Vp/t], this rank's columns of the padded vocabulary.
    target: [...] global token ids in [0, vocab_size) or ignore_index (loss 0, gradient 0).
    Returns the loss [...], identical on every rank; equals
    `F.cross_entropy(full_logits[..., :vocab_size], target, reduction="none")`.
    Forward: 3 all-reduces of target.numel() elements (max, target logit, sum of exp).
    Backward: none.
    inplace=True overwrites logits_shard (with its softmax, then its gradient) instead of
    allocating a buffer of its size, as Megatron-LM does: for logits that nothing else reads,
    like TPGPT's.
    """
    return _VocabParallelCrossEntropy.apply(
        logits_shard, target, vocab_size, group, ignore_index, inplace
    )


def gather_logits(
    logits_shard: torch.Tensor, vocab_size: int, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The full logits [..., V] from the shards [..., Vp/t] (1 all-gather; padding dropped).

    For inspection and inference; not differentiable (train with vocab_parallel_cross_entropy).
    """
    _shard_info(logits_shard, vocab_size, group)
    full = collectives.all_gather(logits_shard.detach().contiguous(), group, dim=-1)
    return full[..., :vocab_size]


def vocab_parallel_argmax(
    logits_shard: torch.Tensor, vocab_size: int, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The id [...] of the largest logit over the whole vocabulary, from the shards [..., Vp/t]:
    what torch.argmax gives on the dense logits (ties to the lowest id), the same on every rank.
    """
    start, _, _ = _shard_info(logits_shard, vocab_size, group)
    z = _mask_padding(logits_shard.detach(), start, vocab_size)
    best, idx = z.max(dim=-1, keepdim=True)  # first maximum within the shard
    values = collectives.all_gather(best.contiguous(), group, dim=-1)  # [..., t], rank order
    ids = collectives.all_gather((idx + start).contiguous(), group, dim=-1)
    winner = values.argmax(dim=-1, keepdim=True)  # first (lowest-rank) maximum: lowest id
    return ids.gather(-1, winner).squeeze(-1)


def _gumbel(shape: tuple[int, ...], generator: torch.Generator, like: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise for the whole vocabulary from `generator` (float64 uniforms drawn on
    the generator's device), returned with `like`'s dtype and device."""
    u = torch.rand(shape, generator=generator, dtype=torch.float64, device=generator.device)
    u = u.clamp_min(torch.finfo(torch.float64).tiny)
    return (-(-u.log()).log()).to(device=like.device, dtype=like.dtype)


def _top_k_floor(values: torch.Tensor, k: int) -> torch.Tensor:
    """The k-th largest value along the last dim, keepdim (ties count once each)."""
    return values.topk(k, dim=-1).values[..., -1:]


def sample(
    logits: torch.Tensor,
    generator: torch.Generator,
    temperature: float = 1.0,
    top_k: int | None = None,
) -> torch.Tensor:
    """The dense reference sampler: token ids [...] from full logits [..., V].

    Gumbel-max: argmax(z / T + g) with g ~ Gumbel(0, 1) is an exact sample from softmax(z / T).
    top_k keeps the tokens whose logit is >= the k-th largest. temperature 0 -> argmax.
    The noise is drawn for all V ids from `generator`, so the same seed gives the same token
    in `vocab_parallel_sample`.
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
    z = logits.detach() / temperature
    if top_k is not None:
        z = z.masked_fill(z < _top_k_floor(z, min(top_k, z.shape[-1])), float("-inf"))
    g = _gumbel(tuple(z.shape), generator, z)
    return (z + g).argmax(dim=-1)


def vocab_parallel_sample(
    logits_shard: torch.Tensor,
    vocab_size: int,
    generator: torch.Generator,
    temperature: float = 1.0,
    top_k: int | None = None,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Token ids [...] sampled from the shards [..., Vp/t]; equal to `sample(full_logits, ...)`.

    `generator` must be seeded identically on every rank: each rank draws the noise for the
    whole vocabulary and keeps its own columns, so the sum z / T + g is the dense one, sliced.
    Communication: top_k adds 1 all-gather of k·t values per token; then vocab_parallel_argmax.
    """
    start, n, _ = _shard_info(logits_shard, vocab_size, group)
    if temperature == 0:
        return vocab_parallel_argmax(logits_shard, vocab_size, group)
    z = _mask_padding(logits_shard.detach(), start, vocab_size) / temperature
    if top_k is not None:
        k = min(top_k, vocab_size)
        local = z.topk(min(k, n), dim=-1).values  # the global top-k is among the local top-ks
        if local.shape[-1] < k:  # shards narrower than k: pad so every rank sends k values
            pad = local.new_full((*local.shape[:-1], k - local.shape[-1]), float("-inf"))
            local = torch.cat([local, pad], dim=-1)
        floor = _top_k_floor(collectives.all_gather(local.contiguous(), group, dim=-1), k)
        z = z.masked_fill(z < floor, float("-inf"))
    g = _gumbel((*z.shape[:-1], vocab_size), generator, z)
    g = torch.nn.functional.pad(g, (0, start + n - vocab_size)) if start + n > vocab_size else g
    return vocab_parallel_argmax(z + g[..., start : start + n], vocab_size, group)
