"""Exports their readers load (issue 52, item 4). A run whose tokenizer file is
digits-sp.model: `del-convert megatron-to-hf` exited 0 and said AutoTokenizer would load
it, but copied the file under its own name; del-eval of the export exited 2 ("no
tokenizer.json or tokenizer.model") and transformers' AutoTokenizer failed too. A run whose
tokenizer is my-bpe.json exported none at all. Now the tokenizer goes under the names
transformers looks for, whatever the run called it, and del-convert loads its output the
way its readers do (transformers' AutoConfig, AutoModelForCausalLM's tensors, AutoTokenizer,
del-eval's loader) before it is put in place: what would not load is one line, exit 2, and
the output directory as it was."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from del_megatron.cli.convert import main as convert
from del_megatron.models import conversion
from del_megatron.models.weight_files import write_files_list
from del_megatron.tokenizer import Tokenizer

from ..distributed.launcher import ROOT, run_python, torchrun_env
from .tiny_hf import tiny_hf_model

TEXT = "Ann had 17 pens, sold 9.5 of them: 17-9.5=7.5\n  and  bought 1203 more. "


def run_weights(tmp_path: Path, tokenizer: Path, run_name: str, variant: str):
    """(the transformers model, a weights directory holding it as a run leaves it): the
    tokenizer under the run's own file name, as a checkpoint copies data.tokenizer."""
    vocab = -(-Tokenizer(tokenizer).vocab_size // 64) * 64
    model = tiny_hf_model(variant, tmp_path / "hf", vocab_size=vocab)
    shipped = "tokenizer.model" if tokenizer.suffix == ".model" else "tokenizer.json"
    shutil.copy(tokenizer, tmp_path / "hf" / shipped)
    args = ["--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "m"), "--divisible-by", "64"]
    assert convert(["hf-to-megatron", *args]) == 0
    weights = tmp_path / "m" / "model"
    (weights / shipped).rename(weights / run_name)
    write_files_list(weights)  # the files as the run wrote them
    return model, tmp_path / "m"


def readers_load(export: Path, run_tokenizer: Path, tokens: torch.Tensor) -> torch.Tensor:
    """What each reader of `export` gets, checked: transformers' AutoTokenizer encodes as
    the run's tokenizer; del-eval's loader takes it (its tokenizer the run's); returns
    AutoModelForCausalLM's logits of `tokens`."""
    import transformers

    from del_megatron.evaluation.backends import load_model

    ours = Tokenizer(run_tokenizer)
    auto = transformers.AutoTokenizer.from_pretrained(export)
    assert auto.encode(TEXT, add_special_tokens=False) == ours.encode(TEXT)
    loaded = load_model(export, torch.device("cpu"))
    assert loaded.tokenizer.fingerprint == ours.fingerprint
    assert loaded.tokenizer.encode(TEXT) == ours.encode(TEXT)
    model = transformers.AutoModelForCausalLM.from_pretrained(export).float().eval()
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize(
    ("run_name", "variant", "exported"),
    [
        ("digits-sp.model", "llama-mha", "tokenizer.model"),
        ("my-bpe.json", "llama3.2-tied", "tokenizer.json"),
    ],
)
def test_a_tokenizer_of_any_name_is_exported_as_transformers_names_it(
    run_name, variant, exported, tmp_path, capsys, synth_tokenizer, synth_llama3_tokenizer
):
    """A SentencePiece model and a Hugging Face tokenizer file, each under a name of the
    run's: the export holds it as tokenizer.model / tokenizer.json with a
    tokenizer_config.json; AutoTokenizer, del-eval's loader and AutoModelForCausalLM load it
    (the model's logits the original's). Before: digits-sp.model copied as it was named (no
    reader found it), my-bpe.json not exported at all."""
    source = synth_tokenizer if run_name.endswith(".model") else synth_llama3_tokenizer
    run_tokenizer = tmp_path / run_name
    shutil.copy(source, run_tokenizer)
    model, weights = run_weights(tmp_path, run_tokenizer, run_name, variant)
    out = tmp_path / "export"
    capsys.readouterr()
    assert convert(["megatron-to-hf", "--checkpoint", str(weights), "--out", str(out)]) == 0
    said = capsys.readouterr().out
    tokens = torch.randint(0, 800, (2, 13), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(tokens).logits
    assert torch.allclose(readers_load(out, run_tokenizer, tokens), expected, atol=1e-5)
    assert {exported, "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    assert not (out / run_name).exists()
    assert f"tokenizer {run_name})" in said and "AutoTokenizer.from_pretrained(" in said, said


@pytest.mark.slow
def test_a_run_whose_tokenizer_is_digits_sp_model_exports_for_del_eval(
    tmp_path, synth_tokenizer, synth_shards
):
    """The issue's run: data.tokenizer=.../digits-sp.model, one step, its checkpoint exported
    by del-convert and evaluated by del-eval (exit 0: before, exit 2 "no tokenizer.json or
    tokenizer.model"); transformers' logits of the export equal del-eval's checkpoint
    backend's (megatron-core's forward) within 1e-4."""
    from del_megatron.evaluation.backends import load_model

    run_tokenizer = tmp_path / "digits-sp.model"
    shutil.copy(synth_tokenizer, run_tokenizer)
    tree = yaml.safe_load((ROOT / "configs" / "tiny_cpu.yaml").read_text())
    tree["data"] |= {"tokenizer": str(run_tokenizer), "sources": [{"manifest": str(synth_shards)}]}
    tree["eval"]["sources"] = []
    tree["parallel"]["tensor_parallel"] = 1
    tree["train"] |= {"steps": 1, "global_batch_size": 8, "seq_len": 64}
    tree["logging"] = {"wandb": "disabled", "progress_bar": False}
    tree["output_dir"] = str(tmp_path / "run")
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(tree))
    env = torchrun_env()  # one thread per process, as the launchers run it
    trained = run_python("-m del_megatron.cli.train", "--config", str(config), env=env)
    assert trained.returncode == 0, trained.stderr[-3000:]
    checkpoint = tmp_path / "run" / "checkpoints" / "step-0000001"
    assert (checkpoint / "model" / "digits-sp.model").is_file()
    export = tmp_path / "hf"
    exported = run_python(
        "-m del_megatron.cli.convert", "megatron-to-hf", "--checkpoint", str(checkpoint),
        "--out", str(export), env=env,
    )  # fmt: skip
    assert exported.returncode == 0, exported.stderr[-3000:]
    evaluated = run_python(
        "-m del_megatron.cli.eval", str(export), "--heldout", str(synth_shards),
        "--max-batches", "1", "--out", str(tmp_path / "eval"), env=env,
    )  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert json.loads((tmp_path / "eval" / "results.json").read_text())
    tokens = torch.randint(0, 800, (2, 17), generator=torch.Generator().manual_seed(5))
    got = readers_load(export, run_tokenizer, tokens)[..., :800]
    reference = load_model(checkpoint, torch.device("cpu")).forward(tokens)
    assert torch.allclose(got, reference, atol=1e-4), (got - reference).abs().max()


def test_an_export_that_would_not_load_is_one_line_and_not_put_in_place(
    tmp_path, capsys, monkeypatch, synth_tokenizer
):
    """Each reader's failure, made on purpose, stops del-convert before its output is put in
    place: the tokenizer under the run's name (the old export: AutoTokenizer finds nothing),
    a config.json that ties the embeddings of untied weights (AutoModelForCausalLM's class
    has no lm_head.weight), a tokenizer_config.json whose class encodes otherwise. Each is
    one line naming the reader, exit 2, and the earlier export in --out is left whole."""
    run_tokenizer = tmp_path / "digits-sp.model"
    shutil.copy(synth_tokenizer, run_tokenizer)
    _, weights = run_weights(tmp_path, run_tokenizer, "digits-sp.model", "llama-mha")
    out = tmp_path / "export"
    assert convert(["megatron-to-hf", "--checkpoint", str(weights), "--out", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def under_the_runs_name(tokenizer):
        return {tokenizer.path.name: tokenizer.path}

    def tied(arch, dtype):
        config = hf_config(arch, dtype)
        config.tie_word_embeddings = True
        return config

    def another_class(tokenizer):
        files = dict(real_files(tokenizer))
        files["tokenizer_config.json"] = json.dumps({"tokenizer_class": "GPT2Tokenizer"})
        return files

    hf_config, real_files = conversion.hf_config, conversion.hf_tokenizer_files
    for patch, said in [
        (("hf_tokenizer_files", under_the_runs_name), "does not load in transformers' AutoTok"),
        (("hf_config", tied), "tensors missing [], unexpected ['lm_head.weight']"),
        (("hf_tokenizer_files", another_class), "as the run tokenized: transformers' AutoTok"),
    ]:
        with monkeypatch.context() as patched:
            patched.setattr(conversion, *patch)
            capsys.readouterr()
            code = convert(["megatron-to-hf", "--checkpoint", str(weights), "--out", str(out)])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1, (patch[0], err)
        assert err.startswith(f"del-convert megatron-to-hf: error: the export to {out} does not")
        assert said in err, err
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # untouched
        assert not list(tmp_path.glob(".tmp-*")) and not list(tmp_path.glob("*.tmp*"))


def test_weights_without_a_tokenizer_say_what_is_missing(tmp_path, capsys, synth_tokenizer):
    """Weights with no tokenizer file: the export is the model alone, and del-convert says
    so instead of promising that AutoTokenizer loads it."""
    _, weights = run_weights(tmp_path, synth_tokenizer, "tokenizer.model", "llama-mha")
    (weights / "model" / "tokenizer.model").unlink()
    write_files_list(weights / "model")
    out = tmp_path / "export"
    capsys.readouterr()
    assert convert(["megatron-to-hf", "--checkpoint", str(weights), "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "no tokenizer beside the weights" in said and "AutoTokenizer" not in said, said
    assert not list(out.glob("tokenizer*"))
