"""Layout-free checkpoints (CPU, gloo): a checkpoint saved at any of four parallel layouts
(tensor parallel 1, 2 and 4, with a vocabulary padded differently at each) loads at every
other one with the fp32 master weights, both Adam moments and the Adam steps bit for bit;
an older checkpoint without that state is refused at another layout in one line; every
shipped config's vocabulary is stored alike and loads at tensor parallel 1, 2, 4 and 8; the
pieces (the streamed safetensors file, the layout comparison, the derived seeds) on their
own."""

from __future__ import annotations

import itertools
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from del_megatron.checkpoint import optim_format, rng
from del_megatron.checkpoint.layout import Layout
from del_megatron.checksums import hash_file

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
            # and its own: at the saved layout the layout-free state is read too (the
            # checkpoint's one optimizer state), then a save
            loads.append(saved_layouts[name])
        run_layout(tmp_path, name, loads, i == 0, synth_tokenizer, synth_shards)
    for path in saved_layouts.values():
        index = json.loads((path / "optim" / "index.json").read_text())
        nproc, tp, _ = LAYOUTS[path.parent.parent.name]
        written = {(f["tp"], f["dp"]) for p in index["params"] for f in p["fragments"]}
        # every rank wrote its own part
        assert written == {(t, d) for t in range(tp) for d in range(nproc // tp)}
        files = sorted(f.name for f in (path / "optim").glob("*.safetensors"))
        assert files == [
            optim_format.file_name(t, d) for t in range(tp) for d in range(nproc // tp)
        ]


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
    # its files.json as that save would have written it: no optim/, this meta.json
    index = json.loads((old / "files.json").read_text())
    index["files"] = {k: v for k, v in index["files"].items() if not k.startswith("optim/")}
    index["files"]["meta.json"] = hash_file(old / "meta.json")
    (old / "files.json").write_text(json.dumps(index))
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
    # DeepSpeed's own state at its own layout, asked for by the megatron engine: the line
    # names the engine too (before: only the layout, which the run already had)
    monkeypatch.setenv("WORLD_SIZE", "4")
    code = main(
        ["--config", config, "--dry-run", "--resume", str(old), *args, "train.engine=megatron"]
    )
    _, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "(train.engine=deepspeed parallel.tensor_parallel=2 on 4 processes)" in err, err


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
            optim_format._header([(k, tuple(v.shape)) for k, v in tensors.items()], metadata)
        )
        for value in tensors.values():
            optim_format._write_tensor(handle, value)
    with safe_open(str(path), framework="pt") as handle:
        assert handle.metadata() == metadata
        for name, value in tensors.items():
            assert torch.equal(handle.get_tensor(name), value)


def test_layout_comparison_and_derived_seeds():
    saved = Layout("deepspeed", tensor_parallel=2, data_parallel=1, zero_stage=None)
    same = Layout("deepspeed", tensor_parallel=2, data_parallel=1, zero_stage=3)
    assert not same.differs_from(saved)  # unrecorded stage: DeepSpeed decides
    assert same.differs_from(replace(saved, zero_stage=1))
    assert replace(same, data_parallel=2).differs_from(saved)
    seeds = {rng.derived_seed(7, step, dp) for step in (10, 11) for dp in (0, 1, 2)}
    assert len(seeds) == 6 and all(0 <= s < 2**63 for s in seeds)
    assert rng.derived_seed(7, 10, 1) == rng.derived_seed(7, 10, 1)
    assert rng.derived_seed(8, 10, 1) != rng.derived_seed(7, 10, 1)


@pytest.mark.parametrize("stride", [1, 2])
def test_slice_plan_reads_what_merge_then_split_gives(stride):
    from del_megatron.models.sharding import merge, split

    full = torch.arange(2 * 24 * stride * 3, dtype=torch.float32).reshape(2, 24 * stride, 3)
    for saved_world in (1, 2, 3, 4):
        shards = [split(full, (1, stride), r, saved_world) for r in range(saved_world)]
        assert torch.equal(merge(shards, (1, stride)), full)
        for world in (1, 2, 4, 6):
            for rank in range(world):
                plan = optim_format.slice_plan(24 * stride, stride, saved_world, rank, world)
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
            real[r * saved_rows :][: optim_format.stored_rows(vocab, saved_rows, r)]
            for r in range(saved_tp)
        ]
        assert torch.equal(torch.cat(stored), real)  # the same whatever the layout
        format1 = [torch.cat([s, torch.full((saved_rows - len(s), 1), -1.0)]) for s in stored]
        for tp in sizes:
            padded = arch.padded_vocab_size(tp)
            model = torch.cat([real, torch.zeros(padded - vocab, 1)])
            for rank in range(tp):
                shape = (padded // tp, 1)  # the model's shard at this size
                plan = optim_format.vocab_plan(vocab, saved_rows, shape[0], rank)
                for shards in (stored, format1):
                    got = optim_format.with_padding([shards[o][a:b] for o, a, b in plan], shape)
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


def ranges(numel: int, parts: int) -> list[tuple[int, int]]:
    """ZeRO-like ranges of a flattened shard over `parts` data-parallel ranks, uneven (the
    first rank's cut off one element early), empty ones dropped."""
    size = -(-numel // parts)
    cuts = [min(numel, max(0, r * size - (r > 0))) for r in range(parts)] + [numel]
    return [(a, b) for a, b in itertools.pairwise(cuts) if b > a]


class MemoryFiles:
    """optim_format.OpenFiles over in-memory 1-D tensors, counting the elements read."""

    def __init__(self, tensors):
        self.tensors, self.directory, self.read_elements = tensors, Path("mem"), 0

    def read(self, file, tensor, start, stop):
        self.read_elements += stop - start
        return self.tensors[(file, tensor)][start:stop]


def saved_fragments(shards: list[torch.Tensor], dp: int):
    """(index entry's fragments, MemoryFiles) of `shards` saved at data parallel `dp`."""
    found, tensors = [], {}
    for tp, shard in enumerate(shards):
        flat = shard.flatten()
        for d, (a, b) in enumerate(ranges(flat.numel(), dp)):
            file = optim_format.file_name(tp, d)
            found.append({"tp": tp, "dp": d, "start": a, "stop": b, "file": file})
            tensors[(file, "w/fp32")] = flat[a:b]
    return found, MemoryFiles(tensors)


@pytest.mark.parametrize("dim,stride", [(0, 1), (1, 1), (0, 2), (1, 2)])
def test_flat_runs_read_each_new_range_as_merge_then_split_gives(dim, stride):
    """Every rank of every (tensor parallel, data parallel) layout reads, from fragments
    saved at every other layout, its ZeRO range of its new shard, and reads nothing else."""
    from del_megatron.models.sharding import split

    shape = [6, 5, 3]
    shape[dim] = 24 * stride
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    for saved_tp in (1, 2, 4):
        shards = [split(full, (dim, stride), r, saved_tp) for r in range(saved_tp)]
        for saved_dp in (1, 3):
            found, files = saved_fragments(shards, saved_dp)
            entry = {
                "name": "w",
                "fragments": found,
                "partition": [dim, stride],
                "shape": list(shards[0].shape),
                "vocab_rows": None,
            }
            for tp in (1, 2, 4):
                for rank in range(tp):
                    mine = split(full, (dim, stride), rank, tp)
                    d, pieces = optim_format.new_shard(
                        entry, saved_tp, tuple(mine.shape), tp_rank=rank, tp_size=tp, vocab=None
                    )
                    for a, b in ranges(mine.numel(), 2):
                        files.read_elements = 0
                        runs = optim_format.flat_runs(
                            pieces, mine.shape, d, shards[0].shape[d], a, b
                        )
                        got = optim_format.from_fragments(files, entry, "fp32", runs, b - a)
                        assert torch.equal(got, mine.flatten()[a:b]), (saved_tp, saved_dp, tp, rank)
                        assert files.read_elements == b - a
            if saved_tp == 2:  # the same layout: one run per fragment it overlaps
                d, pieces = optim_format.new_shard(
                    entry, 2, tuple(shards[1].shape), tp_rank=1, tp_size=2, vocab=None
                )
                runs = optim_format.flat_runs(
                    pieces, shards[1].shape, d, shards[1].shape[d], 0, shards[1].numel()
                )
                assert runs == [(0, 1, 0, shards[1].numel())]


def test_flat_runs_read_the_tokenizer_rows_and_leave_padding_zero():
    """A vocabulary tensor saved at TP 1 (1040 rows: 1152 padded, 1040 stored) read at
    TP 4 (1536 padded: 384 rows a rank, the last of padding only) by 3 data-parallel ranks."""
    from del_megatron.models.sharding import split

    vocab, h = 1040, 3
    real = torch.arange(1, vocab * h + 1, dtype=torch.float32).reshape(vocab, h)
    found, files = saved_fragments([real], 2)
    entry = {
        "name": "w",
        "fragments": found,
        "partition": [0, 1],
        "shape": [1152, h],
        "vocab_rows": vocab,
    }
    model = torch.cat([real, torch.zeros(1536 - vocab, h)])
    for rank in range(4):
        mine = split(model, (0, 1), rank, 4)
        d, pieces = optim_format.new_shard(
            entry, 1, tuple(mine.shape), tp_rank=rank, tp_size=4, vocab=vocab
        )
        for a, b in ranges(mine.numel(), 3):
            files.read_elements = 0
            runs = optim_format.flat_runs(pieces, mine.shape, d, 1152, a, b)
            got = optim_format.from_fragments(files, entry, "fp32", runs, b - a)
            assert torch.equal(got, mine.flatten()[a:b]), (rank, a, b)
            assert files.read_elements == int(mine.flatten()[a:b].count_nonzero())


def test_written_pieces_read_back_by_byte_range(tmp_path):
    """write_pieces' 1-D tensors and buffers read back whole and by range through OpenFiles;
    a range of a tensor the file lacks is one line naming the file."""
    pieces = [
        ("a", 4, 10, {k: torch.randn(6) for k in optim_format.KEYS}),
        ("b", 0, 1, {k: torch.randn(1) for k in optim_format.KEYS}),
    ]
    buffers = [("c", torch.randn(2, 3))]
    (tmp_path / "optim").mkdir()
    entry = optim_format.write_pieces(
        tmp_path / "optim" / "f.safetensors", pieces, buffers, {"x": "1"}
    )
    assert entry["bytes"] == (tmp_path / "optim" / "f.safetensors").stat().st_size
    with optim_format.OpenFiles(tmp_path) as files:
        for name, _, _, values in pieces:
            for key, value in values.items():
                assert torch.equal(
                    files.read("f.safetensors", f"{name}/{key}", 0, len(value)), value
                )
                assert torch.equal(files.read("f.safetensors", f"{name}/{key}", 1, 2), value[1:2])
        with pytest.raises(optim_format.LayoutFreeError, match="f.safetensors: unreadable"):
            files.read("f.safetensors", "d/fp32", 0, 1)


def test_an_index_of_format_3_without_fragments_is_one_line(tmp_path):
    """What the load maps is each parameter's fragments: an index that says format 3 and
    lacks them is refused when read (before: a KeyError traceback in the middle of the
    load, on the ranks that reached it)."""
    (tmp_path / "optim").mkdir()
    params = [{"name": "w", "canonical": "w", "partition": None, "shape": [2], "writer": 0}]
    index = {"format": 3, "tensor_parallel": 1, "data_parallel": 1, "params": params}
    (tmp_path / "optim" / "index.json").write_text(json.dumps(index))
    with pytest.raises(optim_format.LayoutFreeError, match="index.json: unreadable") as refused:
        optim_format.read_index(tmp_path)
    assert "\n" not in str(refused.value)
    params[0]["fragments"] = []
    (tmp_path / "optim" / "index.json").write_text(json.dumps(index))
    assert optim_format.read_index(tmp_path)["format"] == 3
