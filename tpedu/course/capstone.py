"""Lesson 20: the capstone's budget, the tools that measure a layout against it, and its grader.

The capstone (notebooks/20_capstone.ipynb) is a design task. A model pretrained on 红楼梦 moves
to a machine of `BUDGET.ranks` ranks, each with `BUDGET.bytes_per_rank` of memory, where no rank
may put more than `BUDGET.sent_per_rank` on the wire in one training step (what the ring
algorithms send: tpedu.comm.volumes). Several layouts fit; they trade memory headroom against
communication and step time. The learner measures them (`measure`: the dry run;
`step_seconds`: a timed step on CPU ranks), chooses one, says why, continues training under it
with sharded checkpoints, reshards one to another layout, resumes there, and serves the
result. Every step writes into one work directory:

    choice.json     {"parallel": the chosen ParallelConfig (`to_dict()`), "why": the reason,
                    with the figures it rests on, "seconds": the step times `choose` was
                    given} (`write_choice`)
    ckpt/           the continued run's sharded checkpoints under that layout (a step before
                    the end, and the end)
    train.json      that run's summary (its "losses": one per step it ran)
    resharded/      one of ckpt's steps before the end, resharded to another layout (e.g. tp 1)
    resumed/        the run resumed from resharded/ on its layout: its checkpoint at the end
    resumed.json    that run's summary
    generated.json  {"prompt": ids, "max_new_tokens": n, "sampling": asdict(`SAMPLING`), "ids":
                    {"<tp>": prompt + new ids, ...}, "text": the continuation}, served with the
                    KV cache from resumed/ at tp 1 and at the chosen layout's tp

`check_capstone(workdir)` reads these files, never the code that made them, and re-derives
what it can instead of trusting them: the layout's bytes by its own dry run (and the reason's
figures against it), the resumed run by running it again from resharded/ at its recorded
layout (its losses, and resumed/'s tensors, bit for bit), the served ids by generating them
again from resumed/ with the recorded settings (so a generated.json written by hand fails).
Given the learner's exercise module, it also asks its `survey` and `choose` again: the choice
must be what they return, and code from solutions/ is the reference's. It returns one `Check`
per claim, each printing as a one-line verdict.
"""

from __future__ import annotations

import json
import re
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed as dist

from tpedu import checkpoint
from tpedu.analysis import dryrun
from tpedu.course.capstone_rerun import from_solutions, resume_again, serve, without_solutions
from tpedu.data import tokenizer
from tpedu.launcher import launch
from tpedu.model.config import GPTConfig
from tpedu.parallel.config import ParallelConfig
from tpedu.parallel.mesh import Mesh
from tpedu.serve.generate import Sampling
from tpedu.train.config import TrainConfig
from tpedu.train.step import build_step, stage_chunks

MB = 10**6
# How the capstone serves: sampled, not greedy. Greedy decoding of a model this small loops
# ("我们不知道，我们不知道，..."); a low temperature and the 10 likeliest characters keep
# the novel's phrasing without the loop. The seed makes it one fixed continuation.
SAMPLING = Sampling(temperature=0.6, top_k=10, seed=0)
# float32 resumed on another layout: the same arithmetic with the sums in another order (TP
# all-reduces, pipeline micro-batches), ~1e-7 relative per step; a wrong step, learning rate
# or optimizer state is off by 1e-3 or more
LOSS_RTOL = 1e-5
# A figure the reason cites for the chosen layout is the dry run's when within this share of
# it: "18.4 MB" for 18.43 MB, and "18 MB" too (rounded to a whole MB)
FIGURE_RTOL = 0.05


@dataclass(frozen=True)
class Budget:
    """What the capstone may use: `ranks` ranks, each holding at most `bytes_per_rank` of
    weights, gradients, AdamW states, activations saved for backward and gathered parameters,
    and putting at most `sent_per_rank` on the wire during one training step of `batch`
    sequences (what a rank sends under the ring algorithms: 2(t−1)/t·n for an all-reduce of n
    bytes on t ranks, (t−1)/t·n for an all-gather, a reduce-scatter or an all-to-all, a
    pipeline send as it is, a receive nothing), for a GPT-2-like model of this shape on the
    novel's characters."""

    ranks: int = 4
    bytes_per_rank: int = 23 * MB
    sent_per_rank: int = 13 * MB
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
    `sent` bytes put on the wire (TP, pipeline sends, DP or ZeRO, the loss; ring volumes)."""

    parallel: ParallelConfig
    peak: int
    sent: int

    def fits(self, budget: Budget = BUDGET) -> bool:
        """Whether both the memory and the communication bound hold."""
        return self.peak <= budget.bytes_per_rank and self.sent <= budget.sent_per_rank

    def __str__(self) -> str:
        return (
            f"{describe(self.parallel):<46} {self.peak / MB:6.2f} MB held "
            f"{self.sent / MB:6.2f} MB on the wire"
        )


def measure(config: GPTConfig, parallel: ParallelConfig, budget: Budget = BUDGET) -> Candidate:
    """The dry run of one training step of `budget.batch` sequences on every rank of
    `parallel` (on the meta device: nothing is computed, every byte is counted): the fullest
    rank's bytes held and the most bytes a rank puts on the wire (`RankFigures.wire`: the
    tracer's ring volumes, so a receive or a group of one rank sends nothing). A layout that
    cannot run the model at all (e.g. tp not dividing the heads, more stages than layers)
    raises its ValueError."""
    if parallel.world != budget.ranks:
        raise ValueError(
            f"{describe(parallel)} uses {parallel.world} ranks; the budget has "
            f"{budget.ranks}: make tp·cp·pp·dp = {budget.ranks}"
        )
    key = json.dumps([config.to_dict(), parallel.to_dict(), budget.batch], sort_keys=True)
    if key not in _MEASURED:
        runs = dryrun.dry_run(config, parallel, budget.batch, list(range(parallel.world)))
        held = [
            f.weights + f.gradients + f.optimizer + f.activations + f.peak_gathered
            for f in (r.figures for r in runs)
        ]
        _MEASURED[key] = (max(held), round(max(r.figures.wire() for r in runs)))
    return Candidate(parallel, *_MEASURED[key])


# measure's dry runs, by what they depend on: the survey, the grader and the tests ask about
# the same layouts again, and a dry run counts the same bytes every time (≈ 1 s each)
_MEASURED: dict[str, tuple[int, int]] = {}


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


def write_choice(
    workdir: str | Path,
    parallel: ParallelConfig,
    why: str,
    seconds: Mapping[str, float] | None = None,
) -> Path:
    """choice.json in `workdir`: the layout, the reason for it, and the measured step times
    `choose` was given (so that the grader can ask your `choose` again)."""
    path = Path(workdir) / "choice.json"
    data = {"parallel": parallel.to_dict(), "why": why, "seconds": dict(seconds or {})}
    path.write_text(json.dumps(data, ensure_ascii=False))
    return path


# ------------------------------------------------------------------------------ the checks


def _read_json(path: Path) -> dict:
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing")
    return json.loads(path.read_text())


def _choice(work: Path) -> ParallelConfig:
    return ParallelConfig.from_dict(_read_json(work / "choice.json")["parallel"])


def _measured(work: Path, budget: Budget) -> Candidate:
    """The grader's own dry run of the chosen layout, for the checkpoint's model (which must
    be the budget's)."""
    choice, config = _choice(work), checkpoint.read_config(work / "ckpt")
    want = budget.model(config.vocab_size)
    if config != want:
        diff = [k for k, v in want.to_dict().items() if config.to_dict().get(k) != v]
        raise ValueError(f"the checkpoint's model differs from the budget's in {diff}")
    return measure(config, choice, budget)


def _check_fit(work: Path, budget: Budget) -> str:
    c = _measured(work, budget)
    held = "≤" if c.peak <= budget.bytes_per_rank else "exceeds"
    sent = "≤" if c.sent <= budget.sent_per_rank else "exceeds"
    detail = (
        f"{describe(c.parallel)}: fullest rank {c.peak / MB:.2f} MB {held} "
        f"{budget.bytes_per_rank / MB:.2f} MB, {c.sent / MB:.2f} MB on the wire {sent} "
        f"{budget.sent_per_rank / MB:.2f} MB (dry run, {budget.ranks} ranks)"
    )
    if not c.fits(budget):
        raise ValueError(detail)
    return detail


# an axis and its size as a reason writes it: "tp=2", "tp 2", "TP 2", "tp2", "pp: 4"
AXIS = re.compile(r"\b(tp|cp|pp|dp)\s*[=:]?\s*(\d+)\b", re.IGNORECASE)
ZERO = re.compile(r"\bzero\s*[-=:]?\s*(\d+)\b", re.IGNORECASE)
# a memory or traffic figure: "18.43 MB", "18,4 MB", "0.02 GB", "11.6 MiB"
BYTES = re.compile(r"(\d+(?:[.,]\d+)?)\s*([kKMG])(i?)B\b")
_UNIT = {"k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9}


def _bytes(match: re.Match) -> float:
    value, unit, binary = match.groups()
    scale = 1024 ** " kMG".index(unit.replace("K", "k")) if binary else _UNIT[unit]
    return float(value.replace(",", ".")) * scale


def _named(why: str, name: str, value: object) -> bool:
    """Whether `why` names the field `name` with this value ("tp=2", "tp 2", "TP 2", "tp2")."""
    return re.search(rf"\b{name}\s*[=:]?\s*{value}\b", why, re.IGNORECASE) is not None


def check_why(why: object, measured: Candidate, budget: Budget = BUDGET) -> str:
    """A reason that names the chosen layout (`measured.parallel`: each axis over 1 with its
    size, the ZeRO stage and SP if on) first ("pp=4 ... tp=2 pp=2" names another first), and
    before naming another cites a figure of it in kB/MB/GB within 5 % of the grader's dry run
    (`measured`: held or on the wire), most of those figures being the dry run's, the
    budget's or the headroom (a list of guesses is no reason). Returns a one-line verdict;
    raises a ValueError saying what is wrong."""
    parallel = measured.parallel
    if not isinstance(why, str) or not why.strip():
        raise ValueError("choice.json has no reason: say why this layout (the figures you used)")
    sizes = dict(parallel.layout.sizes)
    missing = [f"{a}={n}" for a, n in sizes.items() if n > 1 and not _named(why, a, n)]
    if parallel.zero and not _named(why, "zero-?", parallel.zero):
        missing.append(f"zero={parallel.zero}")
    if parallel.sequence_parallel and not re.search(r"sequence.parallel|\bsp\b", why, re.I):
        missing.append("sequence parallelism")
    if missing:
        raise ValueError(f"the reason does not name the chosen layout: no {', '.join(missing)}")
    # where the reason first names something that is not the choice: another layout
    other = [
        (m.start(), m.group(0))
        for m in AXIS.finditer(why)
        if int(m.group(2)) != sizes.get(m.group(1).lower(), 1)
    ]
    if parallel.zero:
        other += [
            (m.start(), m.group(0)) for m in ZERO.finditer(why) if int(m.group(1)) != parallel.zero
        ]
    cut, first = min(other, default=(len(why), ""))
    unnamed = [a for a, n in sizes.items() if n > 1 and not _named(why[:cut], a, n)]
    if parallel.zero and not _named(why[:cut], "zero-?", parallel.zero):
        unnamed.append("zero")
    if unnamed:
        raise ValueError(
            f"the reason names {first!r} before it names {describe(parallel)}: name the chosen "
            "layout first, then the others you compared it with"
        )
    own = {"held": measured.peak, "on the wire": measured.sent}
    known = [
        *own.values(),
        budget.bytes_per_rank,
        budget.sent_per_rank,
        budget.bytes_per_rank - measured.peak,
        budget.sent_per_rank - measured.sent,
    ]
    near = lambda x, ref: abs(x - ref) <= FIGURE_RTOL * abs(ref)
    cited = [_bytes(m) for m in BYTES.finditer(why[:cut])]
    dry = ", ".join(f"{v / MB:.2f} MB {k}" for k, v in own.items())
    if not any(near(x, ref) for x in cited for ref in own.values()):
        shown = ", ".join(f"{x / MB:g} MB" for x in cited) or "none"
        raise ValueError(
            f"no figure the reason cites for {describe(parallel)} ({shown}) is within "
            f"{FIGURE_RTOL:.0%} of the dry run's: {dry}"
        )
    unknown = [x for x in cited if not any(near(x, ref) for ref in known)]
    if len(unknown) > len(cited) - len(unknown):
        raise ValueError(
            f"{len(unknown)} of the {len(cited)} figures the reason cites for "
            f"{describe(parallel)} are not its dry run's ({dry}), the budget's or the headroom "
            "to it: cite the figures you weighed, not a list"
        )
    return f"names {describe(parallel)} and cites its dry run's figures ({dry}, within {FIGURE_RTOL:.0%})"


def _check_why(work: Path, budget: Budget) -> str:
    return check_why(_read_json(work / "choice.json").get("why"), _measured(work, budget), budget)


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
    """The resumed run is run again by the grader from resharded/ at the layout resumed.json
    records, with train.json's settings (the same learning-rate schedule, batch and seed):
    its losses must continue train.json's (within LOSS_RTOL: another layout sums in another
    order), and resumed.json's losses and resumed/'s tensors must be what it gives, bit for
    bit (the same checkpoint, layout and steps: lesson 14's resume is exact)."""
    choice, new = _choice(work), checkpoint.read_parallel(work / "resharded")
    start = checkpoint.read_index(work / "resharded")[1]["step"]
    train_run, resumed = _read_json(work / "train.json"), _read_json(work / "resumed.json")
    ran = ParallelConfig.from_dict(train_run["settings"]["parallel"])
    if ran != choice:
        raise ValueError(f"train.json ran {describe(ran)}, the choice is {describe(choice)}")
    there = ParallelConfig.from_dict(resumed["settings"]["parallel"])
    if there.layout != new.layout:
        raise ValueError(f"resumed.json ran {describe(there)}, resharded/ is {describe(new)}")
    # train.json ran steps first .. steps-1 (first > 0: it continued a checkpoint itself)
    quiet = {"progress": False, "eval_every": 0, "save_every": 0}  # the same losses, bit for bit
    cfg = TrainConfig(**{**train_run["settings"]["train"], **quiet})
    first = cfg.steps - len(train_run["losses"])
    if not first <= start < cfg.steps:
        raise ValueError(
            f"resharded/ is step {start}; train.json ran steps {first}..{cfg.steps - 1}: "
            "reshard a step it saved before the end"
        )
    saved = checkpoint.read_parallel(work / "resumed")
    if saved.layout != there.layout:
        raise ValueError(f"resumed/ holds {describe(saved)}, resumed.json ran {describe(there)}")
    end = checkpoint.read_index(work / "resumed")[1]["step"]
    if end != cfg.steps:
        raise ValueError(f"resumed/ is at step {end}, train.json ran to step {cfg.steps}")
    losses, dense = resume_again(work / "resharded", cfg, there)
    steps = f"steps {start}..{cfg.steps - 1} on {describe(there)}"
    want = train_run["losses"][start - first :]
    worst = max(abs(g - w) / abs(w) for g, w in zip(losses, want, strict=True))
    if not worst <= LOSS_RTOL:
        raise ValueError(
            f"{steps}, run again here: loss {losses[0]:.5f} vs train.json's {want[0]:.5f}, "
            f"worst relative difference {worst:.1e} > {LOSS_RTOL:.0e}"
        )
    got = resumed["losses"]
    if len(got) != len(losses):
        raise ValueError(f"resumed.json has {len(got)} losses, the resume {len(losses)}")
    if got != losses:
        k = next(i for i, (a, b) in enumerate(zip(got, losses, strict=True)) if a != b)
        copied = " (they are train.json's, copied?)" if got == want else ""
        raise ValueError(
            f"resumed.json's losses are not what resuming resharded/ on {describe(there)} "
            f"gives: step {start + k}: {got[k]!r} recorded, {losses[k]!r} run again here{copied}"
        )
    _, mine, _ = checkpoint.read_dense(work / "resumed")
    differ = sorted(k for k in dense if k not in mine or not torch.equal(mine[k], dense[k]))
    if differ or sorted(mine) != sorted(dense):
        name = differ[0] if differ else sorted(set(mine) ^ set(dense))[0]
        raise ValueError(
            f"resumed/ is not the state resuming resharded/ reaches: {len(differ) or 1} of "
            f"{len(dense)} dense tensors differ from the grader's own run, e.g. {name}"
        )
    return (
        f"{steps}, run again here from resharded/: every loss equals train.json's within "
        f"{LOSS_RTOL:.0e}, and resumed.json and resumed/ hold that run's, bit for bit"
    )


def _check_generation(work: Path) -> str:
    """generated.json's ids are generated again here, from resumed/, at tp 1 and the chosen
    tp, with its recorded settings; the stored ids and text must be what that gives."""
    choice, gen = _choice(work), _read_json(work / "generated.json")
    prompt, new, ids = gen["prompt"], gen["max_new_tokens"], gen["ids"]
    recorded = gen.get("sampling") or {"greedy": True}
    sampling = Sampling.from_dict(recorded, "generated.json's sampling")
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
    again = {tp: serve(served, prompt, new, int(tp), sampling) for tp in need}
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
    if sampling.greedy or sampling.temperature == 0:
        how = "greedy"
    else:
        how = f"seed {sampling.seed}, temperature {sampling.temperature}, top_k {sampling.top_k}"
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


AUTHOR_CHECK = "the choice is your code's"


def _check_author(work: Path, budget: Budget, exercise: ModuleType) -> str:
    """choice.json is what `exercise.choose` returns for `exercise.survey`'s candidates and
    the recorded step times, and both are yours: not the reference's (grading.whose, or
    written in solutions/), and not reaching solutions/ while they run (its imports fail)."""
    from tpedu.course import grading  # the exercise machinery: only for this check

    theirs = [
        f
        for f in ("survey", "choose")
        if grading.whose(exercise, f) == "reference" or from_solutions(getattr(exercise, f, None))
    ]
    if theirs:
        raise ValueError(
            f"{' and '.join(theirs)} {'is' if len(theirs) == 1 else 'are'} the reference's "
            "(solutions/), not yours: write your own in exercises/l20_capstone.py"
        )
    data = _read_json(work / "choice.json")
    config = checkpoint.read_config(work / "ckpt")
    try:
        with without_solutions():
            found = exercise.survey(config, budget)
            again = exercise.choose(found, data["seconds"], budget)
    except ImportError as e:
        raise ValueError(f"your survey or choose reaches solutions/ ({e})") from e
    except NotImplementedError as e:
        raise ValueError("your survey or choose still raises NotImplementedError") from e
    if tuple(again) != (_choice(work), data["why"]):
        raise ValueError(
            "choice.json is not what your choose returns for your survey and its recorded "
            f"step times: it returns {describe(again[0])}"
            + ("" if again[0] == _choice(work) else f", choice.json has {describe(_choice(work))}")
        )
    return f"your survey's {len(found)} layouts, your choose: {describe(again[0])}, the same reason"


def check_capstone(
    workdir: str | Path, budget: Budget = BUDGET, exercise: ModuleType | None = None
) -> list[Check]:
    """One Check per claim about the artefacts in `workdir` (see the module docstring); a
    missing or damaged file fails its check with the reason, never raises. With `exercise`
    (the module `pick("l20_capstone")` returns), one more: the choice is your code's."""
    work, out = Path(workdir), []
    checks = list(CHECKS)
    if exercise is not None:
        checks.append((AUTHOR_CHECK, lambda w, b: _check_author(w, b, exercise)))
    for name, check in checks:
        try:
            takes_budget = check in (_check_fit, _check_why) or name == AUTHOR_CHECK
            out.append(Check(name, True, check(work, budget) if takes_budget else check(work)))
        except (ValueError, FileNotFoundError, KeyError, TypeError, IndexError) as e:
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            if isinstance(e, KeyError):
                reason = f"missing field {e}"
            out.append(Check(name, False, reason))
    return out


def passed(checks: list[Check]) -> bool:
    """Whether every check holds."""
    return bool(checks) and all(c.ok for c in checks)
