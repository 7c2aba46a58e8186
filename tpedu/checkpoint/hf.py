"""Lesson 14: Hugging Face <-> tpedu: GPT-2 (`hf_gpt2`), Llama (`hf_llama`), Mixtral (`hf_mixtral`).

    config_from_hf   a transformers GPT2Config / LlamaConfig -> GPTConfig
    state_from_hf    a GPT2LMHeadModel / LlamaForCausalLM state dict -> a DenseGPT state dict
    state_to_hf      a DenseGPT state dict -> the transformers model's state dict
    hf_config        a GPTConfig -> the transformers config (GPT-2 or Llama, by its shape)
    load_hf_sharded  a `save_pretrained` directory -> this rank's TPGPT, reading only its slices
    export_hf        a tpedu checkpoint or model directory -> a `from_pretrained` directory

Every family is one table: which Hugging Face tensors, stacked and maybe transposed, make each
DenseGPT tensor (`hf_map`). Import, export and loading by slices all follow from that table.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch
import torch.distributed as dist

from tpedu.checkpoint import hf_gpt2, hf_llama, hf_mixtral
from tpedu.checkpoint.convert import fill_rank_slices, read_dense
from tpedu.checkpoint.files import export_tmp, replace_dir
from tpedu.checkpoint.hf_gpt2 import check_gpt2_shaped
from tpedu.checkpoint.hf_llama import check_llama_shaped
from tpedu.checkpoint.hf_map import HFFiles
from tpedu.model.config import GPTConfig
from tpedu.model.dense import DenseGPT
from tpedu.model.gpt import TPGPT
from tpedu.model.options import RunOptions
from tpedu.model.sharded_init import materialize

__all__ = [
    "export_hf",
    "check_gpt2_shaped",
    "check_llama_shaped",
    "config_from_hf",
    "family",
    "hf_config",
    "load_hf_sharded",
    "read_hf_config",
    "state_from_hf",
    "state_to_hf",
]

FAMILIES = {"gpt2": hf_gpt2, "llama": hf_llama, "mixtral": hf_mixtral}  # model_type -> module


def family(config: GPTConfig) -> ModuleType:
    """The module (hf_gpt2, hf_llama, hf_mixtral) of a tpedu config: a mixture of experts is
    Mixtral's, else learned positions are GPT-2's and RoPE is Llama's. A config its family
    cannot express raises that family's ValueError on export."""
    if config.experts:
        return hf_mixtral
    return hf_gpt2 if config.position == "learned" else hf_llama


def config_from_hf(hf_config: object) -> GPTConfig:
    """The tpedu config of a transformers GPT2Config or LlamaConfig (dropout off)."""
    kind = getattr(hf_config, "model_type", None)
    if kind not in FAMILIES:
        raise ValueError(f"model_type {kind!r} is not supported; expected one of {list(FAMILIES)}")
    return FAMILIES[kind].config_from_hf(hf_config)


def state_from_hf(hf_state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """A GPT2LMHeadModel or LlamaForCausalLM state dict -> a DenseGPT state dict (copies)."""
    return family(config).state_from_hf(hf_state, config)


def state_to_hf(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """A DenseGPT state dict -> the GPT2LMHeadModel or LlamaForCausalLM state dict (copies)."""
    return family(config).state_to_hf(state, config)


def hf_config(config: GPTConfig) -> object:
    """The transformers GPT2Config or LlamaConfig of a tpedu config."""
    return family(config).hf_config(config)


def read_hf_config(path: str | Path) -> object:
    """The transformers config of a `save_pretrained` directory (config.json only)."""
    from transformers import AutoConfig  # optional dependency, imported only here

    if not (Path(path) / "config.json").exists():
        raise ValueError(
            f"{Path(path) / 'config.json'} is missing: is {path} a save_pretrained dir?"
        )
    return AutoConfig.from_pretrained(path)


def load_hf_sharded(
    path: str | Path,
    group: dist.ProcessGroup | None = None,
    dtype: torch.dtype = torch.float32,
    options: RunOptions | None = None,
) -> TPGPT:
    """This rank's TPGPT of a Hugging Face GPT-2 or Llama `save_pretrained` directory
    (model.safetensors, or shards with model.safetensors.index.json), built on the meta device
    and filled by `convert.fill_rank_slices`: each tensor is read with safetensors' `get_slice`,
    only the rows or columns this rank holds, and the dense model is never in memory.
    `dtype`: the parameters' (the file's values are cast). `options`: TPGPT's. No
    communication."""
    config = config_from_hf(read_hf_config(path))
    module = family(config)
    table = module.table(config)
    with HFFiles(path, module.alias) as files:  # checks the files before building anything
        with torch.device("meta"):
            structure = TPGPT(DenseGPT(config), group, options=options).to(dtype)
        model = materialize(structure)
        fill_rank_slices(model, lambda name: files.slice(table[name]))
    return model


def export_hf(src: str | Path, out: str | Path) -> Path:
    """A GPT-2- or Llama-shaped checkpoint -> a Hugging Face directory (`GPT2LMHeadModel` or
    `LlamaForCausalLM.from_pretrained`): config.json and model.safetensors (a tied lm_head
    omitted, as transformers saves it)."""
    from safetensors.torch import save_file  # looked up per call: tests replace it

    config, tensors, _ = read_dense(src)
    to_files = getattr(family(config), "state_to_files", state_to_hf)  # Mixtral: per expert
    state = to_files({k: v for k, v in tensors.items() if "/" not in k}, config)
    if config.tie_embeddings:
        state.pop("lm_head.weight")  # tied to the embedding: transformers re-ties it on load
    out = Path(out)
    tmp = export_tmp(out)
    hf_config(config).save_pretrained(tmp)
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    replace_dir(tmp, out)  # a failed export leaves the previous `out` as it was
    return out
