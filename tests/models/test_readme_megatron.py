"""The README's Megatron-LM and Megatron-Bridge examples run as a user writes them, each in a
fresh interpreter, with what they need around them standing in (tests/loop_standins.py):
Megatron-LM's repository files beside the example, and each loop's `pretrain` (CUDA from its
first line) replaced by one that builds the model as that pretrain does, on the CPU, and runs
one step of the example's forward step and loss function. Needs megatron.training
(megatron-core 0.17+): the .venv312 run. Bridge's example runs in
tests/models/test_megatron_bridge.py, in the process that imported Bridge already."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys

import pytest

from tests.distributed.launcher import ROOT, torchrun_env
from tests.loop_standins import examples

pytestmark = pytest.mark.megatron

# Megatron-LM's arguments for a tiny model on the CPU, as a user's launch script gives them
ARGS = (
    "--num-layers 2 --hidden-size 32 --ffn-hidden-size 64 --num-attention-heads 4 "
    "--group-query-attention --num-query-groups 2 --normalization RMSNorm --swiglu "
    "--position-embedding-type rope --disable-bias-linear --untie-embeddings-and-output-weights "
    "--seq-length 16 --max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 2 "
    "--make-vocab-size-divisible-by 64 --lr 1e-3 --train-iters 1 --transformer-impl local "
    "--use-cpu-initialization --no-gradient-accumulation-fusion --no-bias-swiglu-fusion "
    "--no-bias-dropout-fusion --no-rope-fusion --no-masked-softmax-fusion "
    "--no-persist-layer-norm --calculate-per-token-loss"
).split()


def test_the_readme_has_the_three_examples():
    assert sorted(examples()) == [
        "Megatron-Bridge 0.6.2",
        "Megatron-LM's current pretrain_gpt.py",
        "Megatron-LM's pretrain_gpt.py at core_v0.16.1",
    ]
    assert "--calculate-per-token-loss" in (ROOT / "README.md").read_text()


def run_example(name: str, tmp_path, *argv: str) -> str:
    from tests.loop_standins import EXAMPLE_TAGS, write_checkout

    write_checkout(tmp_path, EXAMPLE_TAGS[name])  # the files of the version it is written for
    script = tmp_path / "example.py"
    prelude = "import tests.loop_standins as s\ns.install()\n"
    script.write_text(prelude + examples()[name])
    done = subprocess.run(
        [sys.executable, str(script), *argv],
        cwd=tmp_path,
        env=torchrun_env(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]
    return done.stdout


needs_megatron_training = pytest.mark.skipif(
    importlib.util.find_spec("megatron.training") is None,
    reason="megatron.training ships with megatron-core 0.17+ (.venv312)",
)


EXAMPLES = [
    ("Megatron-LM's current pretrain_gpt.py", "config container"),
    ("Megatron-LM's pretrain_gpt.py at core_v0.16.1", "model_provider"),
]


@needs_megatron_training
@pytest.mark.parametrize(("name", "form"), EXAMPLES)
def test_the_megatron_lm_example_runs(name, form, tmp_path, spm_split_digits):
    shutil.copy(spm_split_digits, tmp_path / "tokenizer.model")
    tokenizer = (
        "--tokenizer-type",
        "SentencePieceTokenizer",
        "--tokenizer-model",
        "tokenizer.model",
    )
    output = run_example(name, tmp_path, *ARGS, *tokenizer)
    assert f"OK {form}: lm loss, objective, numeric, digit_acc" in output


@needs_megatron_training
@pytest.mark.parametrize(("name", "form"), EXAMPLES)
def test_the_megatron_lm_example_runs_with_a_hugging_face_tokenizer(
    name, form, tmp_path, synth_llama3_tokenizer
):
    """--tokenizer-type HuggingFaceTokenizer (the Llama-3 family: digits grouped 1..3), which
    the examples' former DigitVocab.from_sentencepiece(args.tokenizer_model) could not read."""
    (tmp_path / "hf").mkdir()
    shutil.copy(synth_llama3_tokenizer, tmp_path / "hf" / "tokenizer.json")
    tokenizer = ("--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "hf")
    output = run_example(name, tmp_path, *ARGS, *tokenizer)
    assert f"OK {form}: lm loss, objective, numeric, digit_acc" in output
