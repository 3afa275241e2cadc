"""The numeric losses: digit vocabulary, place values, every loss kind (docs/losses.md)."""

from .assemble import REPORT_PAIRS, STAT_KEYS, NumericLossOutput, report_pairs
from .config import DEFAULT_ALPHA, DIGIT_KINDS, LossKind, NumericLossConfig
from .documents import document_starts_of
from .fused import default_chunk_tokens
from .head import NumericLossHead
from .kinds import KINDS, Kind, Objective
from .places import digit_places, place_weights
from .reference import emo_cost_embedding, numeric_loss
from .vocab import POINT_CLASS, DigitVocab, TokenizerError
from .vocab_parallel import vocab_parallel_numeric_loss

__all__ = [
    "DEFAULT_ALPHA",
    "DIGIT_KINDS",
    "KINDS",
    "POINT_CLASS",
    "REPORT_PAIRS",
    "STAT_KEYS",
    "DigitVocab",
    "Kind",
    "LossKind",
    "NumericLossConfig",
    "NumericLossHead",
    "NumericLossOutput",
    "Objective",
    "TokenizerError",
    "default_chunk_tokens",
    "digit_places",
    "document_starts_of",
    "emo_cost_embedding",
    "numeric_loss",
    "place_weights",
    "report_pairs",
    "vocab_parallel_numeric_loss",
]
