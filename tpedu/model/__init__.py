"""The GPT: what it is (GPTConfig), its dense reference (DenseGPT), its tensor-parallel form (TPGPT)."""

from tpedu.model.config import GPTConfig
from tpedu.model.dense import DenseGPT
from tpedu.model.gpt import TPGPT

__all__ = ["DenseGPT", "GPTConfig", "TPGPT"]
