"""Lesson 12: ZeRO-1, -2 and -3 (FSDP): the optimizer states, the gradients, then the parameters
sharded over DP.

    ShardedDataParallel(chunks, group, level=1)   ZeRO-1: AdamW states sharded
    ShardedDataParallel(chunks, group, level=2)   ZeRO-2: the gradients as well
    ShardedDataParallel(chunks, group, level=3)   ZeRO-3 / FSDP: the parameters as well

It is both the gradient reducer (like DataParallel: `no_sync()`, `finish()`) and the optimizer
(AdamW over this rank's shards: `param_groups`, `zero_grad()`, `step()`).

Flat buffers. The parameters of a *unit* (one transformer block, or the rest of a chunk:
embeddings, final norm, head) lie end to end in one flat buffer padded to a multiple of N, the
DP size; DP rank r owns elements [r·n, (r+1)·n), n = padded / N, as an fp32 `shard`. Matrices
and vectors get separate buffers, so AdamW's weight decay applies to whole shards. Every
parameter is a view into its buffer: one all-gather into the buffer updates (ZeRO-1/2) or
restores (ZeRO-3) all of the unit's parameters at once.

No second fp32 copy. Under ZeRO-1 and -2 the shard AdamW steps *is* this rank's slice of the
buffer (a view), so the weights cost 4 bytes per parameter (fp32), padding apart, as in
Megatron-LM's distributed optimizer. Only ZeRO-3 (whose buffer is freed between uses) and a
`gather_dtype` (whose replicas are rounded, while the shard must not be) keep the shard apart.

Per step:
  ZeRO-1  the gradients live in a flat buffer too, laid out like the parameters' (each .grad a
          view, accumulated into in place). Backward: as a buffer's gradients complete, an
          async reduce-scatter writes the sum of this rank's elements into its own slice of
          that buffer, in place (then /N): shard.grad is that slice. The rest of the buffer
          keeps this rank's own gradients, as Megatron-LM's distributed optimizer keeps its
          whole gradient buffer: 4 bytes per parameter of gradients.
          step(): AdamW on the shards (in the buffer), then one in-place all-gather per buffer
          brings every other rank's new shard.
  ZeRO-2  the gradients per parameter, dropped once reduce-scattered: shard.grad alone stays.
  ZeRO-3  at rest a block keeps only its shard (the buffer's storage is resized to 0; autograd's
          saved views of it stay valid and see the data again once it is re-gathered). Before a
          block's forward its buffers are all-gathered (and the next block's all-gather is
          started, asynchronously: prefetch), after it freed; before its backward gathered again
          (prefetching the block before it), after it reduce-scattered as in ZeRO-2 and freed.
          The rest-unit stays gathered from the chunk's forward to the step, as FSDP2 keeps its
          root module: the head's backward comes straight after its forward.
Elements sent per rank per step (ring, Ψ parameters): ZeRO-1/2 a reduce-scatter and an
all-gather of Ψ, (N-1)/N each: DP's all-reduce, 2·(N-1)/N·Ψ, which is itself a reduce-scatter
and an all-gather. ZeRO-3 adds the blocks' second all-gather: (N-1)/N·(2Ψ + Ψ_blocks), 1.5× DP
when the blocks hold nearly all parameters.

Gradient fix-ups (TP's replicated-parameter sums, the tied embedding's) run over other groups
and need the full gradient, so the parameters they touch (`defer`) are reduce-scattered only in
finish(), which the caller runs after the fix-ups. Everything else overlaps with backward.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from tpedu.comm import collectives, recorder
from tpedu.parallel.data_parallel import GradientSync, split_by_group

LEVELS = (1, 2, 3)


class FlatBuffer:
    """Parameters (one unit, one weight-decay class) flattened into one buffer, N-way sharded.

    full [N·n]: the parameters are views into it; shard [n]: this rank's slice, what AdamW
    updates (a view of full at level 1 and 2 without a gather_dtype, else a copy); grads
    [N·n] (level 1 only): the parameters' .grad are views into it, shard.grad its slice;
    grad_weight [n]: 1 / (ranks holding a copy) per element, 0 for padding and for elements the
    gradient norm leaves out (a tied head's second copy). While a recorder runs
    (tpedu.comm.recorder), the buffer marks when its memory comes and goes: mark("gather" |
    "free", name, nbytes); `name` is for the reader (lesson 12 names its units)."""

    def __init__(
        self,
        params: list[nn.Parameter],
        weights: list[torch.Tensor | float],
        group: dist.ProcessGroup | None,
        reduce_dtype: torch.dtype | None,
        decayed: bool,
        gather_dtype: torch.dtype | None = None,
        level: int = 2,
        mean_over: int | None = None,
    ) -> None:
        self.params, self.group, self.reduce_dtype = params, group, reduce_dtype
        # the gradient sum's divisor: the group size, or the whole DP size for experts
        self.mean_over = mean_over or dist.get_world_size(group)
        self.gather_dtype = gather_dtype  # all-gather in this dtype (then widened), or as is
        self.narrow: torch.Tensor | None = None  # the gather_dtype buffer while a gather runs
        self.decayed = decayed  # whether AdamW decays this buffer's shard
        self.size, rank = dist.get_world_size(group), dist.get_rank(group)
        total = sum(p.numel() for p in params)
        self.n = -(-total // self.size)  # ceil: padded to a multiple of N
        ref = params[0]
        self.full = torch.zeros(self.n * self.size, dtype=ref.dtype, device=ref.device)
        weight = torch.zeros(self.n * self.size, dtype=torch.float64, device=ref.device)
        self.slices, offset = [], 0
        with torch.no_grad():
            for p, w in zip(params, weights, strict=True):
                piece = slice(offset, offset + p.numel())
                self.full[piece].copy_(p.reshape(-1))
                weight[piece] = torch.as_tensor(w, dtype=torch.float64).expand(p.shape).reshape(-1)
                p.data = self.full[piece].view_as(p)  # the parameter now lives in the buffer
                self.slices.append(piece)
                offset += p.numel()
        mine = slice(rank * self.n, (rank + 1) * self.n)
        # The shard is the buffer's own slice unless the buffer can differ from it: freed
        # (ZeRO-3) or holding gather_dtype's rounding of it.
        apart = level == 3 or gather_dtype is not None
        self.shard = nn.Parameter(self.full[mine].clone() if apart else self.full[mine])
        self.grad_weight = weight[mine].clone()
        self.mine = mine
        self.grads = torch.zeros_like(self.full) if level == 1 else None
        self.attach_grads()
        self.nbytes = self.full.untyped_storage().nbytes()
        self.gathered, self.gather_work = True, None
        self.waited = 0.0  # seconds spent blocked on this buffer's all-gathers
        self.ready, self.grad_out, self.grad_work = 0, None, None
        self.name = ""  # what the recorder's gather/free marks call this buffer

    def flat(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """Tensors shaped like `params`, end to end and zero-padded: [N·n], the buffer's layout."""
        flat = torch.cat([t.reshape(-1) for t in tensors])
        return nn.functional.pad(flat, (0, self.n * self.size - flat.numel()))

    # ZeRO-3's rhythm: gather before use, free after.
    def gather(self, async_op: bool = False) -> None:
        """All-gather the shards into the buffer (no-op if it is already there or coming)."""
        if self.gathered or self.gather_work is not None:
            if not async_op:
                self.wait_gather()
            return
        self.full.untyped_storage().resize_(self.nbytes)
        recorder.mark("gather", self.name, self.nbytes)
        self.gather_work = self._all_gather(async_op=True)  # waited for below or when needed
        if not async_op:
            self.wait_gather()

    def _all_gather(self, async_op: bool) -> dist.Work | collectives.CompletedWork:
        """The shards into `full`; with a gather_dtype through a buffer of that dtype (half
        the bytes for bf16), widened into `full` when waited for."""
        if self.gather_dtype is None:
            return collectives.all_gather_into(self.full, self.shard.detach(), self.group, async_op)
        self.narrow = self.full.new_empty(self.full.shape, dtype=self.gather_dtype)
        shard = self.shard.detach().to(self.gather_dtype)
        return collectives.all_gather_into(self.narrow, shard, self.group, async_op)

    def _widen(self) -> None:
        if self.narrow is not None:
            self.full.copy_(self.narrow)
            self.narrow = None

    def gather_exact(self) -> None:
        """All-gather the shards into the buffer in their own dtype (no gather_dtype)."""
        self.wait_gather()
        self.full.untyped_storage().resize_(self.nbytes)
        with torch.no_grad():
            collectives.all_gather_into(self.full, self.shard.detach(), self.group)
        self.gathered = True

    def wait_gather(self) -> None:
        if self.gather_work is not None:
            start = time.perf_counter()
            self.gather_work.wait()  # exposed communication: compute waits for it here
            self.waited += time.perf_counter() - start
            self.gather_work = None
            self._widen()
        self.gathered = True

    def free(self) -> None:
        """Drop the full buffer's memory (the parameters keep their shapes, not their data)."""
        if recorder.on() and (self.gathered or self.gather_work is not None):
            recorder.mark("free", self.name, self.nbytes)
        if self.gather_work is not None:  # a prefetch still in flight: let it land, unused
            self.gather_work.wait()
            self.gather_work, self.narrow = None, None
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    # Gradients: full per-parameter .grad -> this rank's summed shard.
    def attach_grads(self) -> None:
        """ZeRO-1: every parameter's .grad a view of the zeroed gradient buffer (backward then
        accumulates into it in place); no-op at other levels."""
        if self.grads is None:
            return
        self.grads.zero_()
        for p, piece in zip(self.params, self.slices, strict=True):
            p.grad = self.grads[piece].view_as(p)

    def reduce_grads(self) -> None:
        """Start the async reduce-scatter of the parameters' gradients. ZeRO-1: from the
        gradient buffer into its own slice (in place, unless a reduce_dtype needs a narrow
        copy); ZeRO-2/3: from a flat copy, the parameters' .grad then dropped."""
        if self.grads is not None and self.reduce_dtype is None:
            flat, self.grad_out = self.grads, self.grads[self.mine]
        else:
            flat = self.flat(
                [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
            )
            if self.reduce_dtype is not None:
                flat = flat.to(self.reduce_dtype)
            self.grad_out = flat.new_empty(self.n)
        self.grad_work = collectives.reduce_scatter_into(
            self.grad_out, flat, self.group, async_op=True
        )
        if self.grads is None:
            for p in self.params:
                p.grad = None

    def finish_grads(self) -> None:
        """Wait for the reduce-scatter; shard.grad = the mean over the DP ranks (ZeRO-1: in
        this rank's slice of the gradient buffer)."""
        if self.grad_work is None:
            self.reduce_grads()
        self.grad_work.wait()
        if self.grads is None:
            self.shard.grad = self.grad_out.to(self.shard.dtype).div_(self.mean_over)
        else:
            mean = self.grads[self.mine]
            if self.grad_out.data_ptr() != mean.data_ptr():  # reduced in a reduce_dtype
                mean.copy_(self.grad_out)
            self.shard.grad = mean.div_(self.mean_over)
        self.ready, self.grad_out, self.grad_work = 0, None, None

    def write_params(self) -> None:
        """After the step: every replica's parameters from the owners' new shards."""
        if self.gathered:
            self._all_gather(async_op=False).wait()
            with torch.no_grad():
                self._widen()


def held_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the storages behind `tensors`, each counted once however many views share it
    (valid on the meta device: a storage's identity, not its address)."""
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


class GatherForBackward(torch.autograd.Function):
    """Identity on a block's output; its backward re-gathers the block's parameters first
    (autograd runs it just before the block's own backward)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, gather: Callable[[], None]) -> torch.Tensor:
        ctx.gather = gather
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.gather()
        return grad, None


class _Unit:
    """One block (or a chunk's rest: `root`) and its buffers; `prev` / `next`: the neighbouring
    blocks of the same chunk, whose all-gathers ZeRO-3 prefetches."""

    def __init__(self, module: nn.Module, buffers: list[FlatBuffer], root: bool) -> None:
        self.module, self.buffers, self.root = module, buffers, root
        self.params = sum(len(b.params) for b in buffers)
        self.ready = 0  # parameters whose gradient this backward has produced
        self.prev: _Unit | None = None
        self.next: _Unit | None = None

    def gather(self, async_op: bool = False) -> None:
        for b in self.buffers:
            b.gather(async_op)

    def free(self) -> None:
        for b in self.buffers:
            b.free()


class ShardedDataParallel(GradientSync):
    """ZeRO-1, -2 or -3 over the DP `group` for this rank's TPGPT chunks.

    Per step: forward/backward (micro-batches inside `no_sync()` except the last), the caller's
    gradient fix-ups on `defer`'s parameters, `finish()`, clipping with `weighted_grads()`,
    `step()`. `decay(p)`: whether AdamW decays p; `weight_of(chunk, name)`: the gradient-norm
    weight of a chunk's parameter (`TPGPT.norm_weight`); `reduce_dtype`: as DataParallel's;
    `gather_dtype` (e.g. torch.bfloat16): all-gather the parameters in it, half the bytes, the
    replicas' parameters then rounded to it (AdamW's fp32 shards are not); `prefetch`
    (ZeRO-3): start the neighbouring block's all-gather early (False: only when it is needed).
    `group_of`, `mean_over`: as DataParallel's; a parameter whose gradient is summed over
    another group (an expert, split over ep: the ranks holding the same experts) goes in
    buffers of their own, sharded over that group.

    Many parameters because the AdamW settings (lr, betas, weight_decay) are torch.optim.AdamW's
    own, beside ZeRO's (level, dtypes, prefetch).
    """

    def __init__(
        self,
        chunks: Sequence[nn.Module],
        group: dist.ProcessGroup | None,
        level: int,
        *,
        decay: Callable[[nn.Parameter], bool],
        weight_of: Callable[[nn.Module, str], torch.Tensor | float],
        defer: Sequence[nn.Parameter] = (),
        reduce_dtype: torch.dtype | None = None,
        gather_dtype: torch.dtype | None = None,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        weight_decay: float = 0.0,
        prefetch: bool = True,
        group_of: Callable[[nn.Parameter], dist.ProcessGroup | None] | None = None,
        mean_over: int | None = None,
    ) -> None:
        if level not in LEVELS:
            raise ValueError(f"ShardedDataParallel level must be one of {LEVELS}, got {level}")
        self.level, self.group, self.prefetch = level, group, prefetch
        self.decay, self.weight_of, self.reduce_dtype = decay, weight_of, reduce_dtype
        self.gather_dtype = gather_dtype
        self.deferred = {id(p) for p in defer}
        self.group_of, self.mean_over = group_of, mean_over or dist.get_world_size(group)
        self.peak_gathered = 0  # ZeRO-3: most bytes of whole parameters held at once
        self.units: list[_Unit] = []
        for chunk in chunks:
            blocks = []
            for i, block in enumerate(chunk.blocks):
                named = [(f"blocks.{i}.{n}", p) for n, p in block.named_parameters()]
                blocks.append(self._unit(chunk, block, named, root=False))
            for a, b in itertools.pairwise(blocks):
                a.next, b.prev = b, a
            in_blocks = {id(p) for b in chunk.blocks for p in b.parameters()}
            rest = [(n, p) for n, p in chunk.named_parameters() if id(p) not in in_blocks]
            self.units += [*blocks, self._unit(chunk, chunk, rest, root=True)]
        self.units = [u for u in self.units if u.buffers]
        self.buffers = [b for u in self.units for b in u.buffers]
        # id(parameter) -> (its buffer's index, its index in the buffer)
        self.home = {
            id(p): (k, i) for k, b in enumerate(self.buffers) for i, p in enumerate(b.params)
        }
        self.blocks = [u for u in self.units if not u.root]
        self.roots = [u for u in self.units if u.root]
        groups = [
            {"params": [b.shard for b in self.buffers if b.decayed], "weight_decay": weight_decay},
            {"params": [b.shard for b in self.buffers if not b.decayed], "weight_decay": 0.0},
        ]
        self.inner = torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas)
        self.param_groups = self.inner.param_groups
        if level == 3:
            self._install_hooks()
            for b in self.buffers:
                b.free()

    def _unit(
        self, chunk: nn.Module, module: nn.Module, named: list[tuple[str, nn.Parameter]], root: bool
    ) -> _Unit:
        """`module`'s unit: one buffer per class (decayed or not, deferred or not) of its
        trainable parameters, with the gradient hooks that reduce and free them."""
        named = [(n, p) for n, p in named if p.requires_grad]
        buffers = []
        by_group = split_by_group([p for _, p in named], self.group, self.group_of)
        for decayed, late, (group, members) in itertools.product(
            (True, False), (False, True), by_group
        ):
            ids = {id(p) for p in members}
            part = [
                (n, p)
                for n, p in named
                if self.decay(p) == decayed and (id(p) in self.deferred) == late and id(p) in ids
            ]
            if part:
                weights = [self.weight_of(chunk, n) for n, _ in part]
                buf = FlatBuffer(
                    [p for _, p in part],
                    weights,
                    group,
                    self.reduce_dtype,
                    decayed,
                    self.gather_dtype,
                    self.level,
                    mean_over=self.mean_over,
                )
                for _, p in part:
                    p.register_post_accumulate_grad_hook(self._grad_hook(buf, late))
                buffers.append(buf)
        unit = _Unit(module, buffers, root)
        for _, p in named:
            p.register_post_accumulate_grad_hook(self._unit_hook(unit))
        return unit

    def _grad_hook(self, buf: FlatBuffer, deferred: bool) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            if not self.sync or deferred:
                return
            buf.ready += 1
            if buf.ready == len(buf.params):
                buf.reduce_grads()

        return hook

    def _unit_hook(self, unit: _Unit) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            unit.ready += 1
            if unit.ready == unit.params:  # the block's backward is done: free it (ZeRO-3)
                unit.ready = 0
                if self.level == 3 and not unit.root:
                    unit.free()

        return hook

    def _gather(self, unit: _Unit | None, async_op: bool = False) -> None:
        if unit is not None and (self.prefetch or not async_op):
            unit.gather(async_op)
            self.peak_gathered = max(self.peak_gathered, self.gathered_bytes())

    def _install_hooks(self) -> None:
        """ZeRO-3's gather / free rhythm, from forward hooks on every block and chunk."""
        for unit in self.blocks:

            def before(_m: nn.Module, _args: object, unit: _Unit = unit) -> None:
                self._gather(unit)
                self._gather(unit.next, async_op=True)  # prefetch the next block

            def after(
                _m: nn.Module, _args: object, out: torch.Tensor, unit: _Unit = unit
            ) -> torch.Tensor:
                unit.free()
                if not (torch.is_grad_enabled() and out.requires_grad):
                    return out

                def regather(unit: _Unit = unit) -> None:
                    self._gather(unit)
                    self._gather(unit.prev, async_op=True)  # prefetch the block before

                return GatherForBackward.apply(out, regather)

            unit.module.register_forward_pre_hook(before)
            unit.module.register_forward_hook(after)
        for unit in self.roots:
            unit.module.register_forward_pre_hook(lambda _m, _a, unit=unit: self._gather(unit))

    # The DataParallel side (and `no_sync()`, from GradientSync: only full gradients accumulate).
    def finish(self) -> None:
        """Reduce-scatter what backward did not (deferred, unused), wait for everything: every
        shard.grad is then the DP mean of its elements."""
        for b in self.buffers:
            b.finish_grads()
        for u in self.units:  # a block with an unused parameter never counted to the end
            u.ready = 0

    def weighted_grads(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(shard.grad, its elements' gradient-norm weights) of every buffer: what
        `tpedu.model.gpt.grad_norm` sums. No communication."""
        return [(b.shard.grad, b.grad_weight) for b in self.buffers if b.shard.grad is not None]

    def gather_wait_seconds(self) -> float:
        """Seconds this rank's compute has waited for ZeRO-3's all-gathers (exposed
        communication: what prefetching hides)."""
        return sum(b.waited for b in self.buffers)

    def gathered_bytes(self) -> int:
        """Bytes of whole (gathered) parameter buffers this rank holds now."""
        return sum(b.full.untyped_storage().nbytes() for b in self.buffers)

    def weight_bytes(self) -> int:
        """Bytes this rank holds for the parameters now: the whole buffers still held, and the
        shards that are not views of them (each storage once)."""
        return held_bytes([t for b in self.buffers for t in (b.full, b.shard)])

    def grad_bytes(self) -> int:
        """Bytes this rank holds for gradients now: the shards' means, the gradient buffers
        (ZeRO-1) or whatever .grad backward left on the parameters (each storage once)."""
        grads = [b.shard.grad for b in self.buffers] + [
            p.grad for b in self.buffers for p in b.params
        ]
        return held_bytes([g for g in grads if g is not None])

    def shards(self) -> list[nn.Parameter]:
        return [b.shard for b in self.buffers]

    # The optimizer side.
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients gone (ZeRO-1: its buffer zeroed, the .grad views kept)."""
        for b in self.buffers:
            b.shard.grad = None
            for p in b.params:
                p.grad = None
            b.attach_grads()

    @torch.no_grad()
    def step(self) -> None:
        """AdamW on the shards; ZeRO-1/2: all-gather the new parameters into every replica;
        ZeRO-3: drop the rest-units' stale full copies (the next forward gathers them)."""
        self.inner.step()
        for b in self.buffers:
            if self.level < 3:
                b.write_params()
            else:
                b.free()

    def state_numel(self) -> int:
        """Elements of AdamW state on this rank (2 per shard element)."""
        return sum(v.numel() for s in self.inner.state.values() for v in s.values() if v.dim() > 0)

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Inside: every parameter whole on every DP rank, with exactly its fp32 shard's values
        (a gather_dtype's rounding undone); on exit ZeRO-3 frees them again, and ZeRO-1/2 with
        a gather_dtype go back to the rounded replicas training steps with. One blocking
        all-gather per buffer not already whole and exact (and one more on exit with a
        gather_dtype)."""
        for b in self.buffers:
            if not (b.gathered and b.gather_dtype is None):  # whole and exact already
                b.gather_exact()
        try:
            yield
        finally:
            for b in self.buffers:
                if self.level == 3:
                    b.free()
                elif b.gather_dtype is not None:
                    b.write_params()

    # Checkpoints: whole tensors one buffer at a time, never the whole model at once.
    @torch.no_grad()
    def whole_tensors(
        self, wanted: set[int]
    ) -> dict[int, tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        """{id(p): (p's whole value, its whole AdamW state)} for the parameters in `wanted`
        (ids; each rank its own set: what it writes), from the fp32 shards (not from the
        replicas' parameters, which `gather_dtype` rounds). Collective over DP: buffer after
        buffer, the shards and their states are all-gathered and the wanted tensors copied
        out, so beside what it returns a rank holds one buffer's whole values at a time."""
        out = {}
        for b in self.buffers:
            whole = {"": b.shard.detach(), **self.inner.state.get(b.shard, {})}
            for key, value in whole.items():
                if value.dim():  # AdamW's step (a scalar) is the same for every element
                    whole[key] = value.new_empty(b.n * b.size)
                    collectives.all_gather_into(whole[key], value, b.group)
            for p, piece in zip(b.params, b.slices, strict=True):
                if id(p) in wanted:
                    st = {
                        k: (v if v.dim() == 0 else v[piece].view_as(p)).clone()
                        for k, v in whole.items()
                    }
                    out[id(p)] = (st.pop(""), st)
        return out

    def shard_piece(self, p: nn.Parameter, value: torch.Tensor) -> tuple[int, slice, torch.Tensor]:
        """The part of `value` (shaped like parameter p: its value or a state) in this rank's
        shard: (index of p's buffer, where in the shard, a copy of those elements); an empty
        piece when p has no element there."""
        k, i = self.home[id(p)]
        b = self.buffers[k]
        if value.dim() == 0:  # AdamW's step: one value for the whole shard
            return k, slice(0, 0), value.clone()
        piece = b.slices[i]
        lo = max(piece.start, b.mine.start)
        hi = max(lo, min(piece.stop, b.mine.stop))
        part = value.reshape(-1)[lo - piece.start : hi - piece.start]
        part = part.to(device=b.shard.device, dtype=b.shard.dtype).clone()
        return k, slice(lo - b.mine.start, hi - b.mine.start), part

    @torch.no_grad()
    def load_pieces(
        self,
        params: Sequence[tuple[int, slice, torch.Tensor]],
        states: dict[str, Sequence[tuple[int, slice, torch.Tensor]]],
    ) -> None:
        """Fill the shards and their AdamW states from `shard_piece`s that cover them; then
        every replica's whole parameters from the new shards (ZeRO-1/2: one all-gather per
        buffer; ZeRO-3 gathers them when they are next used). Collective over DP."""
        for k, where, part in params:
            self.buffers[k].shard[where] = part
        for key, pieces in states.items():
            for k, where, part in pieces:
                b = self.buffers[k]
                st = self.inner.state.setdefault(b.shard, {})
                if part.dim() == 0:
                    st[key] = part
                    continue
                st.setdefault(key, torch.zeros_like(b.shard.detach()))[where] = part
        for b in self.buffers:
            b.write_params()
