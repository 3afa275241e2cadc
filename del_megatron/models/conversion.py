"""Hugging Face checkpoint <-> del-megatron weights directory, both directions, a tensor at a
time through the name table (models/hf_names.py), writing the output completely or not at
all. del-convert (cli/convert.py) parses arguments and calls these; init.hf reads through
`open_hf` too.

Memory: hf_to_megatron holds one tensor-parallel rank's shards; export_hf one output shard
plus one tensor.

An export is for its readers: the run's tokenizer goes under the names transformers looks
for (`hf_tokenizer_files`), whatever the run called it, and the export is checked the way
its readers load it before it is put in place (`check_export`: transformers' AutoConfig,
AutoModelForCausalLM's class and tensors, AutoTokenizer, del-eval's tokenizer), so an
export that would not load is one line and no output.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..losses.vocab import TokenizerError
from .architecture import LlamaArchitecture
from .hf_config import ConversionError, architecture_from_hf, hf_config
from .hf_names import megatron_names
from .hf_tensors import check_hf_tensors, hf_tensors, rank_shard
from .weight_files import (
    DTYPES,
    HFCheckpoint,
    HFWriter,
    MegatronWeights,
    tokenizer_in,
    write_weights,
)


def open_hf(directory: str | Path, *, divisible_by: int) -> tuple[HFCheckpoint, LlamaArchitecture]:
    """A Hugging Face checkpoint (headers only) and its architecture, every tensor checked
    against it; ConversionError naming the field or tensor otherwise."""
    checkpoint = HFCheckpoint(directory)
    arch = architecture_from_hf(checkpoint.config, divisible_by=divisible_by)
    check_hf_tensors(checkpoint.shapes, arch)
    return checkpoint, arch


def hf_to_megatron(
    checkpoint: HFCheckpoint,
    arch: LlamaArchitecture,
    out: str | Path,
    *,
    tensor_parallel: int,
    force: bool = False,
    wait: bool = False,
) -> None:
    """<out>/model/: `tensor_parallel` shard files of `checkpoint` (opened by `open_hf`, its
    heads and groups divisible by `tensor_parallel`), arch.json and the tokenizer."""
    arch.check_tensor_parallel(tensor_parallel)
    padded = arch.padded_vocab_size(tensor_parallel)
    names = megatron_names(arch)
    shards = (  # one rank in memory at a time
        {n: rank_shard(checkpoint.read, n, arch, padded, rank, tensor_parallel) for n in names}
        for rank in range(tensor_parallel)
    )
    write_weights(out, shards, arch, tokenizer_in(checkpoint.directory), force=force, wait=wait)


@dataclass(frozen=True)
class Exported:
    """What export_hf wrote: the model family, the weights' dtype and the tokenizer file
    (None: the weights had none, so AutoTokenizer has nothing to load)."""

    family: str
    dtype: str
    tokenizer: str | None

    def __str__(self) -> str:
        return f"{self.family}, {self.dtype}"


def export_hf(
    checkpoint: str | Path,
    out: str | Path,
    *,
    dtype: str | None = None,
    force: bool = False,
    wait: bool = False,
) -> Exported:
    """A del-megatron weights directory (a checkpoint's model/, or hf_to_megatron's) as a
    Hugging Face checkpoint. dtype: the stored (training) dtype unless given. The output
    appears complete and checked as its readers load it (`check_export`), or not at all
    (HFWriter)."""
    from ..tokenizer import Tokenizer

    weights = MegatronWeights(checkpoint)
    weights.verify()
    arch = weights.arch
    dtype_name = dtype or weights.dtype
    config = hf_config(arch, dtype_name)  # refuses what the family cannot express, first
    source = weights.tokenizer()
    tokenizer = Tokenizer(source) if source is not None else None  # refuses a bad file first
    writer = HFWriter(out, force=force, wait=wait)
    try:
        for name in megatron_names(arch):
            for hf_name, tensor in hf_tensors(name, weights.full(name), arch):
                writer.add(hf_name, tensor.to(DTYPES[dtype_name]))
        if tokenizer is not None:
            for name, content in hf_tokenizer_files(tokenizer).items():
                if isinstance(content, Path):
                    shutil.copyfile(content, writer.tmp / name)
                else:
                    (writer.tmp / name).write_text(content)
        writer.finish(config, check=lambda staging: check_export(staging, tokenizer, Path(out)))
    except BaseException:
        writer.abandon()
        raise
    return Exported(arch.family, dtype_name, None if source is None else source.name)


def hf_tokenizer_files(tokenizer) -> dict[str, Path | str]:
    """{file name in the export: the run's tokenizer file (Path) or text}: the names
    transformers looks for, whatever the run called its file. A SentencePiece model is
    tokenizer.model, with the tokenizer_config.json that makes AutoTokenizer build a
    LlamaTokenizer from it (the class Llama and Mistral ship sentencepiece models with;
    without it transformers 5.12 guesses a TokenizersBackend that encodes another first
    token) adding no BOS or EOS, as the run encoded (`Tokenizer.encode`, data_tools);
    a Hugging Face tokenizer file is tokenizer.json, loaded as it is."""
    if tokenizer.path.suffix == ".model":
        import sentencepiece

        sp = sentencepiece.SentencePieceProcessor(model_file=str(tokenizer.path))
        special = {
            f"{kind}_token": sp.id_to_piece(i)
            for kind, i in (("unk", sp.unk_id()), ("bos", sp.bos_id()), ("eos", sp.eos_id()))
            if i >= 0
        }
        settings = {
            "tokenizer_class": "LlamaTokenizer",
            "add_bos_token": False,
            "add_eos_token": False,
            "legacy": False,
            **special,
        }
        return {
            "tokenizer.model": tokenizer.path,
            "tokenizer_config.json": json.dumps(settings, indent=1),
        }
    import tokenizers

    settings = {"tokenizer_class": "PreTrainedTokenizerFast"}
    try:
        eos = tokenizer.eos_id
    except TokenizerError:  # no end-of-text token: none to name
        pass
    else:
        settings["eos_token"] = tokenizers.Tokenizer.from_file(str(tokenizer.path)).id_to_token(eos)
    return {
        "tokenizer.json": tokenizer.path,
        "tokenizer_config.json": json.dumps(settings, indent=1),
    }


# Text whose encoding the export's tokenizers must repeat: digits alone and in runs, signs,
# decimals, leading, doubled and trailing spaces, a newline, and words.
PROBE_TEXT = "Tom has 12 apples; he buys 345 more: 12+345=357.\n  Two  spaces, 0.5 and -7 "


def check_export(directory: Path, tokenizer, shown: Path) -> None:
    """`directory` (a complete export, to be put in place as `shown`) loads as its readers
    load it, else ConversionError in one line naming what did not: transformers' AutoConfig
    and the AutoModelForCausalLM class it names, built on the meta device (no memory), whose
    parameters must be exactly the tensors on disk with their shapes (what from_pretrained
    would find missing, unexpected or mismatched; reading the weights whole would need the
    model's size in memory, which the conversion avoids); AutoTokenizer and del-eval's
    tokenizer lookup, each encoding `PROBE_TEXT` as the run's tokenizer does (`tokenizer`
    None: the export has none)."""
    import warnings

    import torch
    import transformers

    from ..evaluation.backends import check_vocabulary
    from ..tokenizer import Tokenizer
    from .weight_files import tokenizer_in

    where = f"the export to {shown} does not load"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = transformers.AutoConfig.from_pretrained(directory)
            with torch.device("meta"):
                model = transformers.AutoModelForCausalLM.from_config(config)
    except Exception as err:
        raise ConversionError(
            f"{where} in transformers' AutoModelForCausalLM: {_line(err)}"
        ) from None
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}  # tied: once
    stored = {name: tuple(shape) for name, shape in HFCheckpoint(directory).shapes.items()}
    if stored != expected:
        missing = sorted(set(expected) - set(stored))
        unexpected = sorted(set(stored) - set(expected))
        shapes = sorted(n for n in set(stored) & set(expected) if stored[n] != expected[n])
        raise ConversionError(
            f"{where} as {type(model).__name__}: tensors missing {missing[:3]}, unexpected "
            f"{unexpected[:3]}, of another shape {shapes[:3]}"
        )
    if tokenizer is None:
        return
    want = tokenizer.encode(PROBE_TEXT)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            auto = transformers.AutoTokenizer.from_pretrained(directory)
        got = auto.encode(PROBE_TEXT, add_special_tokens=False)
    except Exception as err:
        raise ConversionError(f"{where} in transformers' AutoTokenizer: {_line(err)}") from None
    if got != want:
        raise ConversionError(
            f"{where} as the run tokenized: transformers' AutoTokenizer "
            f"({type(auto).__name__}) gives {got[:8]}..., the run's {tokenizer.path.name} "
            f"{want[:8]}..."
        )
    found = tokenizer_in(directory)  # del-eval's lookup (evaluation/backends.py)
    if found is None or Tokenizer(found).encode(PROBE_TEXT) != want:
        raise ConversionError(f"{where} in del-eval: its tokenizer is not the run's")
    check_vocabulary(config.vocab_size, Tokenizer(found), f"{shown}/config.json")


def _line(err: Exception) -> str:
    """A library's message on one line (transformers' run over several)."""
    return " ".join(str(err).split()) or type(err).__name__
