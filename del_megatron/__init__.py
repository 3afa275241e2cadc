"""del-megatron: Digit Entropy Loss and its baselines for megatron-core continued pretraining."""

import warnings

# megatron-core warns on import when Transformer Engine / Apex are absent (always so on CPU);
# its local fallbacks are what we use there, so the notice is noise in every command.
warnings.filterwarnings(
    "ignore", message=r"(Transformer Engine and )?Apex (is|are) not installed", category=UserWarning
)


def _quiet_cpu_only_notices() -> None:
    """megatron-core's tensor-parallel layers recommend CUDA_DEVICE_MAX_CONNECTIONS=1 on every
    forward, also on CPU (gloo), where there is no CUDA stream it could apply to. On a GPU the
    advice stands (del-train sets the variable itself), so it is silenced only without one."""
    import torch

    if not torch.cuda.is_available():
        warnings.filterwarnings(
            "ignore", message="When using async grad allreduce", category=UserWarning
        )


_quiet_cpu_only_notices()

from .losses import (  # noqa: E402
    DigitVocab,
    NumericLossConfig,
    NumericLossHead,
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
    "NumericLossHead",
    "NumericLossOutput",
    "TokenizerError",
    "__version__",
    "emo_cost_embedding",
    "numeric_loss",
    "report_pairs",
    "vocab_parallel_numeric_loss",
]
