"""del-megatron: Digit Entropy Loss and its baselines for megatron-core continued pretraining."""

import warnings

# megatron-core warns on import when Transformer Engine / Apex are absent (always so on CPU);
# its local fallbacks are what we use there, so the notice is noise in every command.
warnings.filterwarnings(
    "ignore", message=r"(Transformer Engine and )?Apex (is|are) not installed", category=UserWarning
)


# The loss exports are imported when first used (they need torch, seconds): a command's
# --help and its argument checks answer before that (tests/test_imports.py).
_LOSS_EXPORTS = (
    "DigitVocab",
    "NumericLossConfig",
    "NumericLossHead",
    "NumericLossOutput",
    "TokenizerError",
    "emo_cost_embedding",
    "numeric_loss",
    "report_pairs",
    "vocab_parallel_numeric_loss",
)


def __getattr__(name: str):
    if name not in _LOSS_EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import losses

    return getattr(losses, name)


__version__ = "0.1.0"

__all__ = [
    "DigitVocab",
    "NumericLossConfig",
    "NumericLossHead",
    "NumericLossOutput",
    "TokenizerError",
    "__version__",
    "emo_cost_embedding",
    "numeric_loss",
    "report_pairs",
    "vocab_parallel_numeric_loss",
]
