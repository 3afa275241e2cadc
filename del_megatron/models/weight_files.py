"""Weights on disk: Hugging Face checkpoint directories and del-megatron weights directories,
read lazily (a tensor, or the slice of it a rank needs, at a time) and written atomically.

Hugging Face: config.json, model.safetensors or model-XXXXX-of-YYYYY.safetensors with
model.safetensors.index.json, tokenizer files.

del-megatron (`<dir>/model/`, inside every training checkpoint and written by del-convert):
tpNN.safetensors, one per tensor-parallel rank (tpNN-ppKK.safetensors, one per rank and
pipeline stage, from a pipelined run), canonical megatron names with decoder layers by their
global number, in the training dtype; arch.json (LlamaArchitecture, the family included);
the run's tokenizer file.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from ..checksums import INDEX, hash_file
from ..inputs import check_whole, files_list, require_directory
from ..outputs import Ours, abandon_output, begin_output, commit_output
from .architecture import LlamaArchitecture
from .hf_config import ConversionError
from .hf_tensors import canonical, pad_vocab
from .sharding import merge, partition_of, split

WEIGHTS = "model"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def _safe_open(path: Path):
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as err:
        raise ConversionError(f"{path}: not a readable safetensors file ({err})") from None


def _slice(handle, name: str, dim: int | None, start: int | None, stop: int | None):
    view = handle.get_slice(name)
    if dim is None:
        return view[:]
    index = [slice(None)] * len(view.get_shape())
    index[dim] = slice(start, stop)
    return view[tuple(index)]


def _tensor_files(files: dict[str, Path]) -> tuple[dict[str, Path], dict[str, tuple[int, ...]]]:
    """{tensor: file} and {tensor: shape} from the headers of `files` (name -> path)."""
    where, shapes = {}, {}
    for path in files.values():
        if not path.is_file():
            raise ConversionError(f"{path}: no such file")
        with _safe_open(path) as handle:
            for name in handle.keys():
                where[name] = path
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return where, shapes


class HFCheckpoint:
    """A Hugging Face checkpoint directory. Opening reads config.json and the safetensors
    headers only; `read` opens the file holding a tensor, copies out the requested slice and
    closes it, so memory holds that slice, not the file."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        require_directory(self.directory)
        config_path = self.directory / "config.json"
        if not config_path.is_file():
            raise ConversionError(f"{config_path}: no such file (not a Hugging Face checkpoint)")
        try:
            self.config: dict[str, Any] = json.loads(config_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ConversionError(f"{config_path}: not JSON ({err})") from None
        index = self.directory / "model.safetensors.index.json"
        if index.is_file():
            try:
                names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
                raise ConversionError(f"{index}: not a safetensors index ({err})") from None
        else:
            names = ["model.safetensors"]
        self.files, self.shapes = _tensor_files({n: self.directory / n for n in names})

    def read(self, name: str, dim: int | None, start: int | None, stop: int | None):
        if name not in self.files:
            raise ConversionError(f"tensor {name} is missing from {self.directory}")
        with _safe_open(self.files[name]) as handle:
            return _slice(handle, name, dim, start, stop)


class MegatronWeights:
    """A del-megatron weights directory (<dir>/model/), read a tensor at a time."""

    def __init__(self, directory: str | Path) -> None:
        # whole or refused, before a byte is read: not a checkpoint still being written, its
        # files list there, every listed file at its size (del_megatron/inputs.py)
        check_whole(Path(directory))
        self.root = Path(directory) / WEIGHTS
        arch_path = self.root / "arch.json"
        if not arch_path.is_file():
            raise ConversionError(
                f"{arch_path}: no such file (not a del-megatron weights directory)"
            )
        try:
            self.arch = LlamaArchitecture.model_validate_json(arch_path.read_text())
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(map(str, first["loc"])) or "file"
            raise ConversionError(
                f"{arch_path}: not an architecture record ({where}: {first['msg']})"
            ) from None
        self.stages = _rank_files(self.root)  # [tensor-parallel rank][stage] -> file
        self.paths = [path for stages in self.stages for path in stages]
        self.tensor_parallel = len(self.stages)
        self.names: dict[str, str] = {}  # canonical -> as stored
        self.stage_of: dict[str, int] = {}  # canonical -> the stage's file holding it
        for stage, path in enumerate(self.stages[0]):
            with _safe_open(path) as handle:
                for stored in handle.keys():
                    self.names[canonical(stored)] = stored
                    self.stage_of[canonical(stored)] = stage
                first = next(iter(handle.keys()))
                dtype = handle.get_slice(first).get_dtype()
                if dtype not in SAFETENSORS_DTYPES:
                    raise ConversionError(f"{path}: weights stored as {dtype}")
                self.dtype = SAFETENSORS_DTYPES[dtype]  # the training dtype, e.g. "bfloat16"
        embedding = "embedding.word_embeddings.weight"
        if embedding not in self.names:
            raise ConversionError(f"{self.root}: no tensor {embedding}")
        with _safe_open(self.stages[0][self.stage_of[embedding]]) as handle:
            rows = handle.get_slice(self.names[embedding]).get_shape()[0]
        self.padded_vocab = rows * self.tensor_parallel

    def verify(self) -> None:
        """The weight files against the checksums of the checkpoint they are part of
        (files.json, del_megatron/checksums.py), for a reader of every file (del-convert,
        del-eval); a weights directory without the index is taken as it is."""
        from ..checksums import verify_listed

        listed = files_list(self.root.parent)
        if listed is None:  # refused when opened; a directory changed since
            raise ConversionError(f"{self.root.parent}: no files list (files.json)")
        prefix = f"{WEIGHTS}/" if listed == self.root.parent else ""
        problem = verify_listed(listed, [f"{prefix}{p.name}" for p in self.paths])
        if problem:
            raise ConversionError(problem)

    def shard(self, name: str, rank: int) -> torch.Tensor:
        """Rank `rank`'s stored shard of the canonical tensor `name`."""
        if name not in self.names:
            raise ConversionError(f"{self.root}: no tensor {name}")
        with _safe_open(self.stages[rank][self.stage_of[name]]) as handle:
            return handle.get_tensor(self.names[name])

    def full(self, name: str) -> torch.Tensor:
        """The whole (TP 1) canonical tensor `name`, merged from every rank's file."""
        return merge([self.shard(name, r) for r in range(self.tensor_parallel)], partition_of(name))

    def rank_shard(self, name: str, rank: int, world: int, padded_vocab: int) -> torch.Tensor:
        """`name` as rank `rank` of `world` holds it with the vocabulary padded to
        `padded_vocab`: read as stored when the layout is the same, else re-cut."""
        if world == self.tensor_parallel and padded_vocab == self.padded_vocab:
            return self.shard(name, rank)
        full = pad_vocab(name, self.full(name), self.arch, padded_vocab)
        return split(full, partition_of(name), rank, world)

    def tokenizer(self) -> Path | None:
        return tokenizer_of_weights(self.root.parent)


def rank_file(rank: int, stage: int | None = None) -> str:
    """A tensor-parallel rank's weights file (of one pipeline stage: `stage`)."""
    return (
        f"tp{rank:02d}.safetensors" if stage is None else f"tp{rank:02d}-pp{stage:02d}.safetensors"
    )


def _rank_files(root: Path) -> list[list[Path]]:
    """[tensor-parallel rank][pipeline stage] -> file: tp00 ... tpNN, or tp00-pp00 ... (a
    pipelined run's), every rank with the same stages; anything else is refused."""
    found = sorted(root.glob("tp*.safetensors"))
    if not found:
        raise ConversionError(f"{root}: no tpNN.safetensors files")
    stages = sorted({p.stem.partition("-")[2] for p in found})
    ranks = len({p.stem.partition("-")[0] for p in found})
    expected = [
        [root / (f"tp{r:02d}" + (f"-{s}" if s else "") + ".safetensors") for s in stages]
        for r in range(ranks)
    ]
    pipelined = stages != [""]
    if sorted(p for row in expected for p in row) != found or (
        pipelined and stages != [f"pp{k:02d}" for k in range(len(stages))]
    ):
        last = f"tp{ranks - 1:02d}" + ("-ppKK" if pipelined else "")
        raise ConversionError(f"{root}: the weight files are not tp00 to {last}.safetensors")
    return expected


def tokenizer_of_weights(directory: str | Path) -> Path | None:
    """The run's tokenizer file in a weights directory, under the name the run gave it (a
    checkpoint copies data.tokenizer as it is: digits-sp.model, my-bpe.json)."""
    root = Path(directory) / WEIGHTS
    for pattern in ("tokenizer.json", "*.model", "*.json"):
        found = sorted(p for p in root.glob(pattern) if p.name not in ("arch.json", INDEX))
        if found:
            return found[0]
    return None


def tokenizer_in(directory: str | Path) -> Path | None:
    """The tokenizer a Hugging Face checkpoint ships: tokenizer.json, else tokenizer.model."""
    directory = Path(directory)
    for name in ("tokenizer.json", "tokenizer.model"):
        if (directory / name).is_file():
            return directory / name
    return None


# ---- writing ---------------------------------------------------------------------------------

# What a weights directory (model/) and a Hugging Face export hold: the only files these
# writers replace; anything else there is the user's (del_megatron.outputs).
WEIGHTS_FILES = re.compile(
    r"tp\d{2}(-pp\d{2})?\.safetensors|arch\.json|tokenizer\.json|[^/]+\.model|files\.json"
)
HF_FILES = re.compile(
    r"config\.json|generation_config\.json|model(-\d{5}-of-\d{5})?\.safetensors"
    r"|model\.safetensors\.index\.json|tokenizer(_config)?\.json|special_tokens_map\.json"
    r"|[^/]+\.model"
)


def _matches(pattern: re.Pattern) -> Ours:
    return lambda path: path.is_file() and pattern.fullmatch(path.name) is not None


def write_rank_weights(
    root: Path, rank: int, state: dict[str, torch.Tensor], *, stage: int | None = None
) -> None:
    """root/tpNN.safetensors (tpNN-ppKK.safetensors: pipeline stage KK's): one
    tensor-parallel rank's weights, canonical names."""
    from safetensors.torch import save_file

    save_file(
        {canonical(k): v.detach().cpu().contiguous() for k, v in state.items()},
        str(root / rank_file(rank, stage)),
    )


def write_weights_record(root: Path, arch: LlamaArchitecture, tokenizer: str | Path | None) -> None:
    """root/arch.json and the tokenizer file beside the tpNN.safetensors."""
    (root / "arch.json").write_text(arch.model_dump_json(indent=1))
    if tokenizer is not None:
        shutil.copy(tokenizer, root / Path(tokenizer).name)


def write_weights(
    directory: str | Path,
    shards: Iterable[dict[str, torch.Tensor]],
    arch: LlamaArchitecture,
    tokenizer: str | Path | None,
    *,
    force: bool = False,
    wait: bool = False,
) -> None:
    """<directory>/model/ from each rank's {name: tensor} (one rank in memory at a time when
    `shards` is a generator), replacing an earlier one whole, or nothing on failure."""
    final = Path(directory) / WEIGHTS
    is_ours = _matches(WEIGHTS_FILES)
    staging = begin_output(final, is_ours, force=force, wait=wait)
    try:
        for rank, shard in enumerate(shards):
            write_rank_weights(staging, rank, shard)
        write_weights_record(staging, arch, tokenizer)
        write_files_list(staging)
        commit_output(staging, final, is_ours)
    except BaseException:
        abandon_output(staging)
        raise


def write_files_list(directory: Path) -> None:
    """directory/files.json: every file's size and SHA-256 (del_megatron/checksums.py), the
    list a reader checks the directory whole against (del_megatron/inputs.py)."""
    from ..checksums import FORMAT

    files = {
        p.name: hash_file(p) for p in sorted(directory.iterdir()) if p.is_file() and p.name != INDEX
    }
    index = {"format": FORMAT, "files": files}
    (directory / INDEX).write_text(json.dumps(index, indent=1))


class HFWriter:
    """Writes a Hugging Face checkpoint tensor by tensor into safetensors shards of at most
    `shard_bytes`, then the index, config.json and tokenizer files, in a staging directory
    put in place when complete (`abandon()` on failure): the export appears whole or not at
    all, and files in the directory that an export does not write are kept."""

    def __init__(
        self,
        directory: str | Path,
        *,
        shard_bytes: int = 4 << 30,
        force: bool = False,
        wait: bool = False,
    ) -> None:
        self.final = Path(directory)
        self.is_ours = _matches(HF_FILES)
        self.tmp = begin_output(self.final, self.is_ours, force=force, wait=wait)
        self.shard_bytes = shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.written: list[tuple[str, list[str]]] = []  # (temporary file, tensor names)
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.shard_bytes:
            self._flush()
        self.pending[name] = tensor.detach().cpu().contiguous()
        self.pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        name = f"part-{len(self.written):05d}.safetensors"
        save_file(self.pending, str(self.tmp / name), metadata={"format": "pt"})
        self.written.append((name, sorted(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(
        self,
        config,
        tokenizer_dir: str | Path | None = None,
        *,
        check: Callable[[Path], None] | None = None,
    ) -> None:
        """Write config (a transformers config object) and the tokenizer; `check` (given the
        complete staging directory: raises to keep it from being put in place); put in place."""
        self._flush()
        count = len(self.written)
        weight_map = {}
        for i, (part, names) in enumerate(self.written):
            final_name = (
                "model.safetensors"
                if count == 1
                else f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            )
            os.replace(self.tmp / part, self.tmp / final_name)
            weight_map.update(dict.fromkeys(names, final_name))
        if count > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            (self.tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
        config.save_pretrained(self.tmp)
        if tokenizer_dir is not None:
            for pattern in ("tokenizer*", "special_tokens_map.json", "*.model"):
                for f in Path(tokenizer_dir).glob(pattern):
                    if f.is_file():
                        shutil.copy(f, self.tmp / f.name)
        if check is not None:
            check(self.tmp)
        commit_output(self.tmp, self.final, self.is_ours)

    def abandon(self) -> None:
        abandon_output(self.tmp)
