"""Lesson 14: the file layer under checkpoints and model directories: writes that survive a crash.

Every file is written and fsynced before it counts; a directory is written complete under a
temporary name and then renamed into place (`replace_dir`), the old one kept complete until the
new one is there, so a crash never leaves half a directory under the final name; `file_sha256` gives
the checksums an index records. `CheckpointError` is the one error a checkpoint that cannot
be loaded as asked raises, naming the file and the field.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from pathlib import Path


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as asked; the message names the file and the field."""


def write_synced(path: Path, data: bytes) -> None:
    """Write and fsync: once this returns, the bytes are on disk, not just in the page cache."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # makes the directory entries (new files, renames) durable
    finally:
        os.close(fd)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def replace_dir(tmp: Path, final: Path) -> None:
    """Rename the complete directory `tmp` to `final`, replacing the directory there, if any.

    The old directory is never deleted before the new one is in place: it is renamed aside to
    `.old-<name>-<random>`, `tmp` is renamed to `final` (renamed back if that fails), and only
    then is the old one deleted. A process killed between the two renames leaves `final` absent
    and the old directory complete under its `.old-` name (`resolve` looks there). Both paths
    must be on one file system.
    """
    tmp, final = Path(tmp), Path(final)
    old = final.parent / f".old-{final.name}-{uuid.uuid4().hex[:8]}" if final.exists() else None
    if old is not None:
        os.rename(final, old)
    try:
        os.rename(tmp, final)
    except BaseException:
        if old is not None:
            os.rename(old, final)
        raise
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old)


def check_replaceable(out: str | Path) -> None:
    """Raise a CheckpointError unless `out` may be replaced as a whole (`replace_dir`) without
    losing anything: it is absent, an empty directory, or a model directory (has config.json:
    `train --out`, export_dense, export_hf). The one rule for every writer of a model dir."""
    out = Path(out)
    if not out.exists():
        return
    if out.is_dir() and ((out / "config.json").exists() or not any(out.iterdir())):
        return
    raise CheckpointError(
        f"{out} exists and is not a model directory (no config.json); "
        "writing the model there would replace what it holds: choose a new "
        "output path"
    )


def export_tmp(out: Path) -> Path:
    """An empty `.tmp-<name>` sibling of `out` to write an export into, then `replace_dir` it.
    An export replaces `out` as a whole: refuse unless `check_replaceable` allows it."""
    check_replaceable(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp
