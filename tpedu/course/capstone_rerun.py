"""Lesson 20: what the capstone's grader runs again itself instead of trusting the files it
reads (tpedu.course.capstone uses both):

    losses, dense = resume_again(work / "resharded", cfg, parallel)   # the resumed run
    with without_solutions():                                          # the learner's code,
        found = exercise.survey(config, budget)                        # with solutions/ out
                                                                       # of reach

`resume_again` trains from the resharded checkpoint as the learner's resumed run did, on the
novel's text, and returns its losses and its final dense tensors; `serve` generates from a
checkpoint with the KV cache, as the learner's served text was; `without_solutions` makes
every import of solutions/ fail while the learner's survey and choose run again, and
`from_solutions` says whether a function was written there.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.abc
import json
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path

import torch

from tpedu import checkpoint
from tpedu.comm.device import device
from tpedu.course.grading import ROOT
from tpedu.data import tokenizer
from tpedu.data.corpus import load_novel, train_val_split
from tpedu.launcher import launch
from tpedu.model.config import GPTConfig
from tpedu.model.dense import DenseGPT
from tpedu.model.gpt import TPGPT
from tpedu.parallel.config import ParallelConfig
from tpedu.serve.generate import Sampling, generate_batch
from tpedu.train.config import TrainConfig
from tpedu.train.loop import train

# The grader's own resumed runs, by what they depend on (see `resume_again`): the tests grade
# many copies of one run directory, and a run repeated on the same inputs gives the same bits
_RESUMED: dict[str, tuple[list[float], dict[str, torch.Tensor]]] = {}


def resume_again(
    resharded: Path, cfg: TrainConfig, parallel: ParallelConfig
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The resumed run, run again here: `train` from the checkpoint `resharded` (its files
    verified first) at `parallel` with `cfg`'s settings, on the novel's text encoded with the
    checkpoint's own tokenizer; its losses and its final checkpoint's dense tensors."""
    step_dir, index = checkpoint.check_files(resharded, verify=True)
    own = ("resume", "ckpt_dir")  # the grader's: resharded/, and a directory of its own
    settings = {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name not in own}
    key = hashlib.sha256(
        json.dumps([index, settings, parallel.to_dict()], sort_keys=True, default=str).encode()
    ).hexdigest()
    if key not in _RESUMED:
        config = checkpoint.read_config(step_dir)
        tok = tokenizer.load(step_dir / "tokenizer.json")
        train_text, val_text = train_val_split(load_novel())
        ids = [torch.tensor(tok.encode(t), dtype=torch.long) for t in (train_text, val_text)]
        with tempfile.TemporaryDirectory(prefix="tpedu-grader-") as out:
            again = TrainConfig(**{**settings, "ckpt_dir": out, "resume": str(step_dir)})
            run = launch(train, parallel.world, config, again, *ids, tok=tok, parallel=parallel)
            _, dense, _ = checkpoint.read_dense(out)
        _RESUMED[key] = (run[0]["losses"], dense)
    return _RESUMED[key]


class _NoSolutions(importlib.abc.MetaPathFinder):
    """While installed: importing solutions/ (however the name is spelled) fails, saying so."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name == "solutions" or name.startswith("solutions."):
            raise ImportError(f"{name}: the reference's code, not yours")


@contextlib.contextmanager
def without_solutions() -> Iterator[None]:
    """solutions/ cannot be imported in the block: its modules are out of sys.modules (put
    back after) and a finder refuses to load them again."""
    held = {k: m for k, m in sys.modules.items() if k == "solutions" or k.startswith("solutions.")}
    for k in held:
        del sys.modules[k]
    finder = _NoSolutions()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        sys.modules.update(held)


def from_solutions(fn: object) -> bool:
    """Whether function `fn` was written in solutions/ (the reference module's own, or one
    imported from it)."""
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    return code is not None and Path(code.co_filename).resolve().is_relative_to(ROOT / "solutions")


def _serve(config: GPTConfig, path: str, prompt: list[int], new: int, sampling: Sampling) -> list:
    model = TPGPT(DenseGPT(config)).to(device())  # this rank's shards, overwritten by load
    checkpoint.load(path, model)  # any saved layout -> this rank's shards
    return generate_batch(model.eval(), [prompt], new, sampling)[0]


def serve(
    path: str | Path, prompt: list[int], new: int, tp: int = 1, sampling: Sampling = Sampling()
) -> list:
    """prompt + `new` tokens generated with the KV cache by `tp` ranks, each loading its shards
    of the checkpoint `path`, every rank with the same `sampling` (generated.json records it as
    `dataclasses.asdict(sampling)`)."""
    config = checkpoint.read_config(path)
    return launch(_serve, tp, config, str(path), list(prompt), new, sampling)[0]
