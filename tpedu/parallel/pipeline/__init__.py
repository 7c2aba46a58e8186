"""Lesson 11: pipeline parallelism: pure schedules, and the runtime that runs them on ranks.

    schedules  stage partition, GPipe / 1F1B / interleaved schedules, bubble, simulation, timeline
    runtime    Pipe, run_schedule (the schedule on real ranks) and its StepOptions, stage chunks,
               tied-embedding grads

Every public name of both is re-exported here.
"""

from tpedu.parallel.pipeline.runtime import (
    Pipe,
    PipelineTimeout,
    StepOptions,
    StepResult,
    build_stage_chunks,
    run_schedule,
    sync_tied_grads,
)
from tpedu.parallel.pipeline.schedules import (
    Action,
    Event,
    bubble_formula,
    bubble_fraction,
    gpipe,
    head_cost,
    interleaved,
    one_f_one_b,
    partition,
    peak_in_flight,
    plot_timeline,
    schedule,
    simulate,
    stage_layers,
    stage_of,
)

__all__ = [
    "Action",
    "Event",
    "Pipe",
    "PipelineTimeout",
    "StepOptions",
    "StepResult",
    "bubble_formula",
    "bubble_fraction",
    "build_stage_chunks",
    "gpipe",
    "head_cost",
    "interleaved",
    "one_f_one_b",
    "partition",
    "peak_in_flight",
    "plot_timeline",
    "run_schedule",
    "schedule",
    "simulate",
    "stage_layers",
    "stage_of",
    "sync_tied_grads",
]
