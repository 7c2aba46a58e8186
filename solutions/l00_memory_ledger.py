"""Reference for exercises/l00_memory_ledger.py."""

# the reference lives in tpedu/analysis/memory.py
from tpedu.analysis.memory import embedding_bytes, gpt_params, training_bytes

__all__ = ["embedding_bytes", "gpt_params", "training_bytes"]
