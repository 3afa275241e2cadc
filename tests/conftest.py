"""Shared fixtures: tokenizers trained here (no network), corpora, the real Mistral model."""

from __future__ import annotations

import io
import os
import random
import subprocess
from pathlib import Path

import pytest

from tests.utils import end_process_group

LAST = ("tests/docker/",)


def pytest_collection_modifyitems(config, items):
    """The container tests last: their first setup waits for the images, which CI builds in
    the background (.ci/run) while everything else runs, rather than holding the suite up.
    DEL_MEGATRON_ONLY=1 (launch/test.sh's second run, in .venv312 on the newest
    megatron-core): only the tests marked `megatron`, whatever else selects (-m, paths)."""
    root = Path(str(config.rootpath))

    def last(item) -> bool:
        where = Path(str(item.path)).relative_to(root).as_posix()
        return where.startswith(LAST)

    items[:] = [i for i in items if not last(i)] + [i for i in items if last(i)]
    if os.environ.get("DEL_MEGATRON_ONLY") != "1":
        return
    others = [item for item in items if item.get_closest_marker("megatron") is None]
    config.hook.pytest_deselected(items=others)
    items[:] = [item for item in items if item.get_closest_marker("megatron") is not None]


SLOWEST_FILES = 15


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """After the slowest tests (--durations), the slowest files: the sum of their tests'
    setup, call and teardown, so that a file that grew shows at the end of every run
    (bench/suite_profile.py measures a whole run: wall, CPU, interpreter starts)."""
    per_file: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) in ("setup", "call", "teardown"):
                where = report.nodeid.split("::")[0]
                per_file[where] = per_file.get(where, 0.0) + report.duration
    if len(per_file) < 2:
        return
    slowest = sorted(per_file.items(), key=lambda item: -item[1])[:SLOWEST_FILES]
    terminalreporter.write_sep("=", f"slowest {len(slowest)} files")
    for where, seconds in slowest:
        terminalreporter.write_line(f"{seconds:8.1f}s {where}")
    terminalreporter.write_line(f"{sum(per_file.values()):8.1f}s in all {len(per_file)} files")


WORDS = (
    "the of and a to in is you that it he was for on are as with his they at be this have from "
    "or one had by word but not what all were we when your can said there use an each which she "
    "do how their if will up other about out many then them these so some her would make like"
).split()


def number_corpus(n_lines: int = 3000, seed: int = 0) -> list[str]:
    """Prose with prices, decimals, dates and thousands separators."""
    rng = random.Random(seed)
    lines = []
    for i in range(n_lines):
        a, b = rng.randint(0, 99999), rng.randint(0, 999)
        lines.append(
            " ".join(rng.choices(WORDS, k=8))
            + f" The price was {a}.{b:02d} dollars and {b} items on 2026-11-{i % 28 + 1:02d}, "
            f"total 1,000 units of {a * b}."
        )
    return lines


def train_sentencepiece(path: Path, *, split_digits: bool) -> Path:
    import sentencepiece as spm

    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(number_corpus()),
        model_writer=buffer,
        vocab_size=600,
        hard_vocab_limit=False,
        split_digits=split_digits,
        byte_fallback=True,
        normalization_rule_name="identity",
        minloglevel=2,
    )
    path.write_bytes(buffer.getvalue())
    return path


def train_byte_level_bpe(*, split_digits: bool):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    steps = [pre_tokenizers.ByteLevel(add_prefix_space=False)]
    if split_digits:
        steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<s>", "</s>"],
        show_progress=False,
    )
    tokenizer.train_from_iterator(number_corpus(), trainer)
    return tokenizer


@pytest.fixture(scope="session")
def spm_split_digits(tmp_path_factory) -> Path:
    return train_sentencepiece(tmp_path_factory.mktemp("spm") / "split.model", split_digits=True)


@pytest.fixture(scope="session")
def spm_merged_digits(tmp_path_factory) -> Path:
    return train_sentencepiece(tmp_path_factory.mktemp("spm") / "merged.model", split_digits=False)


@pytest.fixture(scope="session")
def bpe_split_digits():
    return train_byte_level_bpe(split_digits=True)


@pytest.fixture(scope="session")
def bpe_merged_digits():
    return train_byte_level_bpe(split_digits=False)


@pytest.fixture(scope="session")
def mistral_tokenizer_model() -> Path:
    """Mistral-7B's sentencepiece model, shipped as package data by mistral-common."""
    mistral_common = pytest.importorskip("mistral_common")
    path = Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1"
    if not path.is_file():
        pytest.skip("mistral-common does not ship tokenizer.model.v1")
    return path


@pytest.fixture(scope="session")
def synth_corpus(tmp_path_factory) -> Path:
    """data_tools synth: 600 training documents and 50 held-out problems."""
    from data_tools.synth import write_corpus

    out = tmp_path_factory.mktemp("synth")
    write_corpus(out, documents=600, heldout=50, seed=7)
    return out


def _synth_tokenizer(corpus: Path, out: Path, **options) -> Path:
    from data_tools.tokenizer_train import train_tokenizer

    return train_tokenizer([corpus / "train.jsonl"], out, **options)


@pytest.fixture(scope="session")
def synth_tokenizer(synth_corpus, tmp_path_factory) -> Path:
    """A sentencepiece tokenizer trained on the synthetic corpus by data_tools."""
    return _synth_tokenizer(
        synth_corpus, tmp_path_factory.mktemp("tok") / "tokenizer.model", vocab_size=800
    )


@pytest.fixture(scope="session")
def synth_llama3_tokenizer(synth_corpus, tmp_path_factory) -> Path:
    """A byte-level BPE with Llama-3's pre-tokenizer (digits grouped 1..3), by data_tools."""
    out = tmp_path_factory.mktemp("tok3") / "tokenizer.json"
    return _synth_tokenizer(synth_corpus, out, vocab_size=1600, style="llama3")


@pytest.fixture(scope="session")
def synth_shards(synth_corpus, synth_tokenizer, tmp_path_factory) -> Path:
    """The synthetic corpus as ~20 small shards; returns the manifest path."""
    from data_tools.build import build_shards

    out = tmp_path_factory.mktemp("shards")
    build_shards(
        [synth_corpus / "train.jsonl"], out, synth_tokenizer, shard_bytes=24 << 10, progress=False
    )
    return out / "manifest.json"


GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"


@pytest.fixture(autouse=True)
def _environment_restored():
    """Each test leaves os.environ as it found it: code under test writes RANK, WORLD_SIZE and
    LOCAL_RANK into it (parallel.init_distributed), and a value left behind reaches every
    later test's subprocesses (SLURM jobs ran at world size 16 after a device-binding test)."""
    before = dict(os.environ)
    yield
    if dict(os.environ) != before:
        os.environ.clear()
        os.environ.update(before)


@pytest.fixture(scope="session")
def gsm8k_train() -> Path:
    """GSM8K train (MIT), beside the checkout in ../shared; tests using it skip without it."""
    path = GSM8K / "train.jsonl"
    if not path.is_file():
        pytest.skip("../shared/data/gsm8k is not present")
    return path


@pytest.fixture(scope="module")
def group():
    """A one-process gloo group (the loss ops take a tensor-parallel group; DeepSpeed's engine
    joins the default group)."""
    import torch.distributed as dist

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    if started:
        end_process_group()


@pytest.fixture
def tmpfs(tmp_path):
    """mount(size, read_only=False): a small filesystem of its own (tmpfs, root only; the
    test is skipped elsewhere) to fill or to find read-only, unmounted after the test."""
    mounted = []

    def mount(size: str, read_only: bool = False) -> Path:
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        point = tmp_path / f"tmpfs{len(mounted)}"
        point.mkdir()
        options = f"size={size}" + (",ro" if read_only else "")
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)], capture_output=True
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", str(point)], check=False)
