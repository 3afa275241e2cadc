"""The run config: ≥15 distinct mistakes, each one line naming the field and exit status 2;
--dry-run on a valid config; the committed DeepSpeed JSON files are the generated ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from data_tools.build import build_shards
from del_megatron.cli.train import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def valid(tmp_path, synth_tokenizer, synth_shards) -> Path:
    tree = yaml.safe_load((ROOT / "configs" / "tiny_cpu.yaml").read_text())
    tree["data"]["tokenizer"] = str(synth_tokenizer)
    tree["data"]["sources"] = [{"manifest": str(synth_shards)}]
    tree["eval"]["sources"] = [{"manifest": str(synth_shards)}]
    tree["output_dir"] = str(tmp_path / "run")
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_dry_run_prints_resolved_config_and_layout(valid, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    code, out, err = run(capsys, "--config", str(valid), "--dry-run", "optim.lr=1e-3")
    assert code == 0, err
    layout = json.loads(out.split("# layout: ", 1)[1])
    assert layout["data_parallel"] == 2 and layout["tensor_parallel"] == 2
    assert layout["gradient_accumulation"] == 1
    assert yaml.safe_load(out.split("# layout", 1)[0])["optim"]["lr"] == 1e-3
    # which of megatron's fusions are on, and why (models/spec.choose_fusions)
    assert "# fusions: bias_activation_fusion off: cpu: megatron's fusions are CUDA" in out


MISTAKES = [
    # (overrides, WORLD_SIZE, expected text in the one line)
    (["optim.lrr=1"], 2, "optim.lrr: unknown field; did you mean optim.lr?"),
    (["trainer.steps=3"], 2, "trainer: unknown field; did you mean train?"),
    (["zzz=1"], 2, "zzz: unknown field (the config has model, loss, parallel, optim,"),
    (["optim.lr=-1"], 2, "optim.lr: Input should be greater than 0"),
    (
        ["parallel.tensor_parallel=3"],
        3,
        "parallel.tensor_parallel=3 must divide model.num_attention_heads=4",
    ),
    (
        ["parallel.tensor_parallel=4"],
        4,
        "parallel.tensor_parallel=4 must divide model.num_query_groups=2",
    ),
    ([], 3, "world size 3 is not a multiple of parallel.tensor_parallel=2"),
    (
        ["train.global_batch_size=24"],
        4,
        "train.global_batch_size=24 is not a multiple of train.micro_batch_size x data "
        "parallel = 8 x 2",
    ),
    (
        ["train.global_batch_size=12"],
        2,
        "train.global_batch_size=12 is not a multiple of train.micro_batch_size=8",
    ),
    (["train.seq_len=1024"], 2, "train.seq_len=1024 exceeds model.max_position_embeddings=256"),
    (["loss.kind=focal"], 2, "loss.kind: Input should be"),
    (
        ["loss.kind=ntl_was", "loss.include_decimal_point=true"],
        2,
        "include_decimal_point=True needs kind='del'",
    ),
    (["parallel.zero_stage=4"], 2, "parallel.zero_stage: Input should be"),
    (["parallel.sequence_parallel=true"], 2, "parallel.sequence_parallel=true is not supported"),
    (["optim.min_lr=1"], 2, "optim.min_lr=1.0 exceeds optim.lr=0.003"),
    (
        ["data.tokenizer=/nope/tokenizer.model"],
        2,
        "data.tokenizer: tokenizer not found: /nope/tokenizer.model",
    ),
    (["model.vocab_size=512"], 2, "model.vocab_size=512 is smaller than the tokenizer's"),
    (
        ["data.sources=[{manifest: /nope/manifest.json}]"],
        2,
        "data.sources: /nope/manifest.json: no such file",
    ),
    (
        ["eval.sources=[{manifest: /nope/heldout.json}]"],
        2,
        "eval.sources: /nope/heldout.json: no such file",
    ),
    (
        ["data.sources=[{manifest: m.json, weight: 0}]"],
        2,
        "data.sources.0.weight: Input should be greater than 0",
    ),
    (["optim.lr"], 2, "override 'optim.lr' is not of the form section.field=value"),
    (["train.steps=ten"], 2, "train.steps: Input should be a valid integer"),
]


@pytest.mark.parametrize(
    ("overrides", "world", "expected"), MISTAKES, ids=[m[2].split(":")[0][:40] for m in MISTAKES]
)
def test_mistake_gives_one_line_and_exit_2(valid, capsys, monkeypatch, overrides, world, expected):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    code, _, err = run(capsys, "--config", str(valid), "--dry-run", *overrides)
    assert code == 2
    assert err.count("\n") == 1 and "Traceback" not in err
    assert expected in err, err


def test_a_key_written_twice_is_refused_naming_it_and_both_places(tmp_path, capsys, valid):
    """Issue 37: `train: {steps: 6, ..., steps: 600}` trained 600 steps, the dry run showed
    600, nothing said (YAML keeps the last); overrides setting one field twice did the same."""
    text = valid.read_text()
    flow = tmp_path / "flow.yaml"
    flow.write_text(text.replace("train:\n", "train: {steps: 6, seq_len: 128, steps: 600}\nx:\n"))
    code, _, err = run(capsys, "--config", str(flow), "--dry-run")
    assert code == 2 and err.count("\n") == 1, err
    assert f"{flow}: train.steps is set twice (line " in err and ", columns " in err, err
    block = tmp_path / "block.yaml"
    lines = text.splitlines()
    at = lines.index("train:") + 1  # the line after it, 0-based
    steps = lines.index("  steps: 300", at)
    block.write_text("\n".join([*lines[:at], "  steps: 600", *lines[at:]]) + "\n")
    code, _, err = run(capsys, "--config", str(block), "--dry-run")
    assert code == 2 and err.count("\n") == 1, err
    assert f"train.steps is set twice (lines {at + 1} and {steps + 2}); keep one" in err, err
    twice = ["train.steps=6", "train.steps=60"]
    code, _, err = run(capsys, "--config", str(valid), "--dry-run", *twice)
    assert code == 2 and err.count("\n") == 1, err
    assert "override 'train.steps=60' sets train.steps again after 'train.steps=6'" in err
    code, _, err = run(
        capsys, "--config", str(valid), "--dry-run", "eval.sources=[{manifest: a, manifest: b}]"
    )
    assert code == 2 and "eval.sources.0.manifest is set twice" in err, err


def test_file_mistakes(
    tmp_path, capsys, valid, spm_merged_digits, spm_split_digits, synth_corpus, monkeypatch
):
    monkeypatch.setenv("WORLD_SIZE", "2")
    code, _, err = run(capsys, "--config", str(tmp_path / "missing.yaml"))
    assert code == 2 and "config file not found" in err
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: [unclosed\n")
    code, _, err = run(capsys, "--config", str(broken))
    assert code == 2 and "broken.yaml line" in err and "not valid YAML" in err
    # a tokenizer that merges digits
    code, _, err = run(
        capsys, "--config", str(valid), "--dry-run", f"data.tokenizer={spm_merged_digits}"
    )
    assert code == 2 and "data.tokenizer: tokenizer merges digits" in err
    # shards built with another tokenizer than the run's
    other = build_shards(
        [synth_corpus / "heldout.jsonl"], tmp_path / "other", spm_split_digits, progress=False
    )
    assert other.documents == 50
    code, _, err = run(
        capsys,
        "--config",
        str(valid),
        "--dry-run",
        f"data.sources=[{{manifest: {tmp_path / 'other' / 'manifest.json'}}}]",
    )
    assert code == 2 and "rebuild the shards with the training tokenizer" in err


def test_committed_deepspeed_json_is_generated(capsys):
    for zero in (1, 2, 3):
        code, out, _ = run(
            capsys,
            "--config",
            str(ROOT / "configs" / "mistral_7b.yaml"),
            "--deepspeed-json",
            "8",
            f"parallel.zero_stage={zero}",
        )
        assert code == 0
        committed = (ROOT / "configs" / "deepspeed" / f"mistral_7b_zero{zero}.json").read_text()
        assert json.loads(out) == json.loads(committed)


@pytest.mark.parametrize(
    "name",
    [
        "tiny_cpu",
        "llama2_7b",
        "codellama_7b",
        "mistral_7b",
        "qwen2.5_7b",
        "deepseek_math_7b",
        "llama3.1_8b",
    ],
)
def test_shipped_configs_validate(name):
    from del_megatron.config import load_run_config

    cfg = load_run_config(ROOT / "configs" / f"{name}.yaml")
    expected_alpha = 0.01 if name.startswith(("qwen", "deepseek")) else 0.1
    assert cfg.loss.kind == "del" and cfg.loss.alpha == expected_alpha
    if name == "codellama_7b":
        assert cfg.optim.lr == 2e-5
    elif name != "tiny_cpu":
        assert cfg.optim.lr == 5e-6


def test_a_cuda_run_is_checked_for_its_device_at_launch_not_in_a_dry_run_here(
    valid, capsys, monkeypatch
):
    """A dry run prepares a GPU job on a machine without GPUs (a login node): it notes the
    device; the run itself refuses to start without one."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    monkeypatch.setenv("WORLD_SIZE", "2")
    code, out, err = run(capsys, "--config", str(valid), "--dry-run", "train.device=cuda")
    assert code == 0, err
    assert "# note: no CUDA device here; train.device=cuda is checked at launch" in out
    assert "# fusions: chosen on each GPU node at start: bias_activation_fusion and " in out
    code, _, err = run(capsys, "--config", str(valid), "train.device=cuda")
    assert code == 2
    assert "train.device: device 'cuda' was requested but no CUDA device" in err
