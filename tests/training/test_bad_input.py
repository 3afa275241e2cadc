"""del-train with mistakes a user can make: each gives one line naming the field or file,
exit status 2, no traceback, and writes nothing (the dry run runs every check the real run
makes before its first step: manifests and their shards, output directory, wandb
credentials, the checkpoint to resume from)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from del_megatron.cli.train import main
from del_megatron.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[2]


def snapshot(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def setup(tmp_path, synth_tokenizer, synth_shards, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    shards = tmp_path / "shards"
    shutil.copytree(synth_shards.parent, shards)
    tree = yaml.safe_load((ROOT / "configs" / "tiny_cpu.yaml").read_text())
    tree["data"]["tokenizer"] = str(synth_tokenizer)
    tree["data"]["sources"] = [{"manifest": str(shards / "manifest.json")}]
    tree["eval"]["sources"] = []
    tree["output_dir"] = str(tmp_path / "run")
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(tree))
    return tmp_path, config, shards, Tokenizer(synth_tokenizer).fingerprint, tree


def fake_checkpoint(out: Path, tree: dict, fingerprint: str, *, world: int = 2) -> Path:
    """The files of a checkpoint that del-train checks before loading (DeepSpeed's are not
    needed for the checks)."""
    from del_megatron.config import parse_run_config

    cfg = parse_run_config(tree)
    path = out / "checkpoints" / "step-0000004"
    (path / "model").mkdir(parents=True)
    (path / "rng").mkdir()
    meta = {"step": 4, "world_size": world, "data_parallel": 1, "tensor_parallel": 2}
    (path / "meta.json").write_text(json.dumps({**meta, "tokenizer": fingerprint}))
    (path / "model" / "arch.json").write_text(cfg.model.model_dump_json())
    (path / "data_state.json").write_text(json.dumps([{}] * world))
    for rank in range(world):
        torch.save({"torch": torch.get_rng_state()}, path / "rng" / f"rank{rank:05d}.pt")
    # a files list naming none of its files: complete by the list, and any file may be
    # damaged below for the check that reads it (del_megatron/inputs.py checks the list)
    (path / "files.json").write_text(json.dumps({"format": 1, "files": {}}))
    return path


def with_optimizer_files(path: Path) -> None:
    """Give a fake checkpoint (saved at TP 2 x DP 1, ZeRO 1) the optimizer files a resume
    reads, in their formats: DeepSpeed's per-rank files and the layout-free state."""
    from safetensors.torch import save_file

    meta = json.loads((path / "meta.json").read_text())
    (path / "meta.json").write_text(json.dumps({**meta, "zero_stage": 1}))
    (path / "state").mkdir()
    for tp in range(2):
        torch.save({}, path / "state" / f"mp_rank_{tp:02d}_model_states.pt")
        torch.save({}, path / "state" / f"zero_pp_rank_0_mp_rank_{tp:02d}_optim_states.pt")
    (path / "optim").mkdir()
    params = [{"name": "w", "canonical": "w", "partition": None, "shape": [2], "writer": 0}]
    index = {"format": 1, "tensor_parallel": 2, "data_parallel": 1, "params": params}
    (path / "optim" / "index.json").write_text(json.dumps(index))
    for tp in range(2):
        save_file({"w/fp32": torch.zeros(2)}, str(path / "optim" / f"tp{tp:02d}-dp00.safetensors"))


def damage(case: str, tmp: Path, shards: Path, fingerprint: str, tree: dict) -> list[str]:
    """Prepare `case`; returns the extra arguments it needs."""
    manifest = shards / "manifest.json"
    data = json.loads(manifest.read_text())
    out = Path(tree["output_dir"])
    if case == "missing shard":
        (shards / data["shards"][1]["name"]).unlink()
    elif case == "no shards":
        manifest.write_text(json.dumps({**data, "shards": [], "documents": 0, "tokens": 0}))
    elif case == "shard of another size":
        path = shards / data["shards"][0]["name"]
        path.write_bytes(path.read_bytes()[:-512])
    elif case == "manifest not JSON":
        manifest.write_text("{not json")
    elif case == "manifest from the future":
        manifest.write_text(json.dumps({**data, "version": 99}))
    elif case == "output under a file":
        (tmp / "afile").write_text("x")
        return [f"output_dir={tmp / 'afile' / 'run'}"]
    elif case.startswith("checkpoint"):
        path = fake_checkpoint(out, tree, fingerprint)
        if case == "checkpoint data_state cut":
            state = path / "data_state.json"
            state.write_text(state.read_text()[:5])
        elif case == "checkpoint meta cut":
            (path / "meta.json").write_text('{"step": 4, "wor')
        elif case == "checkpoint of another architecture":
            arch = json.loads((path / "model" / "arch.json").read_text())
            (path / "model" / "arch.json").write_text(json.dumps({**arch, "hidden_size": 256}))
        elif case == "checkpoint missing rng":
            (path / "rng" / "rank00001.pt").unlink()
        elif case in ("checkpoint of two sources", "checkpoint of another worker count"):
            # as the quick start with --gsm8k leaves it: two sources, one worker
            state = {"version": 1, "dp_size": 1, "dp_rank": 0, "consumed": 8}
            state["num_workers"] = 1 if case == "checkpoint of two sources" else 2
            state["workers"] = {"0": {"readers": [{}, {}] if "two" in case else [{}]}}
            (path / "data_state.json").write_text(json.dumps([state, state]))
        elif case.startswith(("checkpoint missing its ", "checkpoint with a layout-free")):
            with_optimizer_files(path)
            missing = {
                "checkpoint missing its DeepSpeed optimizer file": "state/"
                "zero_pp_rank_0_mp_rank_01_optim_states.pt",
                "checkpoint missing its layout-free file": "optim/tp01-dp00.safetensors",
                "checkpoint with a layout-free file cut short": None,
            }[case]
            if missing:
                (path / missing).unlink()
            else:
                cut = path / "optim" / "tp00-dp00.safetensors"
                cut.write_bytes(cut.read_bytes()[:-4])
        elif case == "checkpoint of another tokenizer":
            meta = json.loads((path / "meta.json").read_text())
            (path / "meta.json").write_text(json.dumps({**meta, "tokenizer": "vocab-other"}))
        elif case == "checkpoint without its files list":
            (path / "files.json").unlink()
        elif case == "checkpoint with a listed file of another size":
            listed = {"bytes": path.joinpath("meta.json").stat().st_size + 1, "sha256": "0"}
            index = {"format": 1, "files": {"meta.json": listed}}
            (path / "files.json").write_text(json.dumps(index))
        elif case == "checkpoint still being written":
            return ["--resume", str(path.rename(path.with_name(".tmp-step-0000004")))]
        elif case == "checkpoint step that does not exist":
            return ["--resume", str(path.with_name("step-0000040"))]
        if case == "checkpoint over a fresh start":  # del-train's default is --resume same
            return ["--resume", "none"]
        return ["--resume", str(path)]
    elif case == "init.hf missing":
        return ["init.hf=models/nowhere", "init.hf_hub_id=org/model", "data.tokenizer=null"]
    elif case == "init.hf broken config":
        (tmp / "hf").mkdir()
        (tmp / "hf" / "config.json").write_text("{broken")
        return [f"init.hf={tmp / 'hf'}"]
    elif case == "empty tokenizer file":
        (tmp / "empty.model").write_bytes(b"")
        return [f"data.tokenizer={tmp / 'empty.model'}"]
    return []


CASES = [
    # (case, extra overrides / options, expected in the one line)
    ("bool for an int", ["train.steps=true"], "train.steps: Input should be a valid integer"),
    ("int for a bool", ["train.activation_checkpointing=1"], "Input should be a valid boolean"),
    ("bool for a float", ["optim.lr=true"], "optim.lr: Input should be a valid number"),
    ("empty key part", ["train..steps=3"], "is not of the form section.field=value"),
    ("no key", ["=3"], "is not of the form section.field=value"),
    ("bad YAML value", ["optim.lr=[1"], "override optim.lr line 1: not valid YAML"),
    ("section is a value", ["optim.lr.x=1"], "override optim.lr.x: lr is not a section"),
    ("missing shard", [], "listed in"),
    ("no shards", [], "the manifest lists no shards"),
    ("shard of another size", [], "(truncated or replaced?)"),
    ("manifest not JSON", [], "not a shard manifest"),
    ("manifest from the future", [], "manifest version 99 is newer"),
    ("wandb online without key", ["logging.wandb=online"], "needs WANDB_API_KEY"),
    ("output under a file", [], "is not a directory"),
    ("resume from nowhere", ["--resume", "/nowhere"], "--resume /nowhere: does not exist"),
    ("checkpoint data_state cut", [], "data_state.json: unreadable"),
    ("checkpoint meta cut", [], "meta.json: unreadable"),
    ("checkpoint of another architecture", [], "saved with model.hidden_size=256"),
    ("checkpoint missing rng", [], "rank00001.pt: missing"),
    ("checkpoint of another tokenizer", [], "saved with another tokenizer"),
    # inputs that are not whole (issue 37; before: the first three were resumed from)
    ("checkpoint without its files list", [], "step-0000004: no files.json (the list of its"),
    ("checkpoint still being written", [], ".tmp-step-0000004: a directory still being writ"),
    ("checkpoint with a listed file of another size", [], "meta.json: unreadable ("),
    (
        "checkpoint step that does not exist",
        [],
        "step-0000040: does not exist (",  # ... checkpoints holds step-0000004)
    ),
    # the files the load reads, checked by the dry run as by the run (before: the dry run
    # reported resume_step, the run refused after building the model)
    (
        "checkpoint missing its DeepSpeed optimizer file",
        [],
        "zero_pp_rank_0_mp_rank_01_optim_states.pt: missing (the resume reads it)",
    ),
    (
        "checkpoint missing its layout-free file",
        ["parallel.tensor_parallel=1"],
        "optim/tp01-dp00.safetensors: missing (the resume reads it)",
    ),
    (
        "checkpoint with a layout-free file cut short",
        ["parallel.tensor_parallel=1"],
        "tp00-dp00.safetensors: unreadable (",
    ),
    (
        "checkpoint of two sources",
        [],
        "its data-loader state has 2 sources and data.sources has 1: resume with the "
        "data.sources it was saved with",
    ),
    (
        "checkpoint of another worker count",
        [],
        "saved with data.num_workers=2, this run has 1: resume with data.num_workers=2",
    ),
    (
        "checkpoint over a fresh start",
        [],
        "holds checkpoints of an earlier run (newest step-0000004)",
    ),
    ("init.hf missing", [], "hf download org/model --local-dir models/nowhere"),
    ("init.hf broken config", [], "config.json: not JSON"),
    ("empty tokenizer file", [], "data.tokenizer:"),
    (
        "seq_len beyond the window",
        ["model.family=mistral", "model.sliding_window=64"],
        "exceeds model.sliding_window=64",
    ),
]


@pytest.mark.parametrize(("case", "extra", "expected"), CASES, ids=[c[0] for c in CASES])
def test_dry_run_mistakes(case, extra, expected, setup, capsys):
    tmp, config, shards, fingerprint, tree = setup
    args = damage(case, tmp, shards, fingerprint, tree)
    before = snapshot(tmp)
    code = main(["--config", str(config), "--dry-run", *extra, *args])
    _, err = capsys.readouterr()
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("del-train: error: "), err
    assert "Traceback" not in err
    assert expected in err, err
    assert snapshot(tmp) == before  # the dry run wrote nothing


def test_a_deterministic_run_on_an_nccl_algorithm_that_varies_is_refused_by_the_checks(
    setup, capsys, monkeypatch
):
    """What the run would refuse at set-up (runtime.deterministic_algorithms), --check and
    --dry-run refuse first, in one line. Failed before: the checks passed."""
    _, config, *_ = setup
    monkeypatch.setenv("NCCL_ALGO", "NVLS")
    for mode in ("--check", "--dry-run"):
        code = main(["--config", str(config), mode, "train.deterministic=true"])
        _, err = capsys.readouterr()
        assert code == 2 and err.count("\n") == 1, err
        assert "NCCL_ALGO=Ring or Tree (set: NVLS)" in err, err
    monkeypatch.setenv("NCCL_ALGO", "Tree")
    assert main(["--config", str(config), "--check", "train.deterministic=true"]) == 0


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--deepspeed-json", "0"], "--deepspeed-json: must be at least 1"),
        (["--gpu-memory", "-1"], "--gpu-memory: must be greater than 0"),
    ],
)
def test_option_mistakes(argv, expected, setup, capsys):
    _, config, *_ = setup
    with pytest.raises(SystemExit) as exit_:
        main(["--config", str(config), *argv])
    assert exit_.value.code == 2
    assert expected in capsys.readouterr().err


def test_a_mistake_is_left_for_the_launcher(setup, capsys, monkeypatch, tmp_path):
    """Under launch/torchrun.sh (DEL_USER_ERROR_DIR set) the rank's one line is also left in
    that directory, for the script to end with it and status 2."""
    _, config, *_ = setup
    errors = tmp_path / "errors"
    errors.mkdir()
    monkeypatch.setenv("DEL_USER_ERROR_DIR", str(errors))
    monkeypatch.setenv("RANK", "1")
    assert main(["--config", str(config), "optim.lrr=1"]) == 2
    line = capsys.readouterr().err
    assert [p.name for p in errors.iterdir()] == ["rank-1"]
    assert (errors / "rank-1").read_text() == line


def test_every_rank_says_why_it_stops_on_its_own_stderr(setup, capsys, monkeypatch):
    """Peers (issue 37): rank 1 started alone (RANK=1 WORLD_SIZE=2 LOCAL_RANK=1) stopped on a
    mistake with status 2 and nothing on stderr or stdout: only a node's first rank spoke,
    for launchers that collect every rank's line (ours). Where none collects it, each rank
    says it, once a node for a line its ranks share (plain srun: one job, one node here)."""
    tmp, config, *_ = setup
    monkeypatch.setattr("tempfile.tempdir", str(tmp))  # where a node keeps the lines said
    monkeypatch.delenv("DEL_USER_ERROR_DIR", raising=False)
    for name, value in (("RANK", "1"), ("LOCAL_RANK", "1"), ("SLURM_JOB_ID", "4242")):
        monkeypatch.setenv(name, value)
    assert main(["--config", str(config), "--dry-run", "train.steps=0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("del-train: error: train.steps: Input should be greater than 0"), err
    monkeypatch.setenv("RANK", "2")  # another rank of the node, the same line: said once
    assert main(["--config", str(config), "--dry-run", "train.steps=0"]) == 2
    assert capsys.readouterr().err == ""
    assert main(["--config", str(config), "--dry-run", "train.steps=-1"]) == 2  # another
    assert "train.steps: Input should be greater than 0" in capsys.readouterr().err
