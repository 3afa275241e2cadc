"""del-megatron: Digit Entropy Loss and its baselines for megatron-core continued pretraining."""

from .losses import (
    DigitVocab,
    NumericLossConfig,
    NumericLossOutput,
    TokenizerError,
    emo_cost_embedding,
    numeric_loss,
    report_pairs,
    vocab_parallel_numeric_loss,
)

__version__ = "0.1.0"

__all__ = [
    "DigitVocab",
    "NumericLossConfig",
    "NumericLossOutput",
    "TokenizerError",
    "__version__",
    "emo_cost_embedding",
    "numeric_loss",
    "report_pairs",
    "vocab_parallel_numeric_loss",
]
