"""Lesson 14: sharded, reshardable checkpoints and model directories.

    files     atomic, fsynced writes and whole-directory replacement; CheckpointError
    index     the sharded checkpoint's format: directory, index, validation, `latest`
    writer    saving: every rank writes what it owns, atomically
    reader    loading at any layout, validated before any rank copies a tensor
    convert   model directories (`train --out`, used from lesson 07), resharding, dense, HF export
    hf        Hugging Face GPT-2 and Llama import into the tensor-parallel GPT (whole or by this
              rank's slices), and export back
    hf_map    the one table of how Hugging Face tensors make each dense tensor: pack, unpack,
              HFSlice (one rank's slices read from the safetensors files)
    hf_gpt2   GPT-2 (GPT2LMHeadModel) in that table: Conv1D weights transposed, fused c_attn
    hf_llama  Llama (LlamaForCausalLM) in that table: q_proj, k_proj, v_proj stacked into QKV
    hf_mixtral  Mixtral (MixtralForCausalLM): Llama's table plus the router and each expert's w1/w3/w2

The split and merge rules the checkpoints use live in tpedu.model.state (re-exported here with the
public names of files, index, writer, reader and convert). The training loop's hooks (save
when due, resume) are tpedu.train.checkpoints.
"""

from tpedu.checkpoint.convert import (
    DENSE_FORMAT,
    export_dense,
    import_dense,
    load_model_files,
    read_dense,
    read_model_dir,
    reshard,
    write_model_dir,
    write_sharded,
)
from tpedu.checkpoint.files import CheckpointError, replace_dir
from tpedu.checkpoint.hf import export_hf
from tpedu.checkpoint.index import (
    FORMAT,
    INDEX,
    LATEST,
    check_config,
    check_file,
    check_files,
    read_config,
    read_index,
    read_parallel,
    resolve,
    shard_file,
    step_name,
    summary,
)
from tpedu.checkpoint.reader import load
from tpedu.checkpoint.writer import save
from tpedu.model.plan import param_kind
from tpedu.model.state import (
    KINDS,
    dense_shapes,
    merge_column,
    merge_qkv,
    merge_row,
    merge_shards,
    split_tensor,
)

__all__ = [
    "CheckpointError",
    "DENSE_FORMAT",
    "FORMAT",
    "INDEX",
    "KINDS",
    "LATEST",
    "check_config",
    "check_file",
    "check_files",
    "dense_shapes",
    "export_dense",
    "export_hf",
    "import_dense",
    "load",
    "load_model_files",
    "merge_column",
    "merge_qkv",
    "merge_row",
    "merge_shards",
    "param_kind",
    "read_config",
    "read_dense",
    "read_index",
    "read_model_dir",
    "read_parallel",
    "replace_dir",
    "reshard",
    "resolve",
    "save",
    "write_model_dir",
    "shard_file",
    "split_tensor",
    "step_name",
    "summary",
    "write_sharded",
]
