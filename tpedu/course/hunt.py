"""Lesson 16: the blind bug hunt: mystery cases, each one bug of the zoo applied without its name.

A case shows what a practitioner would see (a loss curve next to tp=1's, the bad rows of the
gradient table, tokens per rank, a hang turned into a timeout) and the zoo check that fails.
The learner reads tpedu's code, finds which function must be wrong, and writes it fixed in
exercises/l16_bug_hunt.py; `mystery(k, fix=module)` then runs the same check with the learner's
function in place of the broken one:

    print(mystery(1))              # the symptom and the failing check (launches the ranks)
    print(mystery(1, fix=m))       # m = pick("l16_bug_hunt"): the check again, with the fix

`mystery` launches its ranks itself; `run_case` is the worker body (for tests that launch).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import ModuleType

import torch
import torch.distributed as dist

from tpedu.comm.device import device
from tpedu.course import bugzoo, grading
from tpedu.course.claims import within
from tpedu.course.troubleshoot import TOLERANCE, compare_with_dense
from tpedu.launcher import launch
from tpedu.model.dense import DenseGPT
from tpedu.model.gpt import TPGPT
from tpedu.parallel import mesh
from tpedu.parallel.pipeline import schedules
from tpedu.tp import attention, vocab_parallel
from tpedu.tp import operators as tp_ops


@dataclass(frozen=True)
class Case:
    """One mystery: the zoo bug behind it and the exercise function that fixes it (neither is
    printed), how to put that function into tpedu, and what to show."""

    bug: str
    function: str
    substitute: Callable[[Callable], contextlib.AbstractContextManager]
    observe: Callable[[], str]  # on every rank under the bug: what rank 0's text shows
    story: str  # printed: the run that went wrong
    read: str  # printed: the files to read


# ------------------------------------------------------------------------------ observations


def _curves(config: object, group: object = None, steps: int = 5) -> tuple[list, list]:
    """Loss of `steps` AdamW steps of DenseGPT and of TPGPT (same init, same batches), float64."""
    torch.manual_seed(0)
    dense = DenseGPT(config).double()
    tp = TPGPT(dense, group).double().to(device())
    dense.to(device())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (dense, tp)]
    out: tuple[list, list] = ([], [])
    for step in range(steps):
        ids, tgt = (x.to(device()) for x in bugzoo.example_batch(config, seed=step))
        for m, opt, losses in zip((dense, tp), opts, out, strict=True):
            opt.zero_grad()
            loss = m(ids, tgt)
            loss.backward()
            if m is tp:
                m.sync_grads()
            opt.step()
            losses.append(loss.item())
    return out


def _curve_text(config: object, group: object = None, label: str = "") -> str:
    """The two loss curves, to four decimals: past them, five AdamW steps already carry the CPU
    kernels' rounding (a bug moves the loss in the third)."""
    dense, tp = _curves(config, group)
    rows = [(f"loss per step{label}", [f"{s:>9}" for s in range(len(dense))])]
    rows.append(("  tp=1 (dense)", [f"{v:9.4f}" for v in dense]))
    rows.append((f"  tp={dist.get_world_size(group)}", [f"{v:9.4f}" for v in tp]))
    return "\n".join(f"{a:<30}" + " ".join(b) for a, b in rows)


def _bad_rows(config: object, group: object = None) -> str:
    ids, tgt = bugzoo.example_batch(config)
    cmp = compare_with_dense(config, group, ids, tgt)
    return "compare_with_dense, rows above the tolerance only:\n" + cmp.table(only_bad=True)


def _see_gradients() -> str:
    return _curve_text(bugzoo.GPT2) + "\n\n" + _bad_rows(bugzoo.GPT2)


def _see_loss() -> str:
    ids, tgt = bugzoo.example_batch(bugzoo.GPT2)
    other = replace(bugzoo.GPT2, vocab_size=38)
    cmp = compare_with_dense(other, None, *bugzoo.example_batch(other))
    first = compare_with_dense(bugzoo.GPT2, None, ids, tgt)
    return (
        _curve_text(bugzoo.GPT2, label=" (vocabulary 37)")
        + f"\n  at step 0: {first.summary()}"
        + f"\nthe same model with vocabulary 38: {cmp.summary()}"
    )


def _see_tokens() -> str:
    ids, tgt = bugzoo.example_batch(bugzoo.GPT2)
    train = compare_with_dense(bugzoo.GPT2, None, ids, tgt)
    g = torch.Generator().manual_seed(5)  # the logits of bugzoo.check_argmax
    v, t, r = 37, dist.get_world_size(), dist.get_rank()
    n = -(-v // t)
    full = torch.randn(16, v, generator=g, dtype=torch.float64).to(device())
    padded = torch.nn.functional.pad(full, (0, n * t - v))
    got = vocab_parallel.vocab_parallel_argmax(padded[:, r * n : (r + 1) * n], v)
    mine = _per_rank(got)
    lines = [
        f"training step vs tp=1: {train.summary()}",
        "greedy next token of 16 rows, from the same logits:",
        "  tp=1 (dense) " + " ".join(f"{int(i):>2}" for i in full.argmax(-1)),
    ]
    lines += [f"  tp={t} rank {q}  " + " ".join(f"{int(i):>2}" for i in row) for q, row in mine]
    return "\n".join(lines)


def _per_rank(x: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(rank, x of that rank) for every rank: an all-gather, to print every rank's view."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return list(enumerate(parts))


def _see_gqa() -> str:
    world, rank = dist.get_world_size(), dist.get_rank()
    pairs = [dist.new_group([i, i + 1]) for i in range(0, world, 2)]
    small = compare_with_dense(bugzoo.LLAMA, pairs[rank // 2], *bugzoo.example_batch(bugzoo.LLAMA))
    return (
        f"GQA model, {bugzoo.LLAMA.n_heads} query heads, {bugzoo.LLAMA.n_kv_heads} KV heads\n"
        + _curve_text(bugzoo.LLAMA)
        + f"\nthe same model at tp=2: {small.summary()}"
    )


def _see_mesh() -> str:
    rank = dist.get_rank()
    wide = mesh.Mesh(mesh.Layout(tp=dist.get_world_size()))  # tp 4 × dp 1
    dense = DenseGPT(bugzoo.GPT2)
    tp = TPGPT(dense, wide.tp_group)
    count = [sum(p.numel() for p in m.parameters()) for m in (dense, tp)]
    m = mesh.Mesh(mesh.Layout(tp=2, pp=1, dp=2))
    cmp = compare_with_dense(
        bugzoo.GPT2, m.tp_group, *bugzoo.example_batch(bugzoo.GPT2, 1 + m.dp_rank)
    )
    line = (
        f"rank {rank}: tp 4 × dp 1 keeps {count[1]} of the dense model's {count[0]} parameters;"
        f" tp 2 × dp 2 (data replica {m.dp_rank}): loss dense {cmp.loss_dense:.6f}, tp "
        f"{cmp.loss_tp:.6f} (rel diff {within(cmp.loss_diff, TOLERANCE)})"
    )
    lines: list = [None] * dist.get_world_size()
    dist.all_gather_object(lines, line)  # every rank's view, printed once
    return "\n".join(lines)


def _nothing() -> str:
    return ""


# ------------------------------------------------------------------------------ the cases


_local_heads = attention.local_heads  # the original: the case patches attention.local_heads
_axis_groups = mesh.Layout.axis_groups  # ... and this one Layout.axis_groups (TP only)


def _kv_from(fix: Callable) -> Callable:
    def local_heads(n_heads: int, n_kv_heads: int, tp: int, rank: int) -> tuple[list, list]:
        q, _ = _local_heads(n_heads, n_kv_heads, tp, rank)
        return q, list(fix(n_heads, n_kv_heads, tp, rank))

    return local_heads


def _groups_from(fix: Callable) -> Callable:
    def axis_groups(self: mesh.Layout, axis: str) -> list[list[int]]:
        if axis != "tp":
            return _axis_groups(self, axis)
        return fix(self.world, self.tp, self.pp)

    return axis_groups


TP_FILES = "tpedu/tp/operators.py, tpedu/tp/layers.py, tpedu/tp/vocab_parallel.py"

# A fixed order, not the zoo's, so that a case's number says nothing about its bug.
CASES: list[Case] = [
    Case(
        "kv_wrong_replica",
        "kv_heads_of_rank",
        lambda fix: bugzoo.patched(attention, "local_heads", _kv_from(fix)),
        _see_gqa,
        "A grouped-query Llama-like model is moved from tp=2 to tp=4 (more ranks than KV heads).",
        "tpedu/tp/attention.py (how a rank picks its heads and its rows of the fused QKV weight)",
    ),
    Case(
        "pipeline_warmup_reversed",
        "one_f_one_b",
        lambda fix: bugzoo.patched(schedules, "one_f_one_b", fix),
        _nothing,
        "A 2-stage pipeline run with 2 micro-batches starts and never finishes its first step.",
        "tpedu/parallel/pipeline/ (the schedules and run_schedule)",
    ),
    Case(
        "padded_vocab_unmasked",
        "mask_padding",
        lambda fix: bugzoo.patched(vocab_parallel, "_mask_padding", fix),
        _see_loss,
        "A small GPT with an odd vocabulary (37 tokens) trains at tp=2 next to tp=1.",
        TP_FILES,
    ),
    Case(
        "seed_tp_groups",
        "tp_groups",
        lambda fix: bugzoo.patched(mesh.Layout, "axis_groups", _groups_from(fix)),
        _see_mesh,
        "The same 4 ranks are laid out as tp 4 × dp 1, then as tp 2 × dp 2 with two batches.",
        "tpedu/parallel/mesh.py (the layout and its process groups)",
    ),
    Case(
        "no_backward_all_reduce",
        "copy_to_tp_region",
        lambda fix: bugzoo.patched(tp_ops.CopyToTPRegion, "apply", staticmethod(fix)),
        _see_gradients,
        "A small GPT trains at tp=2 next to tp=1 on the same batches.",
        TP_FILES,
    ),
    Case(
        "argmax_one_shard",
        "vocab_parallel_argmax",
        lambda fix: bugzoo.patched(vocab_parallel, "vocab_parallel_argmax", fix),
        _see_tokens,
        "A tp=2 model that trains exactly like tp=1 generates different text on each rank.",
        "tpedu/tp/vocab_parallel.py, tpedu/model/generate.py",
    ),
]


def _case(k: int) -> Case:
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= len(CASES):
        raise ValueError(f"there are mystery cases 1 to {len(CASES)}, got {k!r}")
    return CASES[k - 1]


def world(k: int) -> int:
    """How many ranks case k runs on."""
    return bugzoo.BUGS[_case(k).bug].world


def run_case(
    k: int, fix: str | ModuleType | None = None, show: bool = True
) -> tuple[str, bool, str]:
    """Worker body: (what this rank shows, check ok, check detail) for case k under its bug, or
    with `fix` (a module or its name) supplying the function in place of the broken one.
    `show=False` runs the check only (the text is then empty)."""
    case = _case(k)
    if fix is None:
        ctx = bugzoo.broken(case.bug)
    else:
        module = importlib.import_module(fix) if isinstance(fix, str) else fix
        ctx = case.substitute(getattr(module, case.function))
    with ctx:
        shown = case.observe() if show and fix is None else ""
        ok, detail = bugzoo.BUGS[case.bug].check()
    return shown, ok, detail


@dataclass
class Report:
    """What `mystery` found: `ok` is the check's verdict on every rank; print it for the text."""

    text: str
    ok: bool

    def __str__(self) -> str:
        return self.text


def report(k: int, per_rank: list[tuple[str, bool, str]], fixed: bool, by: str = "yours") -> Report:
    """The text of case k from every rank's `run_case` result (rank 0's view of the symptom);
    with `fixed`, `by` says whose function ran in place of the broken one: "yours" or
    "reference" (pick put the reference's in, as yours still raises NotImplementedError)."""
    check = bugzoo.BUGS[_case(k).bug].check
    ok = all(r[1] for r in per_rank)
    verdicts = [
        f"  rank {q}: {'passes' if o else 'FAILS '}  {d}" for q, (_, o, d) in enumerate(per_rank)
    ]
    doc = (check.__doc__ or "").strip().splitlines()[0].rstrip(".")
    head = f"The check bugzoo.{check.__name__} ({doc})"
    if fixed:
        title = "passes on every rank. Case closed." if ok else "still fails."
        fix = "your fix" if by == "yours" else "the reference's fix"
        return Report(f"Case {k} with {fix}. {head} {title}\n" + "\n".join(verdicts), ok)
    text = [f"Case {k} ({world(k)} ranks). {_case(k).story}", ""]
    text += [per_rank[0][0], ""] if per_rank[0][0] else []
    text += [f"{head} fails:" if not ok else f"{head}:", *verdicts, "", f"Read: {_case(k).read}"]
    return Report("\n".join(text), ok)


def mystery(k: int, fix: ModuleType | None = None, timeout: float = 120) -> Report:
    """Launch case k on its ranks: the symptom and the failing check; with `fix` (a module,
    e.g. pick("l16_bug_hunt")) whether the check passes with that module's function."""
    name = fix.__name__ if fix is not None else None
    per_rank = launch(run_case, world(k), k, name, timeout=timeout)
    by = grading.whose(fix, _case(k).function) if fix is not None else "yours"
    return report(k, per_rank, fix is not None, by)
