"""Lessons 07–16: training the novel GPT: the data, the training loop, precision, generation.

    loop       the training loop: TP (lesson 07), 3D with pp and dp (lesson 13), checkpoints (14)
    preempt    on SIGTERM every rank stops after the same step and saves it (lesson 14)
    precision  mixed precision: bf16 or fp16, fp32 master weights, loss scaling (lessons 07–16)
    generate   continue a prompt with a trained model and the vocab-parallel sampler (lesson 07)
    data       the novel and its batches: corpus, tokenizer, batches (lesson 07)

`train` runs on every rank (launched by tpedu.launch, the CLI or torchrun); given `out`, it writes
the model directory that `python -m tpedu generate` reads.
"""
