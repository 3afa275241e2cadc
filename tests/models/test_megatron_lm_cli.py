"""`python -m del_megatron.cli.megatron_lm`: DEL as flags on Megatron-LM's pretrain_gpt.py.

* the flags, parsed by megatron.training's own `parse_args(extra_args_provider=...)` (.venv312)
  and by the module's own pre-parse, into the NumericLossConfig they ask for;
* the one-line refusals (exit 2): no checkout, a checkout without pretrain_gpt.py, a loss
  option out of range, ModelOpt, a run without --calculate-per-token-loss;
* the wiring handed to `pretrain` (a recorder in its place) for both of pretrain_gpt.py's
  forms, chosen by what the checkout's file imports;
* whole runs in a fresh interpreter with Megatron-LM's files and `pretrain` (CUDA) standing in
  (tests/loop_standins.py): both forms, a sentencepiece and a Hugging Face tokenizer.
`pretrain` itself needs CUDA: not run here (nor on a real Megatron-LM checkout)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
from functools import partial
from types import ModuleType, SimpleNamespace

import pytest

from del_megatron import DigitVocab, NumericLossConfig
from del_megatron.cli import megatron_lm as cli
from del_megatron.errors import UserError
from tests.distributed.launcher import torchrun_env
from tests.loop_standins import FORMS, write_checkout
from tests.models.test_readme_megatron import ARGS

pytestmark = pytest.mark.megatron

needs_megatron_training = pytest.mark.skipif(
    importlib.util.find_spec("megatron.training") is None,
    reason="megatron.training ships with megatron-core 0.17+ (.venv312)",
)

LOSS = NumericLossConfig(kind="del_distance", alpha=0.25, normalize="tokens")


def checkout(tmp_path, form: str):
    """A Megatron-LM checkout's three files (stand-ins) at the tag whose pretrain_gpt.py has
    the given form: core_v0.16.1 (model_provider) or core_v0.19.0 (config container)."""
    return write_checkout(tmp_path, FORMS[form])


# ---- the flags ----


def test_the_defaults_are_del_with_its_alpha_and_megatrons_normalisation():
    config = cli.loss_config_of(cli.own_args(["--lr", "1e-3", "--num-layers", "2"]))
    assert config == NumericLossConfig(kind="del", normalize="tokens")


def test_every_option_reaches_the_config():
    argv = [
        "--numeric-loss", "del", "--numeric-alpha", "0.3", "--no-numeric-place-weighting",
        "--numeric-include-decimal-point", "--numeric-shift-invariant", "--numeric-fused-output",
        "--numeric-fused-chunk-tokens", "512", "--numeric-fused-recompute",
    ]  # fmt: skip
    assert cli.loss_config_of(cli.own_args(argv)) == NumericLossConfig(
        kind="del",
        alpha=0.3,
        normalize="tokens",
        place_weighting=False,
        include_decimal_point=True,
        shift_invariant=True,
        fused_output=True,
        fused_chunk_tokens=512,
        fused_recompute=True,
    )


def test_the_kinds_are_the_loss_tables():
    from del_megatron.losses import KINDS

    action = next(
        a
        for a in cli.add_numeric_args(argparse.ArgumentParser())._actions
        if a.dest == "numeric_loss"
    )
    assert sorted(action.choices) == sorted(KINDS)


@needs_megatron_training
def test_megatrons_own_parser_takes_the_flags(monkeypatch, tmp_path):
    from megatron.training.arguments import parse_args

    argv = [*ARGS, "--numeric-loss", "ntl_was", "--numeric-alpha", "0.2"]
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv, "--megatron-lm", str(tmp_path)])
    args = parse_args(extra_args_provider=cli.add_numeric_args)
    assert args.megatron_lm == str(tmp_path)
    assert args.calculate_per_token_loss and args.num_layers == 2  # Megatron's own, untouched
    expected = NumericLossConfig(kind="ntl_was", alpha=0.2, normalize="tokens")
    assert cli.loss_config_of(args) == expected
    assert cli.loss_config_of(cli.own_args(sys.argv[1:])) == expected  # the pre-parse agrees


# ---- one-line refusals ----


def one_line_exit(capsys, argv) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"{cli.PROG}: error: "), err
    return err


def test_no_checkout(capsys, monkeypatch):
    monkeypatch.delenv(cli.ENV, raising=False)
    monkeypatch.setattr(sys, "argv", sys.argv[:1])
    assert "pretrain_gpt.py not found: pass --megatron-lm DIR" in one_line_exit(capsys, [])


def test_a_checkout_without_pretrain_gpt(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", sys.argv[:1])
    err = one_line_exit(capsys, ["--megatron-lm", str(tmp_path)])
    assert f"--megatron-lm {tmp_path}: no pretrain_gpt.py there" in err
    monkeypatch.setenv(cli.ENV, str(tmp_path))  # the same from the environment
    assert "no pretrain_gpt.py there" in one_line_exit(capsys, [])


def test_a_loss_option_out_of_range(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", sys.argv[:1])
    err = one_line_exit(capsys, ["--numeric-alpha", "-1"])
    assert "numeric loss options: alpha:" in err


def test_an_unknown_kind_is_argparses_exit_2(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", sys.argv[:1])
    with pytest.raises(SystemExit) as stop:
        cli.main(["--numeric-loss", "nope"])
    assert stop.value.code == 2
    assert "--numeric-loss: invalid choice: 'nope'" in capsys.readouterr().err


# ---- the wiring handed to pretrain ----


def fake_pretrain_gpt(container: bool) -> ModuleType:
    """pretrain_gpt.py's module-level names the runner reads, as objects to find again."""
    module = ModuleType("pretrain_gpt")
    module.train_valid_test_datasets_provider = lambda *a, **k: None
    module.forward_step = lambda data_iterator, model, return_schedule_plan=False: None
    module.get_embedding_ranks = lambda pp_ranks: pp_ranks[:1]
    module.model_provider = lambda builder, *a, **k: builder
    module.gpt_builder = lambda *a, **k: None
    module.has_nvidia_modelopt = False
    if container:
        module.parsed = SimpleNamespace(modelopt_enabled=False)
        module.calls = []

        def parse_and_validate_args(extra_args_provider=None, args_defaults=None):
            module.calls.append((extra_args_provider, args_defaults))
            return module.parsed

        module.parse_and_validate_args = parse_and_validate_args
        module.gpt_config_from_args = lambda args: SimpleNamespace(pre_wrap_hooks=["theirs"])
        module.pretrain_cfg_container_from_args = lambda args, cfg: ("container", args, cfg)
    return module


def recorded_pretrain(monkeypatch) -> list:
    import megatron.training

    calls = []
    monkeypatch.setattr(megatron.training, "pretrain", lambda *a, **k: calls.append((a, k)))
    return calls


def assert_our_flags(provider) -> None:
    parsed = provider(argparse.ArgumentParser()).parse_args(["--numeric-alpha", "0.5"])
    assert parsed.numeric_alpha == 0.5


@needs_megatron_training
def test_the_model_provider_form_is_wired_as_pretrain_gpt_wires_it(monkeypatch, synth_tokenizer):
    import megatron.training
    from megatron.core.enums import ModelType

    from del_megatron.models import megatron_lm
    from tests.models.test_megatron_tokenizer import LegacySentencePieceTokenizer

    tokenizer = LegacySentencePieceTokenizer(synth_tokenizer)
    calls = recorded_pretrain(monkeypatch)
    module = fake_pretrain_gpt(container=False)
    cli.run(module, LOSS)
    ((args, kwargs),) = calls
    provide, model_provider, model_type, forward_step = args
    assert provide is module.train_valid_test_datasets_provider and provide.is_distributed
    assert isinstance(model_provider, partial) and model_provider.func is module.model_provider
    assert model_provider.args[0].__name__ == "numeric_gpt_builder"
    assert model_type is ModelType.encoder_or_decoder
    assert forward_step.__name__ == "numeric_forward_step"
    assert kwargs["args_defaults"] == {"tokenizer_type": "GPT2BPETokenizer"}
    assert kwargs["get_embedding_ranks"] is module.get_embedding_ranks
    assert_our_flags(kwargs["extra_args_provider"])
    # the builder, called by pretrain after its tokenizer: pretrain_gpt's gpt_builder, the
    # run's vocabulary and the config, once for every (virtual) stage
    made = []
    monkeypatch.setattr(megatron.training, "get_tokenizer", lambda: tokenizer)
    monkeypatch.setattr(
        megatron_lm, "numeric_builder", lambda *a: made.append(a) or (lambda *b, **k: b)
    )
    builder = model_provider.args[0]
    assert builder("args", True, False, 1, config="c") == ("args", True, False, 1)
    assert builder("args", False, True, 0) == ("args", False, True, 0)
    ((gpt_builder, vocab, config),) = made
    assert gpt_builder is module.gpt_builder and config == LOSS
    assert vocab.fingerprint == DigitVocab.from_sentencepiece(synth_tokenizer).fingerprint


@needs_megatron_training
def test_the_config_container_form_adds_the_head_as_the_last_pre_wrap_hook(
    monkeypatch, synth_tokenizer
):
    import megatron.training
    from megatron.core.enums import ModelType

    from del_megatron.models import megatron_lm
    from tests.models.test_megatron_tokenizer import LegacySentencePieceTokenizer

    tokenizer = LegacySentencePieceTokenizer(synth_tokenizer)
    monkeypatch.setattr(megatron.training, "get_tokenizer", lambda: tokenizer)
    calls = recorded_pretrain(monkeypatch)
    module = fake_pretrain_gpt(container=True)
    cli.run(module, LOSS)
    ((args, kwargs),) = calls
    (container, parsed, model_cfg), provide, model_type, forward_step = args
    assert container == "container" and parsed is module.parsed
    assert model_cfg.pre_wrap_hooks[0] == "theirs"
    assert model_cfg.pre_wrap_hooks[-1].__name__ == "numeric_loss_stages"
    assert provide is module.train_valid_test_datasets_provider and model_type is (
        ModelType.encoder_or_decoder
    )
    assert forward_step.__name__ == "numeric_forward_step"
    assert kwargs == {"store": None, "get_embedding_ranks": module.get_embedding_ranks}
    ((provider, defaults),) = module.calls
    assert defaults == {"tokenizer_type": "GPT2BPETokenizer"}
    assert_our_flags(provider)
    # the hook holds the run's vocabulary and the config
    made = []
    monkeypatch.setattr(megatron_lm, "numeric_loss_hook", lambda *a: made.append(a) or "hook")
    cli.run(fake_pretrain_gpt(container=True), LOSS)
    ((vocab, config),) = made
    assert config == LOSS
    assert vocab.fingerprint == DigitVocab.from_sentencepiece(synth_tokenizer).fingerprint


def test_legacy_models_are_refused_in_one_line(monkeypatch):
    """core_v0.16.x's --use-legacy-models: gpt_builder then builds megatron.legacy's GPTModel,
    which the head cannot end (a TypeError from deep in the build before)."""
    from del_megatron.models import megatron_lm

    built = []
    monkeypatch.setattr(megatron_lm, "numeric_builder", lambda *a: built.append(a))
    builder = cli._numeric_builder(fake_pretrain_gpt(container=False), LOSS)
    with pytest.raises(UserError, match="drop --use-legacy-models") as err:
        builder(SimpleNamespace(use_legacy_models=True), True, True)
    assert "\n" not in str(err.value) and built == []


@needs_megatron_training
def test_modelopt_is_refused_in_one_line(monkeypatch):
    recorded_pretrain(monkeypatch)
    module = fake_pretrain_gpt(container=True)
    module.parsed.modelopt_enabled = True
    with pytest.raises(UserError, match="ModelOpt") as err:
        cli.run(module, NumericLossConfig(kind="del", normalize="tokens"))
    assert "\n" not in str(err.value)


# ---- whole runs, Megatron-LM's files and pretrain standing in ----

# started with the interpreter (PYTHONPATH's sitecustomize), so that the command runs as a
# user types it: megatron.training's pretrain (CUDA) replaced before the module reads it
SITECUSTOMIZE = "import tests.loop_standins as standins\n\nstandins.install()\n"


def run_cli(tmp_path, *argv: str) -> subprocess.CompletedProcess:
    """`python -m del_megatron.cli.megatron_lm ARGV` in `tmp_path`, pretrain standing in."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = torchrun_env()
    env["PYTHONPATH"] = os.pathsep.join([str(site), env["PYTHONPATH"]])
    return subprocess.run(
        [sys.executable, "-m", "del_megatron.cli.megatron_lm", *argv],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


@needs_megatron_training
@pytest.mark.parametrize("tokenizer_type", ["SentencePieceTokenizer", "HuggingFaceTokenizer"])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_a_run_with_two_flags(
    form, tokenizer_type, tmp_path, synth_tokenizer, synth_llama3_tokenizer
):
    """Each form of pretrain_gpt.py (core_v0.16.1's files, core_v0.19.0's) with each kind of
    tokenizer Megatron-LM builds (core_v0.16.1's legacy classes in the first form, the
    megatron.core.tokenizers of megatron.training 0.17+ in the second): the run's model ends
    in the head with the digit vocabulary of the run's own tokenizer."""
    (tmp_path / "Megatron-LM").mkdir()
    repo = checkout(tmp_path / "Megatron-LM", form)
    if tokenizer_type == "SentencePieceTokenizer":
        model = shutil.copy(synth_tokenizer, tmp_path / "tokenizer.model")
        expected = DigitVocab.from_sentencepiece(synth_tokenizer)
    else:
        (tmp_path / "hf").mkdir()
        shutil.copy(synth_llama3_tokenizer, tmp_path / "hf" / "tokenizer.json")
        model = tmp_path / "hf"
        expected = DigitVocab.from_hf(synth_llama3_tokenizer)
    tokenizer = ("--tokenizer-type", tokenizer_type, "--tokenizer-model", str(model))
    flags = ("--numeric-loss", "del", "--numeric-alpha", "0.1", "--megatron-lm", str(repo))
    done = run_cli(tmp_path, *ARGS, *tokenizer, *flags)
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]
    assert f"OK {form}: lm loss, objective, numeric, digit_acc" in done.stdout
    assert f"VOCAB {expected.fingerprint}\n" in done.stdout


@needs_megatron_training
def test_a_run_without_per_token_loss_is_refused_in_one_line(tmp_path, synth_tokenizer):
    (tmp_path / "Megatron-LM").mkdir()
    repo = checkout(tmp_path / "Megatron-LM", "config container")
    argv = [a for a in ARGS if a != "--calculate-per-token-loss"]
    tokenizer = ("--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model")
    done = run_cli(tmp_path, *argv, *tokenizer, str(synth_tokenizer), "--megatron-lm", str(repo))
    assert done.returncode == 2, (done.stdout + done.stderr)[-5000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{cli.PROG}: error: the numeric loss needs megatron's per-token loss")
