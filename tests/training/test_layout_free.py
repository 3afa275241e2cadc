"""Layout-free checkpoints (CPU, gloo): a checkpoint saved at any of four parallel layouts
(tensor parallel 1, 2 and 4, with a vocabulary padded differently at each) loads at every
other one with the fp32 master weights, both Adam moments and the Adam steps bit for bit;
an older checkpoint without that state is refused at another layout in one line; every
shipped config's vocabulary is stored alike and loads at tensor parallel 1, 2, 4 and 8; the
pieces (the streamed safetensors file, the layout comparison, the derived seeds) on their
own."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from del_megatron.training import checkpoint, layout_free

from ..distributed.launcher import ROOT, run_torchrun

# name -> (processes, tensor parallel, ZeRO stage); data parallel = processes / tensor parallel
LAYOUTS = {
    "tp4-dp1-zero1": (4, 4, 1),
    "tp1-dp2-zero2": (2, 1, 2),
    "tp1-dp2-zero3": (2, 1, 3),
    "tp2-dp2-zero1": (4, 2, 1),
}


# A vocabulary padded to another size at each tensor-parallel size (to a multiple of 128 x
# TP: 1152 rows at TP 1, 1280 at 2, 1536 at 4, where the last rank holds padding only), as
# CodeLlama's 32016 is between TP 1 and 2; the tiny config's 1024 pads alike at every size,
# which hid that a saved shape depended on the layout. Heads and query groups for TP 4.
VOCAB = ["model.vocab_size=1040", "model.make_vocab_size_divisible_by=128"]


def overrides(tokenizer, manifest) -> list[str]:
    return [
        *VOCAB,
        "model.num_attention_heads=8",
        "model.num_query_groups=4",
        f"data.tokenizer={tokenizer}",
        f"data.sources=[{{manifest: {manifest}}}]",
        "eval.sources=[]",
        "logging.wandb=disabled",
        "loss.kind=emo",  # its cost embedding is a tensor-parallel buffer the state keeps
        "train.steps=100",
        "train.seq_len=32",
        "train.micro_batch_size=4",
        "train.global_batch_size=8",  # accumulation 2 at data parallel 1, 1 at 2
    ]


def run_layout(work: Path, name: str, loads: list[Path], train: bool, tokenizer, manifest):
    """One torchrun at layout `name`: load and compare `loads`, then (train) 6 steps and a
    save; fails with the worker's errors."""
    nproc, tp, zero = LAYOUTS[name]
    # each layout its own seed, so its initial model differs: nothing is equal by luck
    seed = list(LAYOUTS).index(name)
    output = run_torchrun(
        "layout_free.py",
        nproc,
        str(work / name),
        ",".join(map(str, loads)) or "-",
        "1" if train else "0",
        str(ROOT / "configs" / "tiny_cpu.yaml"),
        *overrides(tokenizer, manifest),
        f"parallel.tensor_parallel={tp}",
        f"parallel.zero_stage={zero}",
        f"train.seed={seed}",
    )
    for path in loads:
        assert f"OK {path.parent.parent.name} step" in output, output[-3000:]
        assert "restored from the layout-free state" in output, output[-3000:]
    if train:
        assert "OK saved step" in output, output[-3000:]
    return output


@pytest.fixture(scope="module")
def saved_layouts(tmp_path_factory, synth_tokenizer, synth_shards) -> dict[str, Path]:
    """Each layout in turn loads every earlier layout's checkpoint (and compares), trains 6
    steps from there and saves: the first half of the pairs, and a checkpoint per layout."""
    work = tmp_path_factory.mktemp("layouts")
    saved: dict[str, Path] = {}
    for name in LAYOUTS:
        run_layout(work, name, list(saved.values()), True, synth_tokenizer, synth_shards)
        (saved[name],) = (work / name / "checkpoints").glob("step-*")
    return saved


@pytest.mark.slow
def test_every_layout_loads_every_other_bit_for_bit(
    saved_layouts, synth_tokenizer, synth_shards, tmp_path
):
    names = list(LAYOUTS)
    for i, name in enumerate(names[:-1]):  # the other direction: later layouts' checkpoints
        loads = [saved_layouts[n] for n in names[i + 1 :]]
        if i == 0:
            # and its own through DeepSpeed's path, then a save: DeepSpeed's ZeRO 1/2 load
            # unlinks the moments from the safe_get API (failed before ensure_adam_state)
            loads.append(saved_layouts[name])
        run_layout(tmp_path, name, loads, i == 0, synth_tokenizer, synth_shards)
    for path in saved_layouts.values():
        index = json.loads((path / "optim" / "index.json").read_text())
        nproc, tp, _ = LAYOUTS[path.parent.parent.name]
        writers = {p["writer"] for p in index["params"]}
        assert writers == set(range(nproc // tp))  # every data-parallel rank wrote a part
        files = sorted(f.name for f in (path / "optim").glob("*.safetensors"))
        assert files == [layout_free.file_name(t, d) for t in range(tp) for d in range(nproc // tp)]


@pytest.mark.slow
def test_older_checkpoint_at_another_layout_is_refused_in_one_line(
    saved_layouts, synth_tokenizer, synth_shards, tmp_path, capsys, monkeypatch
):
    from del_megatron.cli.train import main

    old = tmp_path / "old"
    shutil.copytree(saved_layouts["tp2-dp2-zero1"], old)
    shutil.rmtree(old / "optim")  # as written before the layout-free state existed
    meta = json.loads((old / "meta.json").read_text())
    for field in ("zero_stage", "layout_free"):
        meta.pop(field)
    (old / "meta.json").write_text(json.dumps(meta))
    monkeypatch.setenv("WORLD_SIZE", "2")
    config = str(ROOT / "configs" / "tiny_cpu.yaml")
    args = [*overrides(synth_tokenizer, synth_shards), f"output_dir={tmp_path / 'out'}"]
    code = main(
        ["--config", config, "--dry-run", "--resume", str(old), *args, "parallel.tensor_parallel=1"]
    )
    _, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "saved at tensor parallel 2 x data parallel 2 without the layout-free state" in err
    assert "resume at the saved layout (parallel.tensor_parallel=2 on 4 processes)" in err


def test_streamed_safetensors_file_reads_back(tmp_path):
    from safetensors import safe_open

    tensors = {
        "a/fp32": torch.randn(3, 5),
        "b/exp_avg": torch.randn(7),
        "c/x": torch.randn(2, 1),
        "d/fp32": torch.zeros(0, 5),  # a shard of padding only stores no rows
        "e/fp32": torch.randn(1, 5),
    }
    path = tmp_path / "streamed.safetensors"
    metadata = {"steps": json.dumps({"a": 3})}
    with open(path, "wb") as handle:
        handle.write(
            layout_free._header([(k, tuple(v.shape)) for k, v in tensors.items()], metadata)
        )
        for value in tensors.values():
            layout_free._write_tensor(handle, value)
    with safe_open(str(path), framework="pt") as handle:
        assert handle.metadata() == metadata
        for name, value in tensors.items():
            assert torch.equal(handle.get_tensor(name), value)


def test_layout_comparison_and_derived_seeds():
    saved = {"tensor_parallel": 2, "data_parallel": 1, "zero_stage": None}
    same = {"tensor_parallel": 2, "data_parallel": 1, "zero_stage": 3}
    assert not checkpoint.changed(saved, same)  # unrecorded stage: DeepSpeed decides
    assert checkpoint.changed({**saved, "zero_stage": 1}, same)
    assert checkpoint.changed(saved, {**same, "data_parallel": 2})
    seeds = {checkpoint.derived_seed(7, step, dp) for step in (10, 11) for dp in (0, 1, 2)}
    assert len(seeds) == 6 and all(0 <= s < 2**63 for s in seeds)
    assert checkpoint.derived_seed(7, 10, 1) == checkpoint.derived_seed(7, 10, 1)
    assert checkpoint.derived_seed(8, 10, 1) != checkpoint.derived_seed(7, 10, 1)


@pytest.mark.parametrize("stride", [1, 2])
def test_slice_plan_reads_what_merge_then_split_gives(stride):
    from del_megatron.models.sharding import merge, split

    full = torch.arange(2 * 24 * stride * 3, dtype=torch.float32).reshape(2, 24 * stride, 3)
    for saved_world in (1, 2, 3, 4):
        shards = [split(full, (1, stride), r, saved_world) for r in range(saved_world)]
        assert torch.equal(merge(shards, (1, stride)), full)
        for world in (1, 2, 4, 6):
            for rank in range(world):
                plan = layout_free.slice_plan(24 * stride, stride, saved_world, rank, world)
                read = torch.cat([shards[o][:, a:b] for o, a, b in plan], dim=1)
                assert torch.equal(read, split(full, (1, stride), rank, world)), plan


# The tensor-parallel sizes between which a shipped vocabulary pads to different sizes
# (a multiple of make_vocab_size_divisible_by 128 x TP): where a saved shape that depended on
# the layout failed.
PADS_APART = {"codellama_7b": (1, 2), "llama2_7b": (2, 4), "qwen2.5_7b": (4, 8)}


@pytest.mark.parametrize("config", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_vocabulary_is_stored_alike_and_loads_at_tp_1_2_4_8(config):
    """Per shipped config's vocabulary (one column a row: the arithmetic is the rows'): the
    rows each saved tensor-parallel rank stores make the tokenizer's [vocab] at every size,
    and every rank at every size reads from them (and from format 1's files, which stored the
    padding too) a shard of the model's shape holding its rows of the padded vocabulary,
    zero past the tokenizer's."""
    from del_megatron.config import load_run_config
    from del_megatron.models.sharding import split

    arch = load_run_config(config).model
    vocab, sizes = arch.vocab_size, (1, 2, 4, 8)
    if config.stem in PADS_APART:
        a, b = PADS_APART[config.stem]
        assert arch.padded_vocab_size(a) != arch.padded_vocab_size(b)
    real = torch.arange(1, vocab + 1, dtype=torch.float32).unsqueeze(1)  # no real row is 0
    for saved_tp in sizes:
        saved_rows = arch.padded_vocab_size(saved_tp) // saved_tp
        stored = [
            real[r * saved_rows :][: layout_free.stored_rows(vocab, saved_rows, r)]
            for r in range(saved_tp)
        ]
        assert torch.equal(torch.cat(stored), real)  # the same whatever the layout
        format1 = [torch.cat([s, torch.full((saved_rows - len(s), 1), -1.0)]) for s in stored]
        for tp in sizes:
            padded = arch.padded_vocab_size(tp)
            model = torch.cat([real, torch.zeros(padded - vocab, 1)])
            for rank in range(tp):
                shape = (padded // tp, 1)  # the model's shard at this size
                plan = layout_free.vocab_plan(vocab, saved_rows, shape[0], rank)
                for shards in (stored, format1):
                    got = layout_free.with_padding([shards[o][a:b] for o, a, b in plan], shape)
                    assert torch.equal(got, split(model, (0, 1), rank, tp)), (saved_tp, tp, rank)


@pytest.mark.slow
def test_del_train_resumes_at_another_tensor_parallel_size(tmp_path, synth_tokenizer, synth_shards):
    from .test_data_state import assert_data_state_record
    from .test_resume import command, losses, run

    out = tmp_path / "run"
    # the vocabulary pads to 1152 rows at TP 1, 1280 at TP 2 (before: "embedding.word_embeddings
    # .weight has shape (576, 128) at tensor parallel 2, the model (640, 128)", exit 1)
    args = (out, synth_tokenizer, synth_shards, *VOCAB)
    run(command(*args, "train.steps=4", "parallel.zero_stage=2", tp=1))
    proc = run(
        [
            *command(*args, "train.steps=8", nproc=4, tp=2),
            "--resume",
            "auto",
        ]
    )  # 2 processes' loader states for 4 ranks: an IndexError before
    assert (
        "resuming at tensor parallel 2 x data parallel 2, ZeRO 1 (saved at tensor parallel 1 x "
        "data parallel 2, ZeRO 2)" in proc.stdout
    )
    assert "at step 4" in proc.stdout
    assert sorted(losses(out)) == list(range(1, 9))
    # the data state of TP 2 x DP 2 (tests/training/test_data_state.py): one record per
    # data-parallel rank, gathered from tensor-parallel rank 0s over the data-parallel group
    assert_data_state_record(out / "checkpoints" / "step-0000008", dp_size=2)
