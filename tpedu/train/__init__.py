"""Lessons 07–16: training the novel GPT: the step, the training loop, precision, generation.

    config     TrainConfig, the run's settings, and the learning-rate schedule (lesson 07)
    step       one rank's training step for every layout, TP alone to 4D (lessons 07–13)
    optim      AdamW, and the DP gradient reducer or ZeRO's sharded optimizer (lessons 07–12)
    loop       the training loop: `train`, evaluation, checkpoints (lesson 14), the summary
    export     the dense model directory of a trained run (`train --out`)
    preempt    on SIGTERM every rank stops after the same step and saves it (lesson 14)
    precision  mixed precision: bf16 or fp16, fp32 master weights, loss scaling (lessons 07–16)
    generate   continue a prompt with a trained model and the vocab-parallel sampler (lesson 07)

`train` runs on every rank (launched by tpedu.launch, the CLI or torchrun); given `out`, it writes
the model directory that `python -m tpedu generate` reads.
"""
