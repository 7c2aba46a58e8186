"""Lessons 07–14: the GPT: what it is, its dense reference, its tensor-parallel form, its shard map.

    config        GPTConfig: what fixes the shapes and arithmetic, GPT-2- or Llama-style (lesson 07)
    dense         DenseGPT: the plain-torch, single-process reference model (lesson 07)
    gpt           TPGPT: the tensor-parallel GPT, built from a DenseGPT's state dict (lesson 07;
                  sequence parallelism: 08, context parallelism: 09, recomputation: 10, pipeline
                  stages: 11)
    sharded_init  build_sharded: a rank's shards, bit for bit those of the dense model, without
                  ever holding the dense model (lessons 07–14)
    state         the shard map: how every parameter is split and replicated, with the one set of
                  split and merge rules (lesson 14, used from lesson 07 on)

    options       RunOptions: how TPGPT runs (sequence parallelism, recomputation, overlap,
                  context parallelism), never what it computes (lessons 08–15)

GPTConfig, DenseGPT, TPGPT and RunOptions are re-exported here: `from tpedu.model import TPGPT`.
"""

from tpedu.model.config import GPTConfig
from tpedu.model.dense import DenseGPT
from tpedu.model.gpt import TPGPT
from tpedu.model.options import RunOptions

__all__ = ["DenseGPT", "GPTConfig", "RunOptions", "TPGPT"]
