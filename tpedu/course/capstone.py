"""Lesson 18: the capstone's budget, and its grader: checks on the files a run leaves behind.

The capstone (notebooks/18_capstone.ipynb) picks a layout that fits `BUDGET`, trains it on
红楼梦 with sharded checkpoints, reshards one to another layout, resumes there, and serves the
result. Every step writes into one work directory:

    choice.json     the chosen ParallelConfig (`ParallelConfig.to_dict()`)
    ckpt/           train's sharded checkpoints under that layout (a step before the end, and
                    the end)
    train.json      train's summary (its "losses": one per step)
    resharded/      one of ckpt's steps before the end, resharded to another layout (e.g. tp 1)
    resumed/        the run resumed from resharded/ on its layout: its checkpoint at the end
    resumed.json    that run's summary
    generated.json  {"prompt": ids, "max_new_tokens": n, "ids": {"<tp>": prompt + new ids, ...},
                    "text": the continuation}: greedy, with the KV cache, from resumed/, at tp 1
                    and at the chosen layout's tp

`check_capstone(workdir)` reads only these files (never the code that made them) and returns
one `Check` per claim, each printing as a one-line verdict. Peak bytes per rank come from the
dry run (tpedu.analysis.dryrun): one training step on the meta device, every rank measured.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from tpedu import checkpoint
from tpedu.analysis import dryrun
from tpedu.model.config import GPTConfig
from tpedu.parallel.config import ParallelConfig

MB = 10**6
# float32 resumed on another layout: the same arithmetic with the sums in another order (TP
# all-reduces, pipeline micro-batches), ~1e-7 relative per step; a wrong step, learning rate
# or optimizer state is off by 1e-3 or more
LOSS_RTOL = 1e-5


@dataclass(frozen=True)
class Budget:
    """What the capstone may use: `ranks` CPU ranks, each holding at most `bytes_per_rank` of
    weights, gradients, AdamW states, activations saved for backward and gathered parameters
    during one training step of `batch` sequences, for a GPT-2-like model of this shape on the
    novel's characters."""

    ranks: int = 4
    bytes_per_rank: int = 2 * MB
    n_layers: int = 2
    hidden: int = 32
    n_heads: int = 4
    seq_len: int = 32
    batch: int = 8

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


def peak_bytes(config: GPTConfig, parallel: ParallelConfig, batch: int) -> dict[int, int]:
    """{rank: bytes} the dry run measures on every rank during one training step: weights,
    gradients, AdamW states, saved activations, and (ZeRO-3) the parameters gathered at once."""
    runs = dryrun.dry_run(config, parallel, batch, list(range(parallel.world)))
    return {
        r.figures.rank: r.figures.weights
        + r.figures.gradients
        + r.figures.optimizer
        + r.figures.activations
        + r.figures.peak_gathered
        for r in runs
    }


def fits(config: GPTConfig, parallel: ParallelConfig, budget: Budget = BUDGET) -> tuple[bool, int]:
    """(whether `parallel` runs `config` within `budget`, the fullest rank's bytes). A layout
    that cannot run the model at all (e.g. tp not dividing the heads) raises its ValueError."""
    if parallel.world != budget.ranks:
        raise ValueError(
            f"{describe(parallel)} uses {parallel.world} ranks; the budget has "
            f"{budget.ranks}: make tp·cp·pp·dp = {budget.ranks}"
        )
    peak = max(peak_bytes(config, parallel, budget.batch).values())
    return peak <= budget.bytes_per_rank, peak


# ------------------------------------------------------------------------------ the checks


def _read_json(path: Path) -> dict:
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing")
    return json.loads(path.read_text())


def _choice(work: Path) -> ParallelConfig:
    return ParallelConfig.from_dict(_read_json(work / "choice.json"))


def _check_fit(work: Path, budget: Budget) -> str:
    choice, config = _choice(work), checkpoint.read_config(work / "ckpt")
    want = budget.model(config.vocab_size)
    if config != want:
        diff = [k for k, v in want.to_dict().items() if config.to_dict().get(k) != v]
        raise ValueError(f"the checkpoint's model differs from the budget's in {diff}")
    ok, peak = fits(config, choice, budget)
    verdict = "≤" if ok else "exceeds"
    detail = (
        f"{describe(choice)}: fullest rank {peak / MB:.3f} MB {verdict} "
        f"{budget.bytes_per_rank / MB:.3f} MB (dry run, {budget.ranks} ranks)"
    )
    if not ok:
        raise ValueError(detail)
    return detail


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
    got, want = resumed["losses"], train["losses"][start : start + len(resumed["losses"])]
    if not got or len(got) != len(want):
        raise ValueError(
            f"resumed.json has {len(got)} losses from step {start}; train.json has "
            f"{len(train['losses'])} steps: resume from a step before the end"
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
    choice, gen = _choice(work), _read_json(work / "generated.json")
    prompt, new, ids = gen["prompt"], gen["max_new_tokens"], gen["ids"]
    need = sorted({"1", str(choice.tp)})
    if sorted(ids) != need:
        raise ValueError(f"generated.json has ids for tp {sorted(ids)}; expected tp {need}")
    for tp, seq in ids.items():
        if seq[: len(prompt)] != prompt or len(seq) != len(prompt) + new:
            raise ValueError(
                f"tp {tp}: {len(seq)} ids, expected the prompt's {len(prompt)} + {new} new"
            )
    if len({tuple(seq) for seq in ids.values()}) != 1:
        raise ValueError(f"greedy ids differ between tp {' and tp '.join(need)}")
    if not isinstance(gen.get("text"), str) or not gen["text"]:
        raise ValueError("generated.json has no text")
    return f"{new} new tokens after a {len(prompt)}-token prompt, the same ids at tp {' and '.join(need)}"


CHECKS = (
    ("the layout fits the budget", _check_fit),
    ("the checkpoint validates", _check_checkpoint),
    ("the reshard keeps every tensor", _check_reshard),
    ("the resumed run continues the loss", _check_resume),
    ("the served text", _check_generation),
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
        except (ValueError, FileNotFoundError, KeyError, TypeError) as e:
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            if isinstance(e, KeyError):
                reason = f"missing field {e}"
            out.append(Check(name, False, reason))
    return out


def passed(checks: list[Check]) -> bool:
    """Whether every check holds."""
    return bool(checks) and all(c.ok for c in checks)
