"""Lessons 10–12: the other two dimensions, pipeline and data parallelism, and the 3D mesh.

    pipeline       stages and schedules (GPipe, 1F1B, interleaved) with event logs (lesson 10)
    data_parallel  bucketed gradient all-reduce from backward hooks, ZeRO-1 (lesson 11)
    mesh           the (tp, pp, dp) layout and its process groups (lesson 12; used from lesson 10)

Tensor parallelism runs inside each: the mesh gives every rank its TP, PP and DP groups.
"""
