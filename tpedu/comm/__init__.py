"""Lesson 02: ranks that talk, traced and priced: the collectives every later lesson uses.

    collectives  traced wrappers over torch.distributed collectives (named groups, any dimension)
    tracer       CommTracer: count calls and bytes per group, op and phase (forward / backward)
    volumes      bytes each rank sends, and message steps, of each ring collective on t ranks
    cost_model   the α-β model of collective time, fitted on this machine (again in lesson 15)
    ring         a ring all-reduce written with send/recv only (NCCL's ring algorithm)

Every tensor-parallel module communicates through tpedu.comm.collectives, so a CommTracer sees
every byte; lessons 03–17 count their communication with it.
"""
