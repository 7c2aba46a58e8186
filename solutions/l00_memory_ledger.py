"""Reference for exercises/l00_memory_ledger.py."""

# the references live in tpedu/analysis/memory.py and tpedu/analysis/shape.py (gpt_params)
from tpedu.analysis.memory import embedding_bytes, gpt_params, training_bytes

__all__ = ["embedding_bytes", "gpt_params", "training_bytes"]
