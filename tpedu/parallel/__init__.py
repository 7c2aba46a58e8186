"""Lessons 08–15: how a model runs, and the dimensions beyond TP: pipeline, data parallelism and
ZeRO, and the mesh.

    config         ParallelConfig: how a model runs, kept apart from what it is (lessons 08–15)
    pipeline       stages and schedules (GPipe, 1F1B, interleaved), simulated and run (lesson 11)
    data_parallel  DataParallel: bucketed gradient all-reduce from backward hooks (lesson 12)
    zero           ZeRO-1, -2 and -3 (FSDP): AdamW states, gradients, then parameters sharded
                   over DP (lesson 12)
    mesh           the (tp, cp, pp, dp) layout and its process groups (lesson 13; used from 09)

Tensor parallelism runs inside each: the mesh gives every rank its TP, CP, PP and DP groups.
"""
