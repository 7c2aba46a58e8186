"""Lesson 07: two tokenizers for the novel, and the trade-off the seed warns about (§5.5: a small
vocabulary leaves characters unknown; a large one costs embedding memory).

- `CharTokenizer`: one id per character seen in training text. Small vocabulary (≈4.5 k for
  红楼梦), but a character never seen in training becomes <unk>.
- `BPETokenizer`: byte-level BPE trained locally with Hugging Face `tokenizers`. Nothing is ever
  unknown (every byte has an id); the vocabulary size is a choice, trading embedding rows against
  sequence length. Trained tokenizers are cached as JSON.

Both expose `encode(str) -> list[int]`, `decode(list[int]) -> str`, `unknown(str)` (the
characters `encode` cannot represent), `vocab_size`, `save(path)`, and `load(path)` restores
either kind.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

PAD, UNK = "<pad>", "<unk>"


KINDS = ("char", "bpe")  # character-level, byte-level BPE


class CharTokenizer:
    """Character-level: id 0 is <pad>, 1 is <unk>, then the training text's characters, sorted."""

    kind = "char"

    def __init__(self, chars: list[str]) -> None:
        self.itos = [PAD, UNK, *chars]
        self.stoi = {c: i for i, c in enumerate(self.itos)}

    @classmethod
    def train(cls, text: str) -> CharTokenizer:
        return cls(sorted(set(text)))

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    @property
    def pad_id(self) -> int:
        return 0

    def encode(self, text: str) -> list[int]:
        unk = self.stoi[UNK]
        return [self.stoi.get(c, unk) for c in text]

    def unknown(self, text: str) -> list[str]:
        """The characters of `text` that `encode` would turn into <unk>, each once, in order."""
        return list(dict.fromkeys(c for c in text if c not in self.stoi))

    def decode(self, ids: list[int]) -> str:
        return "".join(self.itos[i] if i > 1 else ("" if i == 0 else "�") for i in ids)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(
            json.dumps({"kind": "char", "chars": self.itos[2:]}, ensure_ascii=False),
            encoding="utf-8",
        )


class BPETokenizer:
    """Byte-level BPE (as GPT-2) trained with HF `tokenizers`; id 0 is <pad>."""

    kind = "bpe"

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tok = tokenizer

    @classmethod
    def train(cls, text: str, vocab_size: int = 8192) -> BPETokenizer:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[PAD],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        # Train on lines: byte-level BPE never merges across the pre-tokenizer's word breaks.
        tok.train_from_iterator(text.splitlines(), trainer=trainer)
        return cls(tok)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    @property
    def pad_id(self) -> int:
        return self.tok.token_to_id(PAD)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def unknown(self, text: str) -> list[str]:
        """None: byte-level BPE has an id for every byte, so it encodes any text."""
        return []

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(
            json.dumps({"kind": "bpe", "tokenizer": self.tok.to_str()}), encoding="utf-8"
        )


def load(path: str | Path) -> CharTokenizer | BPETokenizer:
    """Restore a tokenizer written by `save`."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if data.get("kind") == "char":
        return CharTokenizer(data["chars"])
    if data.get("kind") == "bpe":
        return BPETokenizer(Tokenizer.from_str(data["tokenizer"]))
    raise ValueError(f"{path} is not a tpedu tokenizer file (kind={data.get('kind')!r})")


def build(
    text: str, kind: str = "char", vocab_size: int = 8192, cache_dir: str | Path | None = None
) -> CharTokenizer | BPETokenizer:
    """Train a tokenizer on `text`, or load it from `cache_dir` if this exact one was trained."""
    if kind not in KINDS:
        raise ValueError(f"tokenizer kind must be 'char' or 'bpe', got {kind!r}")
    key = hashlib.sha256(f"{kind}:{vocab_size}:".encode() + text.encode()).hexdigest()[:16]
    path = Path(cache_dir) / f"{kind}-{key}.json" if cache_dir else None
    if path is not None and path.exists():
        return load(path)
    tok = CharTokenizer.train(text) if kind == "char" else BPETokenizer.train(text, vocab_size)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        # A temporary name of its own (ranks under torchrun may all build the cache at once),
        # in the same directory, then an atomic rename: a reader never sees half a file.
        tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
        try:
            tok.save(tmp)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    return tok
