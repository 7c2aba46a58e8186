"""Lessons 11–13: the other two dimensions, pipeline and data parallelism, and the 3D mesh.

    pipeline       stages and schedules (GPipe, 1F1B, interleaved) with event logs (lesson 11)
    data_parallel  bucketed gradient all-reduce from backward hooks, ZeRO-1 (lesson 12)
    mesh           the (tp, pp, dp) layout and its process groups (lesson 13; used from lesson 11)

Tensor parallelism runs inside each: the mesh gives every rank its TP, PP and DP groups.
"""
