"""Evaluation: teacher-forced numeric metrics, generation accuracy, reports (`del-eval`)."""

from .numeric import NumericMetrics, batch_statistics

__all__ = ["NumericMetrics", "batch_statistics"]
