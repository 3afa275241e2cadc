"""Evaluation: the teacher-forced loop (`pipeline`, shared with the trainer), numeric metrics,
generation accuracy, lm-evaluation-harness, comparison and reports (`del-eval`)."""

from .numeric import batch_statistics, numeric_metrics
from .pipeline import Evaluated, teacher_forced

__all__ = ["Evaluated", "batch_statistics", "numeric_metrics", "teacher_forced"]
