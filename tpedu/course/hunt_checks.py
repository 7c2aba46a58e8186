"""Lesson 16: the hunt's checks of a fix on inputs its case never shows, and case 2's check.

A rewrite that only matches the run a learner saw must not close a case: each `unseen_*` runs
the contract of the function that broke on other shapes, vocabularies, head and mesh layouts,
schedules and seeds, through the name tpedu calls (the learner's fix while one is in place, the
broken function otherwise), and returns one (ok, detail) per rank. Under the bug every one of
them fails (tests/test_hunt_cheats.py). `check_schedule` is case 2's own check: the property
1F1B exists for (lesson 11: at most p - s micro-batches in flight on stage s), not only a step
that finishes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist

from tpedu.comm.device import device
from tpedu.course import bugzoo
from tpedu.course.troubleshoot import compare_with_dense
from tpedu.model.dense import DenseGPT
from tpedu.parallel import mesh, pipeline
from tpedu.tp import attention, vocab_parallel


def every_rank(line: object) -> list:
    """`line` from every rank of the default group, in rank order (collective)."""
    lines: list = [None] * dist.get_world_size()
    dist.all_gather_object(lines, line)
    return lines


def _now(owner: object, attr: str) -> Callable:
    """owner.attr as it is now: a fix, while one is in place, else tpedu's (broken, under a bug)."""
    return getattr(owner, attr)


def _summarise(results: list[tuple[bool, str]]) -> tuple[bool, str]:
    """One verdict for several runs the learner has not seen: all must pass."""
    failed = [detail for ok, detail in results if not ok]
    if not failed:
        return True, f"{len(results)} runs you have not seen: all pass"
    return False, f"{len(failed)} of {len(results)} runs you have not seen fail, e.g. {failed[0]}"


def _guarded(run: Callable[[], tuple[bool, str]]) -> tuple[bool, str]:
    """A run that calls the learner's function: an exception is that run's failure."""
    try:
        return run()
    except Exception as e:  # the learner's code: reported, not raised
        msg = str(e).splitlines()[0][:120] if str(e) else ""
        return False, f"raised {type(e).__name__}: {msg}"


def _vs_dense(config: object, group: object = None, seed: int = 1, **batch: int) -> tuple:
    cmp = compare_with_dense(config, group, bugzoo.example_batch(config, seed, **batch))
    return cmp.ok, cmp.summary()


def _calls_wrong(cases: list[tuple], call: Callable, want: Callable) -> tuple[bool, str]:
    """call(*args) == want(*args) for every args in `cases` (local: no communication)."""
    wrong = 0
    for args in cases:
        try:
            ok = call(*args) == want(*args)
        except Exception:  # a crash on an input is a wrong answer for it
            ok = False
        wrong += not ok
    return wrong == 0, f"{wrong} of {len(cases)} calls wrong"


def _head_layouts() -> list[tuple[int, int, int, int]]:
    out = []
    for nq in range(1, 17):
        for nkv in (d for d in range(1, nq + 1) if nq % d == 0):
            for tp in range(1, 17):
                if nq % tp == 0 and (nkv % tp == 0 or tp % nkv == 0):
                    out += [(nq, nkv, tp, r) for r in range(tp)]
    return out


def _heads_used(nq: int, nkv: int, tp: int, rank: int) -> tuple[list[int], list[int]]:
    """A rank's query heads and the KV heads those queries read (query h reads h // (nq/nkv))."""
    q = list(range(rank * nq // tp, (rank + 1) * nq // tp))
    return q, sorted({h // (nq // nkv) for h in q})


def unseen_heads() -> tuple[bool, str]:
    """Case 1: another GQA model at tp 4, and every (heads, KV heads, tp, rank) up to 16."""
    wide = replace(bugzoo.LLAMA, vocab_size=41, hidden=32, n_heads=8, n_kv_heads=2)
    return _summarise(
        [
            _guarded(lambda: _vs_dense(wide, seed=7)),
            _guarded(lambda: _calls_wrong(_head_layouts(), attention.local_heads, _heads_used)),
        ]
    )


def order_breaks(actions: list, n_micro: int, n_stages: int, stage: int) -> str:
    """What in `actions` breaks 1F1B's order on `stage` ("" when nothing does): every micro-batch
    forward once, then backward once, both in micro-batch order; at most p - s micro-batches in
    flight (forward run, backward not yet) on stage s of p; a forward whenever fewer are in
    flight and one remains, a backward (of the oldest) once that many are or none remains."""
    limit = min(n_stages - stage, n_micro)
    done_f = done_b = 0
    for action in actions:
        kind, mb = action[0], action[1]
        held = done_f - done_b
        name = f"{kind}{mb}"
        if kind not in ("F", "B"):
            return f"{action!r} is neither a forward nor a backward"
        if kind == "F" and mb != done_f or kind == "B" and mb != done_b:
            return f"{name} out of micro-batch order"
        if kind == "B" and mb >= done_f:
            return f"{name} before its forward"
        if kind == "F" and held >= limit:
            most = n_stages - stage
            return f"{name} with {held} in flight, at most {most} on stage {stage} of {n_stages}"
        if kind == "B" and held < limit and done_f < n_micro:
            return f"{name} with {held} in flight, while a forward may still run"
        done_f, done_b = done_f + (kind == "F"), done_b + (kind == "B")
    if (done_f, done_b) != (n_micro, n_micro):
        return f"{done_f} forwards and {done_b} backwards of {n_micro} micro-batches"
    return ""


def _order(n_micro: int, n_stages: int, stage: int) -> tuple[bool, str]:
    acts = pipeline.schedule("1f1b", n_micro, n_stages, stage)
    broke = order_breaks(acts, n_micro, n_stages, stage)
    text = " ".join(f"{a[0]}{a[1]}" for a in acts)
    return not broke, f"stage {stage} runs {text}" + (f": {broke}" if broke else "")


# How long a stage's receive waits before the step counts as hung: long enough that a loaded
# CPU never trips it on a schedule that works, short enough that a hung case answers quickly.
RECV_TIMEOUT = 3.0


def _pipeline_step(n_micro: int) -> tuple[bool, str]:
    """pp = world (2), n_micro micro-batches: the step must finish (receives wait RECV_TIMEOUT
    seconds at most)."""
    m = mesh.Mesh(mesh.Layout(tp=1, pp=2, dp=1))
    torch.manual_seed(0)
    dense = DenseGPT(bugzoo.GPT2)
    chunks = [c.to(device()) for c in pipeline.build_stage_chunks(dense, m.tp_group, m.pp_rank, 2)]
    ids, tgt = (x.to(device()) for x in bugzoo.example_batch(bugzoo.GPT2, b=2 * n_micro))
    try:
        pipeline.run_schedule(
            chunks,
            pipeline.schedule("1f1b", n_micro, 2, m.pp_rank),
            pipeline.Pipe.from_mesh(m),
            list(ids.chunk(n_micro)),
            list(tgt.chunk(n_micro)),
            (2, 6, bugzoo.GPT2.hidden),
            options=pipeline.StepOptions(recv_timeout=RECV_TIMEOUT),
        )
    except pipeline.PipelineTimeout as e:
        return False, str(e).split(": the stages")[0]
    return True, "the step finished"


def check_schedule() -> tuple[bool, str]:
    """2 stages, 2 micro-batches: this stage's order keeps 1F1B's, and the step finishes."""
    order = _guarded(lambda: _order(2, 2, dist.get_rank()))
    step = _pipeline_step(2)  # a wrong order may hang: the receives' timeout ends it
    return order[0] and step[0], f"{order[1]}; {step[1]}"


def unseen_schedules() -> tuple[bool, str]:
    """Case 2: the order on every stage of up to 6 stages, 1-8 micro-batches; a 3-micro-batch
    step."""
    grid = [(m, p, s) for m in range(1, 9) for p in range(1, 7) for s in range(p)]
    orders = [_guarded(lambda a=a: _order(*a)) for a in grid]
    bad = [detail for ok, detail in orders if not ok]
    runs = [(not bad, bad[0] if bad else "")]
    if all(every_rank(not bad)):  # a bad order may hang: run the step only when none is
        runs.append(_pipeline_step(3))
    return _summarise(runs)


def unseen_vocab() -> tuple[bool, str]:
    """Case 3: vocabularies 35 and 41 at tp 2, and every shard of vocabularies 2-29 at tp 1-5."""
    g = torch.Generator().manual_seed(3)
    cases = []
    for vocab in range(2, 30):
        for tp in range(1, 6):
            n = -(-vocab // tp)
            cases += [(torch.randn(2, n, generator=g), r * n, vocab) for r in range(tp)]

    def want(shard: torch.Tensor, start: int, vocab: int) -> torch.Tensor:
        cols = torch.arange(start, start + shard.shape[-1])
        return shard.masked_fill(cols >= vocab, float("-inf"))

    def same(got: torch.Tensor, ref: torch.Tensor) -> bool:
        return bool(torch.equal(got, ref))

    mask = _now(vocab_parallel, "_mask_padding")
    wrong = sum(not _guarded(lambda c=c: (same(mask(*c), want(*c)), ""))[0] for c in cases)
    return _summarise(
        [
            _guarded(lambda: _vs_dense(replace(bugzoo.GPT2, vocab_size=35), seed=4)),
            _guarded(lambda: _vs_dense(replace(bugzoo.GPT2, vocab_size=41), seed=5, b=2, s=7)),
            (wrong == 0, f"{wrong} of {len(cases)} shards wrong"),
        ]
    )


def _axis_groups_right(layout: mesh.Layout) -> bool:
    """Every axis's groups: each rank once, each group the ranks that differ only along the
    axis, ordered by it."""
    for axis, size in layout.sizes.items():
        groups = layout.axis_groups(axis)
        if sorted(r for g in groups for r in g) != list(range(layout.world)):
            return False
        for g in groups:
            coords = [layout.coords(r) for r in g]
            rest = [{a: v for a, v in c.items() if a != axis} for c in coords]
            if [c[axis] for c in coords] != list(range(size)) or any(x != rest[0] for x in rest):
                return False
    return True


def unseen_groups() -> tuple[bool, str]:
    """Case 4: tp 2 × dp 2 on other batches, and every axis of 54 (tp, cp, pp, dp) layouts."""
    layouts = [
        mesh.Layout(tp=tp, cp=cp, pp=pp, dp=dp)
        for tp in (1, 2, 3)
        for cp in (1, 2)
        for pp in (1, 2, 3)
        for dp in (1, 2, 4)
    ]
    wrong = sum(not _guarded(lambda x=x: (_axis_groups_right(x), ""))[0] for x in layouts)

    def other_batches() -> tuple[bool, str]:
        m = mesh.Mesh(mesh.Layout(tp=2, pp=1, dp=2))
        return _vs_dense(replace(bugzoo.GPT2, vocab_size=41), m.tp_group, seed=20 + m.dp_rank)

    return _summarise(
        [_guarded(other_batches), (wrong == 0, f"{wrong} of {len(layouts)} layouts wrong")]
    )


def unseen_gradients() -> tuple[bool, str]:
    """Case 5: a wider, deeper model and another batch shape, at tp 2."""
    wide = replace(bugzoo.GPT2, vocab_size=41, n_layers=3, hidden=24, n_heads=6)
    return _summarise(
        [
            _guarded(lambda: _vs_dense(wide, seed=9, b=2, s=7)),
            _guarded(lambda: _vs_dense(bugzoo.GPT2, seed=12, b=5, s=4)),
        ]
    )


def _greedy(vocab: int, rows: int, seed: int, ties: bool) -> tuple[bool, str]:
    g = torch.Generator().manual_seed(seed)
    t, r = dist.get_world_size(), dist.get_rank()
    full = torch.randn(rows, vocab, generator=g, dtype=torch.float64)
    if ties:  # the best value twice, in different shards: the lower id wins, as on one rank
        full[:, 1] = full[:, -1] = full.max() + 1
    n = -(-vocab // t)
    shard = torch.nn.functional.pad(full, (0, n * t - vocab))[:, r * n : (r + 1) * n]
    got = vocab_parallel.vocab_parallel_argmax(shard.to(device()), vocab).cpu()
    wrong = int((got != full.argmax(-1)).sum())
    return wrong == 0, f"{wrong} of {rows} tokens differ from tp=1's"


def unseen_tokens() -> tuple[bool, str]:
    """Case 6: greedy tokens of vocabularies 40, 35 and 41 (ties across shards), other rows."""
    return _summarise(
        [
            _guarded(lambda: _greedy(40, 9, 11, False)),
            _guarded(lambda: _greedy(35, 12, 12, False)),
            _guarded(lambda: _greedy(41, 5, 13, True)),
        ]
    )
