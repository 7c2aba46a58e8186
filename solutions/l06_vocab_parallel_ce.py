"""Reference for exercises/l06_vocab_parallel_ce.py."""

# the reference lives in tpedu/embedding.py and tpedu/vocab_parallel.py
from tpedu.embedding import vocab_range
from tpedu.vocab_parallel import vocab_parallel_cross_entropy

__all__ = ["vocab_parallel_cross_entropy", "vocab_range"]
