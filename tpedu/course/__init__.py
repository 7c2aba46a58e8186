"""Course infrastructure: the exercise grader, and lesson 16's bug zoo and troubleshooting tools.

    grading       the exercise grader behind `make grade`: exercises/ or solutions/ (every lesson)
    bugzoo        real TP bugs as broken variants, each with the check that catches it (lesson 16)
    troubleshoot  gradient comparison between layouts, debug settings, numerics (lesson 16)

Tests never import exercises/ or solutions/ directly: they call `grading.implementation(name)`.
"""
