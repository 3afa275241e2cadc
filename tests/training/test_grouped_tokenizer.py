"""The tiny CPU pipeline with a grouped tokenizer (byte-level BPE, Llama-3's pre-tokenizer,
every 1..3-digit string a token, trained by `data-tools tokenizer --style llama3`): del-train
at TP 2 with the grouped DEL, export to Hugging Face, del-eval's numeric metrics on it (per
digit slot). Each digit kind on grouped vocabulary shards is checked against the reference in
tests/distributed/workers/tp_loss.py (check_grouped); here every digit kind also trains
through the real `train` at TP 2, and `del` resumes bit for bit (one launch,
tests/distributed/workers/grouped_kinds.py)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from data_tools.build import build_shards
from del_megatron import DigitVocab
from del_megatron.cli.convert import main as convert

from ..distributed.launcher import ROOT, run_torchrun
from ..evaluation.test_del_eval import del_eval

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shards(synth_corpus, synth_llama3_tokenizer, tmp_path_factory):
    """The synthetic corpus in the grouped tokenizer's shards: train/ and heldout/."""
    out = tmp_path_factory.mktemp("grouped_shards")
    train = build_shards(
        [synth_corpus / "train.jsonl"], out / "train", synth_llama3_tokenizer, progress=False
    )
    assert train.documents == 600
    build_shards(
        [synth_corpus / "heldout.jsonl"], out / "heldout", synth_llama3_tokenizer,
        progress=False,
    )  # fmt: skip
    return out


def test_grouped_tokenizer_trains_exports_and_evaluates(tmp_path, shards, synth_llama3_tokenizer):
    vocab = DigitVocab.from_hf(synth_llama3_tokenizer)
    assert vocab.max_digits == 3 and vocab.missing_strings == ()
    out = run_torchrun(
        "-m del_megatron.cli.train",
        2,
        "--config",
        str(ROOT / "configs" / "tiny_cpu.yaml"),
        f"data.tokenizer={synth_llama3_tokenizer}",
        f"data.sources=[{{manifest: {shards / 'train' / 'manifest.json'}}}]",
        "eval.sources=[]",
        f"model.vocab_size={vocab.vocab_size}",
        "train.steps=3",
        "train.log_interval=1",
        "logging.wandb=disabled",
        f"output_dir={tmp_path / 'run'}",
    )
    assert "step 3/3 | loss" in out and "numeric" in out, out[-2000:]
    checkpoint = tmp_path / "run" / "checkpoints" / "step-0000003"
    assert (
        convert(["megatron-to-hf", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "hf")])
        == 0
    )
    del_eval(
        tmp_path / "hf", "--heldout", shards / "heldout" / "manifest.json",
        "--max-batches", "2", "--batch-size", "2", "--quiet", "--out", tmp_path / "eval",
    )  # fmt: skip
    numeric = json.loads((tmp_path / "eval" / "results.json").read_text())["numeric"]
    assert numeric["digits"] > numeric["numbers"] > 0  # digits counted per slot
    assert 0.0 <= numeric["digit_cond_acc"] <= 1.0


def test_grouped_tokenizer_every_digit_kind_and_resume_at_tp2(
    tmp_path, shards, synth_llama3_tokenizer
):
    """Issue 29, "Done when": each digit kind trains on the grouped vocabulary shards at TP 2
    (a finite loss and a finite, nonzero digit term), and `del` resumed from step 2 ends at
    step 4 with the straight run's weights, bit for bit, and its losses (2 ranks, 6 runs)."""
    vocab = DigitVocab.from_hf(synth_llama3_tokenizer)
    run_torchrun(
        "grouped_kinds.py", 2, str(synth_llama3_tokenizer),
        str(shards / "train" / "manifest.json"), str(vocab.vocab_size), str(tmp_path),
    )  # fmt: skip

    def rows(name):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r for r in map(json.loads, lines)}

    for kind in ("del_distance", "ntl_was", "ntl_mse", "dist2"):
        metrics = rows(kind)
        assert sorted(metrics) == [1, 2], kind
        for row in metrics.values():
            assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"]), (kind, row)
            assert math.isfinite(row["numeric"]) and row["numeric"] != 0.0, (kind, row)
    straight, resumed = rows("straight"), rows("resumed")
    assert sorted(resumed) == [3, 4]  # its own output directory: the steps it trained
    for step in (3, 4):
        for key in ("loss", "numeric", "grad_norm", "lr"):
            assert resumed[step][key] == straight[step][key], (step, key)
    final = [
        tmp_path / n / "checkpoints" / "step-0000004" / "model" for n in ("straight", "resumed")
    ]
    files = sorted(p.name for p in final[0].glob("*.safetensors"))
    assert files == ["tp00.safetensors", "tp01.safetensors"]
    for name in files:
        a, b = (load_file(str(d / name)) for d in final)
        assert a.keys() == b.keys() and a
        for key in a:
            assert torch.equal(a[key], b[key]), f"{name}:{key} differs after the resume"
