"""Lesson 18: the capstone's budget, the tools that measure a layout against it, and its grader.

The capstone (notebooks/18_capstone.ipynb) is a design task. A model pretrained on 红楼梦 moves
to a machine of `BUDGET.ranks` ranks, each with `BUDGET.bytes_per_rank` of memory, where no rank
may push more than `BUDGET.sent_per_rank` through collectives in one training step. Several
layouts fit; they trade memory headroom against communication and step time. The learner
measures them (`measure`: the dry run; `step_seconds`: a timed step on CPU ranks), chooses one,
says why, continues training under it with sharded checkpoints, reshards one to another
layout, resumes there, and serves the result. Every step writes into one work directory:

    choice.json     {"parallel": the chosen ParallelConfig (`to_dict()`), "why": the reason,
                    with the figures it rests on} (`write_choice`)
    ckpt/           the continued run's sharded checkpoints under that layout (a step before
                    the end, and the end)
    train.json      that run's summary (its "losses": one per step it ran)
    resharded/      one of ckpt's steps before the end, resharded to another layout (e.g. tp 1)
    resumed/        the run resumed from resharded/ on its layout: its checkpoint at the end
    resumed.json    that run's summary
    generated.json  {"prompt": ids, "max_new_tokens": n, "sampling": stream's settings,
                    "ids": {"<tp>": prompt + new ids, ...}, "text": the continuation}, served
                    with the KV cache from resumed/ at tp 1 and at the chosen layout's tp

`check_capstone(workdir)` reads these files, never the code that made them, and re-derives
what it can: the layout's bytes by its own dry run, the served ids by generating them again
from resumed/ with the recorded settings (so a generated.json written by hand fails). It
returns one `Check` per claim, each printing as a one-line verdict.
"""

from __future__ import annotations

import json
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from tpedu import checkpoint
from tpedu.analysis import dryrun
from tpedu.comm.device import device
from tpedu.data import tokenizer
from tpedu.launcher import launch
from tpedu.model.config import GPTConfig
from tpedu.model.dense import DenseGPT
from tpedu.model.gpt import TPGPT
from tpedu.parallel.config import ParallelConfig
from tpedu.parallel.mesh import Mesh
from tpedu.serve.generate import generate_batch
from tpedu.train.config import TrainConfig
from tpedu.train.step import build_step, stage_chunks

MB = 10**6
# How the capstone serves: sampled, not greedy. Greedy decoding of a model this small loops
# ("我们不知道，我们不知道，..."); a low temperature and the 10 likeliest characters keep
# the novel's phrasing without the loop. The seed makes it one fixed continuation.
SAMPLING = {"temperature": 0.6, "top_k": 10, "seed": 0}
# float32 resumed on another layout: the same arithmetic with the sums in another order (TP
# all-reduces, pipeline micro-batches), ~1e-7 relative per step; a wrong step, learning rate
# or optimizer state is off by 1e-3 or more
LOSS_RTOL = 1e-5


@dataclass(frozen=True)
class Budget:
    """What the capstone may use: `ranks` ranks, each holding at most `bytes_per_rank` of
    weights, gradients, AdamW states, activations saved for backward and gathered parameters,
    and sending at most `sent_per_rank` through collectives (the tracer's bytes: each call's
    tensor) during one training step of `batch` sequences, for a GPT-2-like model of this
    shape on the novel's characters."""

    ranks: int = 4
    bytes_per_rank: int = 25 * MB
    sent_per_rank: int = 20 * MB
    n_layers: int = 4
    hidden: int = 128
    n_heads: int = 4
    seq_len: int = 128
    batch: int = 16

    def model(self, vocab_size: int) -> GPTConfig:
        """The budget's model for a tokenizer of `vocab_size` tokens."""
        return GPTConfig.gpt2_like(
            vocab_size,
            seq_len=self.seq_len,
            n_layers=self.n_layers,
            hidden=self.hidden,
            n_heads=self.n_heads,
        )


BUDGET = Budget()


@dataclass(frozen=True)
class Check:
    """One claim about the artefacts and whether it holds; prints as a one-line verdict."""

    name: str
    ok: bool
    detail: str

    def __str__(self) -> str:
        return f"{'✓' if self.ok else '✗'} {self.name}: {self.detail}"


def describe(parallel: ParallelConfig) -> str:
    """A layout in a few words: tp, pp, dp, and the fields that differ from the defaults."""
    base = ParallelConfig()
    extra = [
        f"{k}={v}"
        for k, v in parallel.to_dict().items()
        if k not in ("tp", "pp", "dp") and v != getattr(base, k)
    ]
    return " ".join([f"tp={parallel.tp} pp={parallel.pp} dp={parallel.dp}", *extra])


# ------------------------------------------------------------------------------ the tools


@dataclass(frozen=True)
class Candidate:
    """A layout and what the dry run measures of one training step on its fullest ranks:
    `peak` bytes held (weights, gradients, AdamW, saved activations, gathered parameters) and
    `sent` bytes through collectives (TP, pipeline sends, DP or ZeRO, the loss)."""

    parallel: ParallelConfig
    peak: int
    sent: int

    def fits(self, budget: Budget = BUDGET) -> bool:
        """Whether both the memory and the communication bound hold."""
        return self.peak <= budget.bytes_per_rank and self.sent <= budget.sent_per_rank

    def __str__(self) -> str:
        return f"{describe(self.parallel):<46} {self.peak / MB:6.2f} MB held {self.sent / MB:6.2f} MB sent"


def measure(config: GPTConfig, parallel: ParallelConfig, budget: Budget = BUDGET) -> Candidate:
    """The dry run of one training step of `budget.batch` sequences on every rank of
    `parallel` (on the meta device: nothing is computed, every byte is counted): the fullest
    rank's bytes held and the most bytes a rank sends. A layout that cannot run the model at
    all (e.g. tp not dividing the heads, more stages than layers) raises its ValueError."""
    if parallel.world != budget.ranks:
        raise ValueError(
            f"{describe(parallel)} uses {parallel.world} ranks; the budget has "
            f"{budget.ranks}: make tp·cp·pp·dp = {budget.ranks}"
        )
    runs = dryrun.dry_run(config, parallel, budget.batch, list(range(parallel.world)))
    held = [
        f.weights + f.gradients + f.optimizer + f.activations + f.peak_gathered
        for f in (r.figures for r in runs)
    ]
    groups = {k: len(g[0]) if g else 1 for k, g in parallel.layout.groups().items()}
    groups["world"] = parallel.world
    sent = [  # a group of one rank moves nothing, though the tracer records its calls
        sum(t.bytes for t in r.figures.traffic if groups.get(t.group, parallel.world) > 1)
        for r in runs
    ]
    return Candidate(parallel, max(held), max(sent))


def fits(config: GPTConfig, parallel: ParallelConfig, budget: Budget = BUDGET) -> bool:
    """Whether `parallel` runs `config` within both bounds of `budget` (the dry run says)."""
    return measure(config, parallel, budget).fits(budget)


def _timed_steps(
    config: GPTConfig, parallel: ParallelConfig, cfg: TrainConfig, ids: torch.Tensor, steps: int
) -> float:
    """On every rank: build the training step as train does, run steps + 1 of them (the first
    warms up) and return the median of the slowest rank's wall times."""
    mesh = Mesh(parallel.layout)
    step = build_step(stage_chunks(config, parallel, mesh, cfg.seed), mesh, parallel, cfg)
    times = []
    for k in range(steps + 1):
        xs, ys = step.batch(ids, k, cfg.seed)
        dist.barrier()
        t = time.perf_counter()
        step(xs, ys, k)
        slowest = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
        times.append(slowest.item())
    return statistics.median(times[1:])


def step_seconds(
    config: GPTConfig,
    parallel: ParallelConfig,
    train_ids: torch.Tensor,
    budget: Budget = BUDGET,
    steps: int = 3,
) -> float:
    """Seconds per training step of `parallel` measured on real ranks here (CPU ranks: one
    thread each; the median of `steps` after a warm-up, the slowest rank's). What it says
    depends on this machine and its load: compare layouts in one sitting."""
    cfg = TrainConfig(steps=steps + 1, batch=budget.batch, warmup=1, eval_every=0, progress=False)
    return launch(_timed_steps, parallel.world, config, parallel, cfg, train_ids, steps)[0]


def write_choice(workdir: str | Path, parallel: ParallelConfig, why: str) -> Path:
    """choice.json in `workdir`: the layout and the reason for it."""
    path = Path(workdir) / "choice.json"
    path.write_text(json.dumps({"parallel": parallel.to_dict(), "why": why}, ensure_ascii=False))
    return path


def _serve(config: GPTConfig, path: str, prompt: list[int], new: int, sampling: dict) -> list:
    model = TPGPT(DenseGPT(config)).to(device())  # this rank's shards, overwritten by load
    checkpoint.load(path, model)  # any saved layout -> this rank's shards
    return generate_batch(model.eval(), [prompt], new, **sampling)[0]


def serve(path: str | Path, prompt: list[int], new: int, tp: int = 1, **sampling: object) -> list:
    """prompt + `new` tokens generated with the KV cache by `tp` ranks, each loading its shards
    of the checkpoint `path`; `sampling`: stream's (greedy, temperature, top_k, seed)."""
    config = checkpoint.read_config(path)
    return launch(_serve, tp, config, str(path), list(prompt), new, dict(sampling))[0]


# ------------------------------------------------------------------------------ the checks


def _read_json(path: Path) -> dict:
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing")
    return json.loads(path.read_text())


def _choice(work: Path) -> ParallelConfig:
    return ParallelConfig.from_dict(_read_json(work / "choice.json")["parallel"])


def _check_fit(work: Path, budget: Budget) -> str:
    choice, config = _choice(work), checkpoint.read_config(work / "ckpt")
    want = budget.model(config.vocab_size)
    if config != want:
        diff = [k for k, v in want.to_dict().items() if config.to_dict().get(k) != v]
        raise ValueError(f"the checkpoint's model differs from the budget's in {diff}")
    c = measure(config, choice, budget)
    held = "≤" if c.peak <= budget.bytes_per_rank else "exceeds"
    sent = "≤" if c.sent <= budget.sent_per_rank else "exceeds"
    detail = (
        f"{describe(choice)}: fullest rank {c.peak / MB:.2f} MB {held} "
        f"{budget.bytes_per_rank / MB:.2f} MB, {c.sent / MB:.2f} MB sent {sent} "
        f"{budget.sent_per_rank / MB:.2f} MB (dry run, {budget.ranks} ranks)"
    )
    if not c.fits(budget):
        raise ValueError(detail)
    return detail


# a figure the reason rests on: a number with its unit (memory, traffic, time, a share)
FIGURE = re.compile(r"\d+(?:[.,]\d+)?\s*(?:[kKMG]i?B|ms|µs|s|%|×|x)(?![A-Za-z])")


def _named(why: str, name: str, value: object) -> bool:
    """Whether `why` names the field `name` with this value ("tp=2", "tp 2", "TP 2", "tp2")."""
    return re.search(rf"\b{name}\s*[=:]?\s*{value}\b", why, re.IGNORECASE) is not None


def check_why(why: object, parallel: ParallelConfig) -> str:
    """A reason that names the layout (every axis over 1 with its size, none with another;
    the ZeRO stage and sequence parallelism if on) and cites at least one figure with its unit
    (MB, ms, %, ...). Returns a one-line verdict; raises a ValueError saying what is missing."""
    if not isinstance(why, str) or not why.strip():
        raise ValueError("choice.json has no reason: say why this layout (the figures you used)")
    axes = [(a, n) for a, n in parallel.layout.sizes.items() if n > 1]
    missing = [f"{a}={n}" for a, n in axes if not _named(why, a, n)]
    if parallel.zero and not _named(why, "zero-?", parallel.zero):
        missing.append(f"zero={parallel.zero}")
    if parallel.sequence_parallel and not re.search(r"sequence.parallel|\bsp\b", why, re.I):
        missing.append("sequence parallelism")
    if missing:
        raise ValueError(f"the reason does not name the chosen layout: no {', '.join(missing)}")
    if not FIGURE.search(why):
        raise ValueError("the reason cites no figure (e.g. '18.4 MB', '12.7 MB sent', '210 ms')")
    return f"names {describe(parallel)} and cites figures with their units"


def _check_why(work: Path) -> str:
    return check_why(_read_json(work / "choice.json").get("why"), _choice(work))


def _steps(root: Path) -> list[Path]:
    return sorted(p.parent for p in root.glob(f"step_*/{checkpoint.INDEX}"))


def _check_checkpoint(work: Path) -> str:
    choice = _choice(work)
    steps = _steps(work / "ckpt")
    if len(steps) < 2:
        raise ValueError(
            f"{work / 'ckpt'} has {len(steps)} step(s); save one before the end too (save_every)"
        )
    files = 0
    for step in steps:
        _, index = checkpoint.check_files(step, verify=True)
        files += len(index["files"])
        saved = checkpoint.read_parallel(step)
        if saved != choice:
            raise ValueError(
                f"{step.name} records {describe(saved)}, the choice is {describe(choice)}"
            )
    latest = checkpoint.resolve(work / "ckpt").name
    return f"{len(steps)} steps ({latest} latest), {files} shard files, SHA-256 verified, layout = the choice"


def _check_reshard(work: Path) -> str:
    choice = _choice(work)
    step_dir, index = checkpoint.check_files(work / "resharded", verify=True)
    new = checkpoint.read_parallel(step_dir)
    if new.layout == choice.layout:
        raise ValueError(f"resharded/ has the chosen layout {describe(new)}; reshard to another")
    original = work / "ckpt" / checkpoint.step_name(index["step"])
    _, a, _ = checkpoint.read_dense(original)
    _, b, _ = checkpoint.read_dense(step_dir)
    if sorted(a) != sorted(b):
        raise ValueError(f"resharded/ holds other tensors than {original.name}")
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    if differ:
        raise ValueError(
            f"{len(differ)} dense tensors differ from {original.name}, e.g. {differ[0]}"
        )
    return (
        f"step {index['step']}: {describe(choice)} -> {describe(new)}, "
        f"{len(a)} dense tensors (weights + AdamW) identical"
    )


def _check_resume(work: Path) -> str:
    choice, new = _choice(work), checkpoint.read_parallel(work / "resharded")
    start = checkpoint.read_index(work / "resharded")[1]["step"]
    train, resumed = _read_json(work / "train.json"), _read_json(work / "resumed.json")
    ran = ParallelConfig.from_dict(train["settings"]["parallel"])
    if ran != choice:
        raise ValueError(f"train.json ran {describe(ran)}, the choice is {describe(choice)}")
    there = ParallelConfig.from_dict(resumed["settings"]["parallel"])
    if there.layout != new.layout:
        raise ValueError(f"resumed.json ran {describe(there)}, resharded/ is {describe(new)}")
    # train.json ran steps first .. steps-1 (first > 0: it continued a checkpoint itself)
    first = train["settings"]["train"]["steps"] - len(train["losses"])
    got = resumed["losses"]
    want = train["losses"][start - first : start - first + len(got)] if start >= first else []
    if not got or len(got) != len(want):
        raise ValueError(
            f"resumed.json has {len(got)} losses from step {start}; train.json ran steps "
            f"{first}..{first + len(train['losses']) - 1}: resume from a step it saved before "
            "the end"
        )
    end = checkpoint.read_index(work / "resumed")[1]["step"]
    if end != start + len(got):
        raise ValueError(f"resumed/ is at step {end}, expected {start + len(got)}")
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))
    steps = f"steps {start}..{start + len(got) - 1} on {describe(there)}"
    if not worst <= LOSS_RTOL:
        raise ValueError(
            f"{steps}: loss {got[0]:.5f} vs {want[0]:.5f}, worst relative difference "
            f"{worst:.1e} > {LOSS_RTOL:.0e}"
        )
    return f"{steps}: every loss equals the straight run's, relative difference ≤ {LOSS_RTOL:.0e}"


def _check_generation(work: Path) -> str:
    """generated.json's ids are generated again here, from resumed/, at tp 1 and the chosen
    tp, with its recorded settings; the stored ids and text must be what that gives."""
    choice, gen = _choice(work), _read_json(work / "generated.json")
    prompt, new, ids = gen["prompt"], gen["max_new_tokens"], gen["ids"]
    sampling = dict(gen.get("sampling") or {"greedy": True})
    need = sorted({"1", str(choice.tp)})
    if not isinstance(new, int) or new < 1:
        raise ValueError(f"generated.json asks for {new!r} new tokens: serve at least one")
    if sorted(ids) != need:
        raise ValueError(f"generated.json has ids for tp {sorted(ids)}; expected tp {need}")
    for tp, seq in ids.items():
        if seq[: len(prompt)] != prompt or len(seq) != len(prompt) + new:
            raise ValueError(
                f"tp {tp}: {len(seq)} ids, expected the prompt's {len(prompt)} + {new} new"
            )
    served = work / "resumed"
    again = {tp: serve(served, prompt, new, int(tp), **sampling) for tp in need}
    if len({tuple(seq) for seq in again.values()}) != 1:
        raise ValueError(f"resumed/ serves other ids at tp {' and tp '.join(need)}")
    wrong = [tp for tp in need if ids[tp] != again[tp]]
    if wrong:
        k = next(
            i for i, (a, b) in enumerate(zip(ids[wrong[0]], again[wrong[0]], strict=True)) if a != b
        )
        raise ValueError(
            f"generated.json's ids at tp {wrong[0]} are not what resumed/ generates: they "
            f"differ from new token {k - len(prompt)} on"
        )
    step_dir = checkpoint.resolve(served)
    tok = tokenizer.load(step_dir / "tokenizer.json")
    if gen.get("text") != tok.decode(again["1"][len(prompt) :]):
        raise ValueError("generated.json's text is not the decoding of its ids")
    if sampling.get("greedy") or sampling.get("temperature") == 0:
        how = "greedy"
    else:
        how = ", ".join(f"{k} {v}" for k, v in sorted(sampling.items()))
    return (
        f"{new} new tokens ({how}) generated again from {step_dir.name} at tp "
        f"{' and '.join(need)}: the same ids and text as generated.json"
    )


CHECKS = (
    ("the layout fits the budget", _check_fit),
    ("the choice says why", _check_why),
    ("the checkpoint validates", _check_checkpoint),
    ("the reshard keeps every tensor", _check_reshard),
    ("the resumed run continues the loss", _check_resume),
    ("the served text is the checkpoint's", _check_generation),
)


def check_capstone(workdir: str | Path, budget: Budget = BUDGET) -> list[Check]:
    """One Check per claim about the artefacts in `workdir` (see the module docstring); a
    missing or damaged file fails its check with the reason, never raises."""
    work, out = Path(workdir), []
    for name, check in CHECKS:
        try:
            out.append(
                Check(name, True, check(work, budget) if check is _check_fit else check(work))
            )
        except (ValueError, FileNotFoundError, KeyError, TypeError, IndexError) as e:
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            if isinstance(e, KeyError):
                reason = f"missing field {e}"
            out.append(Check(name, False, reason))
    return out


def passed(checks: list[Check]) -> bool:
    """Whether every check holds."""
    return bool(checks) and all(c.ok for c in checks)
