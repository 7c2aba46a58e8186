"""Lesson 14: the training loop's checkpoint hooks: save when due (or now, on preemption), and
resume from a checkpoint."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

from tpedu.checkpoint.reader import load
from tpedu.checkpoint.writer import save
from tpedu.model.gpt import TPGPT
from tpedu.train.config import TrainConfig

# Set by saving_now(): the loop's `save(k)` hook then saves at any step (a preempted run).
_SAVING_NOW: ContextVar[bool] = ContextVar("saving_now", default=False)


@contextmanager
def saving_now() -> Iterator[None]:
    """Inside: save_if_due saves whatever the step (a preempted run's last save,
    tpedu.train.preempt), without the loop knowing how its save hook was built."""
    token = _SAVING_NOW.set(True)
    try:
        yield
    finally:
        _SAVING_NOW.reset(token)


def save_if_due(
    cfg: TrainConfig,
    step: int,
    model: TPGPT | Sequence[TPGPT],
    opt: object | None,
    **kwargs: object,
) -> Path | None:
    """The training loop's hook: save() to cfg.ckpt_dir when `step` (optimizer steps done) is a
    multiple of cfg.save_every, the last step (cfg.steps), or inside `saving_now()`. No
    ckpt_dir: nothing."""
    every = cfg.save_every
    if cfg.ckpt_dir and ((every and step % every == 0) or step == cfg.steps or _SAVING_NOW.get()):
        return save(cfg.ckpt_dir, model, opt, step, train_cfg=cfg, **kwargs)
    return None


def resume_from(
    cfg: TrainConfig,
    model: TPGPT | Sequence[TPGPT],
    opt: object | None,
    scaler: object | None = None,
) -> int:
    """The training loop's hook: load cfg.resume (if set) and return the next step to run; an
    fp16 run's LossScaler continues from the saved scale (a fresh one if the run was not fp16)."""
    if not cfg.resume:
        return 0
    index = load(cfg.resume, model, opt)
    if scaler is not None and "loss_scaler" in index:
        scaler.load_state_dict(index["loss_scaler"])
    return index["step"]
