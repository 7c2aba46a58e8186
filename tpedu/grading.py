"""Course infrastructure: the grader's learner-facing names, `tpedu.grading.hint('l03', 1)`.

The grader itself is tpedu.course.grading; this module only re-exports what a learner calls.
"""

from tpedu.course.grading import hint, hints, implementation, pick

__all__ = ["hint", "hints", "implementation", "pick"]
