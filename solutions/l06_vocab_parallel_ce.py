"""Reference for exercises/l06_vocab_parallel_ce.py."""

# the reference lives in tpedu/tp/embedding.py and tpedu/tp/vocab_parallel.py
from tpedu.tp.embedding import vocab_range
from tpedu.tp.vocab_parallel import vocab_parallel_cross_entropy

__all__ = ["vocab_parallel_cross_entropy", "vocab_range"]
