"""Course infrastructure: grader, figures, GPU checks; lesson 16's bug hunt, lesson 20's capstone.

    grading         the exercise grader behind `make grade`: exercises/ or solutions/ (every lesson)
    figures_basics  figures for lessons 02–06, drawn from what the code records in a run
    figures_model   figures for lessons 07 and 11: a step's collectives, activations held per stage
    claims          a lesson's claims, printed at their tolerance (the same on every CPU) and asserted
    gpu_check       the GPU checks, `make gpu-check`: what the CPU test suite cannot show
    bugzoo          real TP bugs as broken variants, each with the check that catches it (lesson 16)
    zoo_training    the zoo's training checks: ZeRO and EP against plain DP, step by step (lesson 16)
    hunt            the blind bug hunt: zoo bugs applied unnamed, the fixes graded (lesson 16)
    hunt_cases      the hunt's cases: what each broken run shows, its suspects, the answers (16)
    hunt_checks     a fix checked on runs its case never shows; case 2's 1F1B order (lesson 16)
    mutation        a bug as one edit of tpedu's own source, shown and run as it ran (lesson 16)
    figures_precision  bf16 training: why the master weights stay fp32, measured (lesson 00)
    troubleshoot    gradient comparison between layouts, debug settings, numerics (lesson 16)
    capstone        the capstone's budget, and its checks on the files a run leaves (lesson 20)
    capstone_rerun  what the capstone's grader runs again: the resume; the learner's code (18)
    style           the figures' fonts: the novel's Chinese text drawn, not boxes (every lesson)

Tests never import exercises/ or solutions/ directly: they call `grading.implementation(name)`.
"""

from tpedu.course.style import use_course_style

use_course_style()
