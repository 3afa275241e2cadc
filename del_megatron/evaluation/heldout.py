"""del-eval's teacher-forced metrics on held-out shards: the windows (their length against the
model's positions), the held-out data, and the numeric metrics through the one
teacher-forced loop (`pipeline.teacher_forced`) with a loaded model's logits."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import UserError

if TYPE_CHECKING:
    from ..losses import NumericLossConfig

# The longest default window: a checkpoint and its Hugging Face export share
# max_position_embeddings, so a default taken from it alone gives both the same windows
# (and the same metrics); the cap keeps long-context models' windows affordable.
DEFAULT_WINDOW = 2048


@dataclass(frozen=True, kw_only=True)
class HeldoutSettings:
    manifests: tuple[str, ...]
    """Held-out shards' manifests, read once in file order."""
    batch_size: int = 8
    max_batches: int | None = None
    """At most this many batches (None: every window)."""


def window_length(requested: int | None, positions: int) -> int:
    """The window length for a model of `positions` positions: the request, refused past the
    positions (the model's outputs there are meaningless), or the default."""
    if requested is None:
        return min(positions, DEFAULT_WINDOW)
    if requested > positions:
        raise UserError(
            f"--seq-len {requested} exceeds the model's max_position_embeddings={positions}: "
            f"choose --seq-len {positions} or less"
        )
    return requested


def check_heldout(manifests: tuple[str, ...]) -> None:
    """Each held-out manifest readable and its listed shards present at their sizes (before
    any model loads)."""
    from ..data.format import check_listed_shards, read_manifest

    for url in manifests:
        check_listed_shards(url, read_manifest(url))


def heldout_data(settings: HeldoutSettings, seq_len: int):
    """The loader's record of the held-out shards: a data section of defaults (del-eval has no
    run config; a checkpoint and its export must read the same windows), held out."""
    from ..config import DataSection
    from ..data import DataSource

    sources = tuple(DataSource(manifest=m) for m in settings.manifests)
    return DataSection(sources=sources).loader_config(
        sources, seq_len=seq_len, micro_batch_size=settings.batch_size, held_out=True
    )


def term_loss(model: Path) -> tuple[NumericLossConfig, str]:
    """The loss whose digit term del-eval measures on `model` (its share of the loss:
    'numeric_share'), and where it comes from, in words: the run's own loss (run_config.yaml
    beside a training checkpoint) when it has a digit term, else DEL at its default alpha,
    labelled so. Read before the model loads."""
    from ..losses import NumericLossConfig

    default = NumericLossConfig(kind="del")
    alpha = f"{default.resolved_alpha:g}"
    path = model / "run_config.yaml"
    if not path.is_file():
        return default, f"del at the default alpha {alpha} (the model's training loss is unknown)"
    import yaml
    from pydantic import ValidationError

    try:
        section = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("loss") or {}
        loss = NumericLossConfig.model_validate(section)
    except (OSError, UnicodeDecodeError, yaml.YAMLError, AttributeError, ValidationError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"{path}: cannot read its loss section ({first})") from None
    if loss.kind_spec.digit_term is None:
        return default, (
            f"del at the default alpha {alpha} (the run trained {loss.kind}, which has no "
            "digit term)"
        )
    return loss, f"{loss.kind} at alpha {loss.resolved_alpha:g} (the run's, {path.name})"


def heldout_metrics(
    loaded, settings: HeldoutSettings, seq_len: int, *, progress: bool, loss=None
) -> dict:
    """Numeric metrics of `loaded` (backends.Loaded) on the held-out windows, with what they
    were measured on (manifests, window length, batches). loss: (config, label) of the loss
    whose digit term is measured (`term_loss`; None: read from `loaded.path` now)."""
    from ..data import StreamingLoader
    from .numeric import batch_statistics, numeric_metrics
    from .pipeline import teacher_forced

    term, label = loss if loss is not None else term_loss(loaded.path)

    data = heldout_data(settings, seq_len)
    loader = StreamingLoader(
        data, 0, 1, fingerprint=loaded.tokenizer.fingerprint, num_batches=settings.max_batches
    )
    vocab = loaded.tokenizer.digit_vocab

    def score(batch):
        logits = loaded.forward(batch["tokens"])  # [b, s, V] float32
        return batch_statistics(logits, batch["labels"], batch["loss_mask"], vocab, term)

    evaluated = teacher_forced(
        loader,
        score,
        lambda sums: numeric_metrics(sums, term.resolved_alpha),
        device=loaded.device,
        progress="teacher-forced" if progress else None,
    )
    return {
        **evaluated.metrics,
        "numeric_term": label,  # whose term 'numeric' and 'numeric_share' are
        "heldout": list(settings.manifests),
        "seq_len": seq_len,
        "batches": evaluated.batches,
    }
