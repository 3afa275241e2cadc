"""The tiny CPU pipeline with a grouped tokenizer (byte-level BPE, Llama-3's pre-tokenizer,
every 1..3-digit string a token, trained by `data-tools tokenizer --style llama3`): del-train
at TP 2 with the grouped DEL, export to Hugging Face, del-eval's numeric metrics on it (per
digit slot). Each digit kind on grouped vocabulary shards is checked against the reference in
tests/distributed/workers/tp_loss.py (check_grouped); this is the one launch end to end."""

from __future__ import annotations

import json

import pytest

from data_tools.build import build_shards
from del_megatron import DigitVocab
from del_megatron.cli.convert import main as convert

from ..distributed.launcher import ROOT, run_torchrun
from ..evaluation.test_del_eval import del_eval

pytestmark = pytest.mark.slow


def test_grouped_tokenizer_trains_exports_and_evaluates(
    tmp_path, synth_corpus, synth_llama3_tokenizer
):
    vocab = DigitVocab.from_hf(synth_llama3_tokenizer)
    assert vocab.max_digits == 3 and vocab.missing_strings == ()
    train = build_shards(
        [synth_corpus / "train.jsonl"], tmp_path / "train", synth_llama3_tokenizer, progress=False
    )
    assert train.documents == 600
    build_shards(
        [synth_corpus / "heldout.jsonl"], tmp_path / "heldout", synth_llama3_tokenizer,
        progress=False,
    )  # fmt: skip
    out = run_torchrun(
        "-m del_megatron.cli.train",
        2,
        "--config",
        str(ROOT / "configs" / "tiny_cpu.yaml"),
        f"data.tokenizer={synth_llama3_tokenizer}",
        f"data.sources=[{{manifest: {tmp_path / 'train' / 'manifest.json'}}}]",
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
        tmp_path / "hf", "--heldout", tmp_path / "heldout" / "manifest.json",
        "--max-batches", "2", "--batch-size", "2", "--quiet", "--out", tmp_path / "eval",
    )  # fmt: skip
    numeric = json.loads((tmp_path / "eval" / "results.json").read_text())["numeric"]
    assert numeric["digits"] > numeric["numbers"] > 0  # digits counted per slot
    assert 0.0 <= numeric["digit_cond_acc"] <= 1.0
