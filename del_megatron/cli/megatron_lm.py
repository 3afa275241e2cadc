"""DEL as flags on Megatron-LM's own `pretrain_gpt.py`:

    python -m del_megatron.cli.megatron_lm <pretrain_gpt.py's arguments> \\
        --calculate-per-token-loss --numeric-loss del --numeric-alpha 0.1 \\
        --megatron-lm /path/to/Megatron-LM

runs Megatron-LM's loop as its `pretrain_gpt.py` runs it (its datasets, `get_batch`, forward
step, model builder and every one of its arguments), with three changes
(models/megatron_lm.py): the GPTModel its builder made ends in the numeric loss head, its
forward step hands back our loss function, and the digit vocabulary is the run's own tokenizer
(`digit_vocab_of(get_tokenizer())`, any --tokenizer-type that has one). The loss options are
Megatron arguments (`add_numeric_args`, its `extra_args_provider`), so they are parsed,
validated, logged and saved with the run's others.

Which of pretrain_gpt.py's two forms runs is read from the checkout's own file: the config
container (`pretrain_cfg_container_from_args`, Megatron-LM core_v0.18 and later: the head as a
pre-wrap hook) or `partial(model_provider, gpt_builder)` (core_v0.16.x and core_v0.17.x: the
head around its builder). pretrain_gpt.py is a script beside the `megatron` package in a
Megatron-LM checkout, not an installed module: `--megatron-lm DIR` or `MEGATRON_LM` names the
checkout, or pretrain_gpt.py is importable already (run from the checkout).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

from ..errors import UserError, one_line

PROG = "python -m del_megatron.cli.megatron_lm"
ENV = "MEGATRON_LM"  # the checkout when --megatron-lm is not given
# pretrain_gpt.py's own default (its __main__): a run without --tokenizer-type gets GPT-2's BPE
ARGS_DEFAULTS = {"tokenizer_type": "GPT2BPETokenizer"}


def add_numeric_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron's `extra_args_provider`: the numeric loss's options (NumericLossConfig's
    fields a run sets) and the checkout, in a group of their own. Returns the parser."""
    from ..losses import KINDS

    group = parser.add_argument_group("numeric loss (del-megatron)")
    group.add_argument(
        "--numeric-loss", choices=sorted(KINDS), default="del", help="the loss kind (del)"
    )
    group.add_argument(
        "--numeric-alpha",
        type=float,
        default=None,
        help="coefficient of the numeric part (default: the kind's)",
    )
    group.add_argument(
        "--numeric-place-weighting",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="weigh each digit by its place (default: on for del and del_distance)",
    )
    group.add_argument("--numeric-include-decimal-point", action="store_true", help="del only")
    group.add_argument("--numeric-shift-invariant", action="store_true")
    group.add_argument(
        "--numeric-fused-output",
        action="store_true",
        help="output layer and loss together in token chunks (no [tokens, V/tp] logits)",
    )
    group.add_argument("--numeric-fused-chunk-tokens", type=int, default=0)
    group.add_argument("--numeric-fused-recompute", action="store_true")
    group.add_argument(
        "--megatron-lm",
        default=None,
        metavar="DIR",
        help=f"the Megatron-LM checkout holding pretrain_gpt.py (default: ${ENV})",
    )
    return parser


def loss_config_of(args: argparse.Namespace) -> Any:
    """The NumericLossConfig the arguments ask for; `normalize="tokens"`, the one megatron's
    sum over micro-batches keeps exact (models/megatron_lm.check_megatron_loop)."""
    from pydantic import ValidationError

    from ..losses import NumericLossConfig

    try:
        return NumericLossConfig(
            kind=args.numeric_loss,
            alpha=args.numeric_alpha,
            normalize="tokens",
            place_weighting=args.numeric_place_weighting,
            include_decimal_point=args.numeric_include_decimal_point,
            shift_invariant=args.numeric_shift_invariant,
            fused_output=args.numeric_fused_output,
            fused_chunk_tokens=args.numeric_fused_chunk_tokens,
            fused_recompute=args.numeric_fused_recompute,
        )
    except ValidationError as err:
        problems = "; ".join(f"{e['loc'][0] if e['loc'] else ''}: {e['msg']}" for e in err.errors())
        raise UserError(f"numeric loss options: {one_line(problems)}") from None


def own_args(argv: list[str]) -> argparse.Namespace:
    """This module's arguments alone, read before Megatron's parser (which needs
    pretrain_gpt.py, found through --megatron-lm), so that a wrong value stops the run before
    any process group."""
    parser = argparse.ArgumentParser(prog=PROG, add_help=False, allow_abbrev=False)
    return add_numeric_args(parser).parse_known_args(argv)[0]  # a wrong value: argparse's exit 2


def import_pretrain_gpt(checkout: str | None) -> ModuleType:
    """Megatron-LM's pretrain_gpt.py: from `checkout` (put first on sys.path, as Megatron-LM's
    own launch scripts put it on PYTHONPATH: its `megatron`, `gpt_builders.py` and
    `model_provider.py` beside it), else from $MEGATRON_LM, else as importable already."""
    checkout = checkout or os.environ.get(ENV) or None
    if checkout is not None:
        if not (Path(checkout) / "pretrain_gpt.py").is_file():
            raise UserError(
                f"--megatron-lm {checkout}: no pretrain_gpt.py there; give the Megatron-LM "
                "checkout's directory"
            )
        sys.path.insert(0, str(Path(checkout).resolve()))
    elif importlib.util.find_spec("pretrain_gpt") is None:
        raise UserError(
            f"pretrain_gpt.py not found: pass --megatron-lm DIR (a Megatron-LM checkout) or set "
            f"{ENV}, or run from the checkout"
        )
    return importlib.import_module("pretrain_gpt")


def extra_args_provider(pretrain_gpt: ModuleType):
    """Ours, after pretrain_gpt.py's own (ModelOpt's arguments, where it has them)."""
    theirs = getattr(pretrain_gpt, "add_modelopt_args", None)
    if not getattr(pretrain_gpt, "has_nvidia_modelopt", False):
        theirs = None

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        return add_numeric_args(theirs(parser) if theirs is not None else parser)

    return provider


def run(pretrain_gpt: ModuleType, loss_config: Any) -> None:
    """Megatron-LM's `pretrain`, called as the checkout's pretrain_gpt.py calls it, with the
    numeric loss head, forward step and the run's digit vocabulary."""
    import megatron.training
    from megatron.core.enums import ModelType

    from ..models import megatron_lm

    pretrain, store = megatron.training.pretrain, None
    restart = getattr(pretrain_gpt, "inprocess_restart", None)
    if restart is not None:  # as pretrain_gpt.py: optionally restarted in process
        pretrain, store = restart.maybe_wrap_for_inprocess_restart(pretrain)
    provide_datasets = pretrain_gpt.train_valid_test_datasets_provider
    provide_datasets.is_distributed = True  # as pretrain_gpt.py
    forward_step = megatron_lm.forward_step(pretrain_gpt.forward_step)
    extra = extra_args_provider(pretrain_gpt)
    if hasattr(pretrain_gpt, "pretrain_cfg_container_from_args"):
        container = _config_container(pretrain_gpt, loss_config, extra)
        pretrain(
            container,
            provide_datasets,
            ModelType.encoder_or_decoder,
            forward_step,
            store=store,
            get_embedding_ranks=pretrain_gpt.get_embedding_ranks,
        )
        return
    pretrain(
        provide_datasets,
        partial(pretrain_gpt.model_provider, _numeric_builder(pretrain_gpt, loss_config)),
        ModelType.encoder_or_decoder,
        forward_step,
        args_defaults=ARGS_DEFAULTS,
        extra_args_provider=extra,
        store=store,
        get_embedding_ranks=pretrain_gpt.get_embedding_ranks,
    )


def _config_container(pretrain_gpt: ModuleType, loss_config: Any, extra) -> Any:
    """The config-container form (core_v0.18+): the arguments parsed and the tokenizer built
    (parse_and_validate_args), the model config with the head as its last pre-wrap hook."""
    from megatron.training import get_tokenizer

    from ..models import megatron_lm
    from ..models.megatron_tokenizer import digit_vocab_of

    args = pretrain_gpt.parse_and_validate_args(
        extra_args_provider=extra, args_defaults=ARGS_DEFAULTS
    )
    if getattr(pretrain_gpt, "has_nvidia_modelopt", False):
        pretrain_gpt.maybe_enable_modelopt(args)
    if getattr(args, "modelopt_enabled", False):
        raise UserError(
            "ModelOpt (--export-*, distillation) replaces pretrain_gpt.py's model and loss; "
            "the numeric loss does not run under it: drop the ModelOpt arguments"
        )
    model_cfg = pretrain_gpt.gpt_config_from_args(args)
    model_cfg.pre_wrap_hooks.append(
        megatron_lm.numeric_loss_hook(digit_vocab_of(get_tokenizer()), loss_config)
    )
    return pretrain_gpt.pretrain_cfg_container_from_args(args, model_cfg)


def _numeric_builder(pretrain_gpt: ModuleType, loss_config: Any):
    """The model_provider form (core_v0.16.x, core_v0.17.x): its gpt_builder made to end in
    the head, the digit vocabulary read from the tokenizer `pretrain` built before the model."""
    from ..models import megatron_lm
    from ..models.megatron_tokenizer import digit_vocab_of

    built: list = []  # the builder, made once: one vocabulary for every (virtual) stage

    def numeric_gpt_builder(args, pre_process, post_process, vp_stage=None, **kwargs):
        if getattr(args, "use_legacy_models", False):  # core_v0.16.x has the flag, 0.17 not
            raise UserError(
                "--use-legacy-models builds megatron.legacy's GPTModel; the numeric loss head "
                "ends megatron-core's GPTModel: drop --use-legacy-models"
            )
        if not built:
            from megatron.training import get_tokenizer

            vocab = digit_vocab_of(get_tokenizer())
            built.append(megatron_lm.numeric_builder(pretrain_gpt.gpt_builder, vocab, loss_config))
        return built[0](args, pre_process, post_process, vp_stage, **kwargs)

    return numeric_gpt_builder


def main(argv: list[str] | None = None) -> int:
    """The run's exit status: 0, or 2 with one line for a mistake the user can fix. Megatron
    parses sys.argv itself: `argv`, when given, replaces it."""
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    try:
        own = own_args(sys.argv[1:])
        loss_config = loss_config_of(own)
        run(import_pretrain_gpt(own.megatron_lm), loss_config)
    except UserError as err:
        print(f"{PROG}: error: {one_line(err)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
