"""What may change when a run continues from a checkpoint: one table, a row for every field
of the run config (`TABLE`; tests/training/test_resume_changes.py checks that every field
has one), read by the start-up checks (`--dry-run`, `--check`, preflight) and the real run.

A resume compares the config asked for with the one the checkpoint was saved with
(`run_config.yaml`). Each changed field is either carried out and said in one line, or
refused in one line naming the override that allows it. docs/checkpoints.md has the table
in words.

How a resume is asked for (`del-train --resume`):
* `auto` or a checkpoint directory: every change of the table is carried out or refused.
* `same` (the launchers' default): a restart of the same run (a requeue, a crash, a stop
  signal): changes that leave the run's meaning alone (layout, logging, evaluation) are
  carried out; any other is refused, naming `--resume auto`, so a command that forgets
  `output_dir=` cannot continue another run on other data or another loss.
"""

from __future__ import annotations

import json
import typing
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from ..config import ConfigError, RunConfig
from .schedule import Schedule, saved_schedule


class Effect(Enum):
    SAME_RUN = "same run"  # carried out; the run's meaning is unchanged (a restart accepts it)
    CHANGES_RUN = "changes the run"  # carried out from the next step; needs --resume auto
    SCHEDULE = "schedule"  # carried out by the schedule's continuation (optim.schedule_on_resume)
    RESTART_ONLY = "restart only"  # only with optim.schedule_on_resume=restart
    REFUSED = "refused"  # never on resume: a new run from the checkpoint's weights


@dataclass(frozen=True)
class Rule:
    effect: Effect
    how: str  # carried out: what happens; refused: why


def _same(how: str) -> Rule:
    return Rule(Effect.SAME_RUN, how)


def _changes(how: str) -> Rule:
    return Rule(Effect.CHANGES_RUN, how)


def _refused(why: str) -> Rule:
    return Rule(Effect.REFUSED, why)


_ARCHITECTURE = _refused("another architecture: the saved weights have the old one")
_LOSS_FROM_NEXT_STEP = _changes("the loss follows it from the next step")
_SAME_MATH = _same("the same values and gradients")
_DISPLAY = _same("what is shown and logged only")
_EVALUATION = _same("the held-out evaluation only")
_OPTIMIZER = _refused("the optimizer's saved settings are part of its state")
_INTERVAL = _same("from the next step")
_NOT_READ = _same("not read on resume: the weights come from the checkpoint")

TABLE: dict[str, Rule] = {
    **{
        f"model.{name}": _ARCHITECTURE
        for name in (
            "family",
            "vocab_size",
            "hidden_size",
            "ffn_hidden_size",
            "num_layers",
            "num_attention_heads",
            "num_query_groups",
            "head_dim",
            "max_position_embeddings",
            "rope_theta",
            "rope_scaling_factor",
            "sliding_window",
            "norm_epsilon",
            "qkv_bias",
            "tie_word_embeddings",
            "make_vocab_size_divisible_by",
        )
    },
    "loss.kind": _refused(
        "the checkpoint's model and optimizer state were made for the saved kind (EMO adds "
        "its cost embedding; another kind's metrics would be read as missing)"
    ),
    **{
        f"loss.{name}": _LOSS_FROM_NEXT_STEP
        for name in (
            "alpha",
            "normalize",
            "place_weighting",
            "place_slope",
            "decimal_base",
            "include_decimal_point",
            "detach_criterion",
            "shift_invariant",
            "dist2_tau",
            "mixce_eta",
            "ignore_index",
        )
    },
    "loss.fused_output": _SAME_MATH,
    "loss.fused_chunk_tokens": _SAME_MATH,
    "loss.fused_recompute": _SAME_MATH,
    "parallel.tensor_parallel": _same("another layout, from the layout-free state"),
    "parallel.zero_stage": _same("another layout, from the layout-free state"),
    "parallel.sequence_parallel": _same("refused by the config itself"),
    "parallel.collective_timeout_minutes": _same("how long a collective may wait, no value"),
    "parallel.stall_seconds": _same("when a wait is said and a stop ends it, no value"),
    **{
        f"parallel.{name}": _same("how megatron's engine holds and moves the same state")
        for name in (
            "distributed_optimizer",
            "overlap_grad_reduce",
            "overlap_param_gather",
            "ddp_bucket_size",
        )
    },
    **{
        f"parallel.{name}": _same("another layout, from the layout-free state")
        for name in (
            "pipeline_parallel",
            "virtual_pipeline_parallel",
            "first_stage_layers",
            "last_stage_layers",
        )
    },
    "optim.lr": Rule(Effect.RESTART_ONLY, "the peak of the schedule"),
    "optim.warmup_fraction": Rule(Effect.RESTART_ONLY, "the warmup of the schedule"),
    "optim.min_lr": Rule(Effect.SCHEDULE, "the floor of the schedule"),
    "optim.schedule_on_resume": _same("how a change of the schedule is carried out"),
    "optim.weight_decay": _OPTIMIZER,
    "optim.beta1": _OPTIMIZER,
    "optim.beta2": _OPTIMIZER,
    "optim.eps": _OPTIMIZER,
    "optim.clip_grad": _changes("gradients are clipped at the new norm from the next step"),
    "train.steps": Rule(Effect.SCHEDULE, "the last step of the schedule"),
    "train.micro_batch_size": _same("the gradient accumulation follows; same global batch"),
    "train.global_batch_size": _changes(
        "sequences per step from the next step (the schedule counts steps)"
    ),
    "train.seq_len": _changes(
        "windows of the new length from the next step; the data continues with the "
        "documents not yet trained"
    ),
    "train.seed": _changes(
        "the documents not yet trained continue in the new order; new random draws"
    ),
    "train.device": _same("another device, the same state"),
    "train.activation_checkpointing": _SAME_MATH,
    "train.deterministic": _same("the same math in kernels that repeat bit for bit"),
    "train.bf16": _changes(
        "the forward and backward in the new precision from the next step; the float32 "
        "masters and moments continue"
    ),
    "train.log_interval": _INTERVAL,
    "train.eval_interval": _INTERVAL,
    "train.save_interval": _INTERVAL,
    "train.keep_checkpoints": _INTERVAL,
    "train.layout_free_checkpoints": _INTERVAL,
    "train.background_checkpoints": _INTERVAL,
    "train.max_nonfinite_steps": _INTERVAL,
    "train.engine": _changes(
        "the other engine from the layout-free state; both decay the same parameters (no "
        "norm weight or bias)"
    ),
    "train.checkpoints": _INTERVAL,
    "data.tokenizer": _same("compared by content: another tokenizer is refused"),
    "data.sources": _changes(
        "kept sources continue where they were, new ones start at their beginning"
    ),
    "data.num_workers": _same("the data cursor continues with the documents not yet trained"),
    "data.shuffle": _changes("the documents not yet trained continue in the new order"),
    "data.mask_after_boundary": _LOSS_FROM_NEXT_STEP,
    "data.on_error": _INTERVAL,
    "data.allow_pipe": _INTERVAL,
    "data.trace": _INTERVAL,
    "init.hf": _NOT_READ,
    "init.hf_hub_id": _NOT_READ,
    "init.megatron": _NOT_READ,
    "eval.sources": _EVALUATION,
    "eval.max_batches": _EVALUATION,
    "logging.wandb": _DISPLAY,
    "logging.project": _DISPLAY,
    "logging.run_name": _DISPLAY,
    "logging.progress_bar": _DISPLAY,
    "output_dir": _same("where this run writes"),
}


def config_fields(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[str]:
    """Every field of the run config as a dotted path; a list of sections (data.sources) is
    one field."""
    paths = []
    for name, info in model.model_fields.items():
        annotation = info.annotation
        candidates = [annotation, *typing.get_args(annotation)]
        nested = [a for a in candidates if isinstance(a, type) and issubclass(a, BaseModel)]
        if nested and typing.get_origin(annotation) is not tuple:
            paths += config_fields(nested[0], f"{prefix}{name}.")
        else:
            paths.append(f"{prefix}{name}")
    return paths


_MISSING = object()


def _value(tree: dict[str, Any], path: str) -> Any:
    node: Any = tree
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _shown(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass
class Review:
    """What a resume changes: lines to say (start-up and dry run), the schedule to follow."""

    lines: list[str] = field(default_factory=list)
    schedule: Schedule | None = None
    schedule_changed: bool = False  # restart: the rate at the checkpoint's position changes
    peak_changed: bool = False  # restart: optim.lr differs from the saved peak


def changed_fields(saved: dict[str, Any], cfg: RunConfig) -> list[tuple[str, Any, Any]]:
    """(path, saved value, value asked for) of every field that differs; fields the saved
    config does not record (older versions) are taken as unchanged."""
    now = cfg.model_dump(mode="json")
    changes = []
    for path in TABLE:
        old, new = _value(saved, path), _value(now, path)
        if old is not _MISSING and old != new:
            changes.append((path, old, new))
    return changes


def _new_run(checkpoint: Path) -> str:
    return (
        f"to train its weights that way, start a new run from them: init.megatron={checkpoint} "
        "and another output_dir"
    )


def _read_saved(checkpoint: Path) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The checkpoint's run_config.yaml as a tree (None: it has none) and its meta.json (None:
    unreadable, which checkpoint.check names)."""
    try:
        meta = json.loads((checkpoint / "meta.json").read_text())
        meta["step"] = int(meta["step"])
    except (OSError, ValueError, KeyError, TypeError):
        meta = None
    path = checkpoint / "run_config.yaml"
    try:
        tree = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        return None, meta
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"{path}: unreadable ({type(err).__name__})") from None
    return (tree if isinstance(tree, dict) else None), meta


def review(checkpoint: Path, cfg: RunConfig, mode: str, *, tokenizer: str | None = None) -> Review:
    """Check a resume of `checkpoint` with `cfg` against the table. mode: 'same' (a restart)
    or anything else ('auto', a directory). tokenizer: this run's tokenizer fingerprint, to
    compare with the saved one. Raises ConfigError (one line naming the override) for the
    first refused change; returns the lines saying the others and the schedule to follow."""
    saved, meta = _read_saved(checkpoint)
    result = Review(schedule=Schedule.of_config(cfg))
    if meta is None:
        return result
    if tokenizer is not None and meta.get("tokenizer") != tokenizer:
        raise ConfigError(
            f"{checkpoint}: saved with another tokenizer than this run's "
            f"({cfg.tokenizer_path()}); resume with the tokenizer it was saved with (its "
            f"run_config.yaml), or {_new_run(checkpoint)}"
        )
    if saved is None:
        result.lines.append(
            f"{checkpoint} has no run_config.yaml: the config it was saved with is unknown, "
            "changes are not checked"
        )
        return result
    step = meta["step"]
    changes = changed_fields(saved, cfg)
    if mode == "same":
        meaning = [p for p, _, _ in changes if TABLE[p].effect is not Effect.SAME_RUN]
        if meaning:
            raise ConfigError(
                f"output_dir={cfg.output_dir} holds a run of another config ({checkpoint.name}: "
                f"{', '.join(meaning)} differ): --resume auto to continue it with these "
                "changes, or choose another output_dir"
            )
    restart = cfg.optim.schedule_on_resume == "restart"
    for path, old, new in changes:
        rule = TABLE[path]
        said = f"{path} {_shown(old)} -> {_shown(new)}"
        if rule.effect is Effect.REFUSED:
            raise ConfigError(
                f"{checkpoint}: saved with {path}={_shown(old)}, this run has {_shown(new)}: "
                f"cannot change on resume ({rule.how}); resume with {path}={_shown(old)}, or "
                f"{_new_run(checkpoint)}"
            )
        if rule.effect is Effect.RESTART_ONLY and not restart:
            raise ConfigError(
                f"{said}: {rule.how} does not change on resume by default (the learning rate "
                f"continues from its value at step {step}); optim.schedule_on_resume=restart "
                f"applies the new schedule from step {step + 1}, or resume with {path}="
                f"{_shown(old)}"
            )
        if rule.effect in (Effect.SAME_RUN, Effect.CHANGES_RUN):
            result.lines.append(f"resume: {said}: {rule.how}")
    _schedule(result, checkpoint, saved, cfg, step, restart)
    return result


def _schedule(
    result: Review,
    checkpoint: Path,
    saved: dict[str, Any],
    cfg: RunConfig,
    step: int,
    restart: bool,
) -> None:
    """The schedule of the resumed run and its one line when it changes."""
    from ..config import parse_run_config

    before = saved_schedule(checkpoint)
    if before is None:  # saved before schedules were recorded: the plain one of its config
        try:
            before = Schedule.of_config(parse_run_config(saved))
        except ConfigError:
            before = Schedule.of_config(cfg)
    plain = Schedule.of_config(cfg)

    def was(path: str, now: Any) -> Any:
        value = _value(saved, path)
        return now if value is _MISSING else value

    saved_lr = float(was("optim.lr", cfg.optim.lr))
    peak_changed = saved_lr != cfg.optim.lr
    settings_changed = (
        was("train.steps", cfg.train.steps) != cfg.train.steps
        or was("optim.min_lr", cfg.optim.min_lr) != cfg.optim.min_lr
        or peak_changed
        or (
            restart
            and was("optim.warmup_fraction", cfg.optim.warmup_fraction) != cfg.optim.warmup_fraction
        )
    )
    if not settings_changed:
        result.schedule = before
        return
    rate_then = before.factor(step) * saved_lr
    last, floor = cfg.train.steps, cfg.optim.min_lr
    if step >= last:
        result.schedule = before
        result.lines.append(
            f"resume: train.steps={last}: the checkpoint is at step {step}, nothing left to train"
        )
        return
    jump = plain.factor(step) * cfg.optim.lr
    if restart:
        result.schedule_changed = True
        result.peak_changed = peak_changed
        result.schedule = plain
        result.lines.append(
            f"resume: optim.schedule_on_resume=restart: the schedule of train.steps={last}, "
            f"optim.lr={cfg.optim.lr:g} from step {step + 1}: the learning rate goes from "
            f"{rate_then:.4g} to {jump:.4g}"
        )
        return
    result.schedule = before.continued(step, total=last, min_ratio=floor / cfg.optim.lr)
    result.lines.append(
        f"resume: schedule: the learning rate continues from {rate_then:.4g} (step {step}), "
        f"cosine to optim.min_lr={floor:g} at step {last} (optim.schedule_on_resume=restart: "
        f"the schedule of train.steps={last} from its start, {jump:.4g} at step {step + 1})"
    )
