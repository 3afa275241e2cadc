"""The one schema of a training run: typed sections, validated on load, dotted overrides.

`load_run_config(path, overrides)` reads YAML, applies `section.field=value` overrides
(values parsed as YAML), validates, and raises `ConfigError` with one line naming the field.
Checks that need the environment (world size, device, tokenizer and manifest files) are in
`check_environment`. The engines are named by their registry (training/engines/: the
values train.engine takes, and each engine's rules, which `RunConfig`'s check asks); the
DeepSpeed JSON is generated from this record (training/engines/deepspeed.deepspeed_config),
never written by hand.
"""

from __future__ import annotations

import difflib
import json
import math
import re
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .data.config import DataConfig, DataSource
from .errors import UserError
from .losses import NumericLossConfig
from .models.architecture import LlamaArchitecture
from .training.engines import DEFAULT as DEFAULT_ENGINE
from .training.engines import NAMES as ENGINE_NAMES


class ConfigError(UserError, ValueError):
    """A configuration mistake; the message is one line naming the field."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ParallelConfig(_Section):
    tensor_parallel: int = Field(default=1, ge=1)
    """Tensor-parallel size (ranks sharing one layer); data-parallel size = world / this."""
    zero_stage: Literal[1, 2, 3] = 2
    """DeepSpeed ZeRO stage across data-parallel ranks (its optimizers skip steps with
    non-finite gradients; stage 0's plain optimizer would apply them). 2 by default: with
    bf16 and float32 gradient sums DeepSpeed runs stage 1 as its BF16_Optimizer, which keeps
    a float32 gradient of every parameter and the bf16 one on every GPU (8 bytes a parameter,
    whatever the data parallelism) and all-reduces the whole float32 buffer; stage 2 keeps
    this rank's float32 partition and reduce-scatters it (half the bytes); stage 3 also
    partitions the weights, gathered in forward and again in backward where stage 2
    all-gathers them once a step, and holds a float32 reduce bucket (training/plan.py)."""
    collective_timeout_minutes: float = Field(default=60, gt=0)
    """How long a rank waits in a collective before the run fails: the timeout of the
    process group and of megatron-core's groups, and of the wait for every rank to start
    (del_megatron/rendezvous.py). While some ranks write a checkpoint the
    others wait in the next collective: at 7B a checkpoint is up to 189 GB
    (docs/checkpoints.md), which one node writes within DeepSpeed's default of 10 minutes
    only above 315 MB/s; within 60 minutes above 53 MB/s."""
    stall_seconds: float = Field(default=60, gt=0)
    """How long a collective or a host read of the run may go without returning before the
    rank says it (which operation, since when, which peers and whether they are alive), again
    at doubling intervals; 3x the operation's previous time on the rank if that is longer. A
    SIGTERM, SIGUSR1 or Ctrl-C during such a wait ends the rank at once, the step unsaved
    (exit 75 where a checkpoint exists to continue from, else 1): a stopped peer would
    otherwise hold it until collective_timeout_minutes (del_megatron/watchdog.py)."""
    distributed_optimizer: bool | None = None
    """train.engine=megatron: megatron's distributed optimizer (float32 masters and Adam
    moments sharded over data-parallel ranks, gradients reduce-scattered, weights
    all-gathered; Megatron-LM's --use-distributed-optimizer). Unset: on with CUDA."""
    overlap_grad_reduce: bool | None = None
    """train.engine=megatron: gradient reduction bucket by bucket behind backward
    (--overlap-grad-reduce). Unset: on with CUDA."""
    overlap_param_gather: bool | None = None
    """train.engine=megatron with the distributed optimizer: each bucket's weight all-gather
    behind the next forward, waited for by its modules' forward pre-hooks
    (--overlap-param-gather). Unset: on with CUDA and the distributed optimizer."""
    ddp_bucket_size: int | None = Field(default=None, gt=0)
    """train.engine=megatron with overlap_grad_reduce: parameters per bucket, each bucket's
    gradients reduced (and, with overlap_param_gather, weights gathered) as one collective
    (--ddp-bucket-size). Unset: megatron's max(40M, 1M x data parallel)."""
    sequence_parallel: bool = False
    """Not supported with DeepSpeed (it does not all-reduce layer-norm gradients across
    tensor-parallel ranks): refused."""
    pipeline_parallel: int = Field(default=1, ge=1)
    """Pipeline stages (train.engine=megatron only): each stage holds a contiguous block of
    layers, the first the embedding, the last the output layer and the numeric loss head;
    world = tensor parallel x pipeline parallel x data parallel."""
    virtual_pipeline_parallel: int | None = Field(default=None, ge=2)
    """Model chunks per pipeline stage (megatron's interleaved 1F1B schedule: a smaller
    pipeline bubble for more point-to-point traffic); model.num_layers must split evenly
    into pipeline_parallel x this, and the micro-batches per step into pipeline_parallel."""
    first_stage_layers: int | None = Field(default=None, ge=0)
    """Layers of the first pipeline stage when they do not split evenly (megatron's
    num_layers_in_first_pipeline_stage; Megatron-LM's --decoder-first-pipeline-num-layers):
    the embedding's stage often takes fewer. The other layers split evenly over the rest."""
    last_stage_layers: int | None = Field(default=None, ge=0)
    """Layers of the last pipeline stage (megatron's num_layers_in_last_pipeline_stage):
    the stage of the output layer and the loss head, at a large vocabulary the heaviest."""


class OptimConfig(_Section):
    lr: float = Field(default=5e-6, gt=0)
    min_lr: float = Field(default=0.0, ge=0)
    """Floor of the cosine schedule."""
    warmup_fraction: float = Field(default=0.03, ge=0, lt=1)
    """Share of train.steps spent in linear warmup."""
    weight_decay: float = Field(default=0.0, ge=0)
    beta1: float = Field(default=0.9, gt=0, lt=1)
    beta2: float = Field(default=0.95, gt=0, lt=1)
    eps: float = Field(default=1e-8, gt=0)
    clip_grad: float = Field(default=1.0, ge=0)
    """Global gradient-norm clip (0: off)."""
    schedule_on_resume: Literal["continue", "restart"] = "continue"
    """When a resumed run asks for another train.steps or optim.min_lr: `continue` goes on
    from the learning rate it had at the checkpoint, cosine to optim.min_lr at the new last
    step (no jump); `restart` follows the new settings' schedule as if the run had always
    had them (the rate jumps; also allows another optim.lr or optim.warmup_fraction)."""


class TrainConfig(_Section):
    steps: int = Field(gt=0)
    """Optimizer steps."""
    micro_batch_size: int = Field(gt=0)
    global_batch_size: int = Field(gt=0)
    """Sequences per optimizer step = micro_batch_size x accumulation x data-parallel size."""
    seq_len: int = Field(gt=0)
    seed: int = 1234
    device: Literal["auto", "cpu", "cuda"] = "auto"
    activation_checkpointing: bool = True
    """Recompute activations in backward (GPU only; megatron's recompute needs CUDA RNG)."""
    deterministic: bool = False
    """torch's deterministic kernels only (runtime.deterministic_algorithms), as
    Megatron-LM's --deterministic-mode: two runs of one command on one machine repeat bit for
    bit (a resumed run its straight twin); some kernels are slower; an op without such a
    kernel fails the run."""
    bf16: bool | None = None
    """bf16 parameters and activations with float32 master weights and float32 gradient
    sums (Megatron-LM's --bf16); false: float32 throughout. Unset: bf16 with CUDA."""
    log_interval: int = Field(default=10, gt=0)
    eval_interval: int = Field(default=0, ge=0)
    """Evaluate on eval.sources every this many steps (0: only before and after)."""
    save_interval: int = Field(default=0, ge=0)
    """Checkpoint every this many steps (0: only at the end)."""
    keep_checkpoints: int = Field(default=3, ge=0)
    """Keep the newest this many checkpoints (0: all)."""
    layout_free_checkpoints: bool = True
    """Keep the optimizer state as the layout-free state (fp32 weights, Adam moments and
    steps, 12 bytes a parameter, each rank writing its own ZeRO slice), which resumes at any
    tensor-parallel, data-parallel and ZeRO layout (docs/checkpoints.md); false: DeepSpeed's
    own state instead (16 bytes a parameter), which resumes at the saved layout only."""
    background_checkpoints: bool = True
    """Write a checkpoint's files behind training: the step waits only for the copy of this
    rank's part of the state to host memory (host memory: one checkpoint's part, at most one
    save in flight), and the checkpoint appears once every rank's files are on the disk
    (docs/checkpoints.md). false: the step waits for the write. DeepSpeed's own state
    (layout_free_checkpoints=false) is always written while training waits."""
    max_nonfinite_steps: int = Field(default=5, gt=0)
    """Stop after this many optimizer steps in a row with non-finite loss or gradients
    (each is skipped by the ZeRO optimizer: no update, no schedule step)."""
    engine: Literal[ENGINE_NAMES] = DEFAULT_ENGINE
    """What runs the step: `deepspeed` (ZeRO 1-3 over data-parallel ranks, tensor parallel,
    the layout-free checkpoints) or `megatron`: megatron-core's own engine (its
    DistributedDataParallel, its optimizer, distributed on GPU, and its schedules through
    get_forward_backward_func, so parallel.pipeline_parallel and virtual stages). Both
    write the layout-free checkpoint, which either resumes at any layout
    (docs/architecture.md, "Engines")."""
    checkpoints: bool = True
    """Write checkpoints (save_interval, at the end, on a stop signal); false: none (a
    benchmark, a throwaway run). A stop signal then ends the run with nothing to continue
    from."""


class DataSection(_Section):
    tokenizer: str | None = None
    """sentencepiece .model or Hugging Face tokenizer.json / directory: the run's tokenizer.
    Unset: the tokenizer shipped with init.hf / init.megatron."""
    sources: tuple[DataSource, ...] = Field(min_length=1)
    num_workers: int = Field(default=1, ge=0)
    shuffle: bool = True
    mask_after_boundary: bool = False
    on_error: Literal["skip", "fail"] = "fail"
    allow_pipe: bool = False
    trace: str | None = None
    """A directory: one JSON-lines file per data-parallel rank of the documents each batch
    trained on (docs/data.md); for tests of what a run trained across resumes."""

    def loader_config(
        self,
        sources: tuple[DataSource, ...],
        *,
        seq_len: int,
        micro_batch_size: int,
        seed: int = 1234,
        held_out: bool = False,
    ) -> DataConfig:
        """The loader's record for `sources` read with this section's options: the one place
        a DataSection becomes a DataConfig (training, its evaluation, del-train's checks,
        del-eval). held_out: one pass in file order (no shuffle, one epoch, every rank the
        same number of batches) read in this process, so an evaluation sees the same windows
        each time and starts no worker processes."""
        return DataConfig(
            sources=sources,
            seq_len=seq_len,
            micro_batch_size=micro_batch_size,
            seed=seed,
            shuffle=self.shuffle and not held_out,
            mask_after_boundary=self.mask_after_boundary,
            on_error=self.on_error,
            allow_pipe=self.allow_pipe,
            num_workers=0 if held_out else self.num_workers,
            epochs=1 if held_out else None,
        )


class InitConfig(_Section):
    hf: str | None = None
    """Start from a Hugging Face checkpoint directory (config.json + safetensors); its
    tokenizer becomes the run's unless data.tokenizer is set."""
    hf_hub_id: str | None = None
    """Where init.hf comes from on the Hugging Face hub (e.g. mistralai/Mistral-7B-v0.1):
    named in the message when init.hf does not exist. Nothing is downloaded by del-train."""
    megatron: str | None = None
    """Start from a del-megatron weights directory (del-convert output or a checkpoint)."""

    @model_validator(mode="after")
    def _one(self) -> InitConfig:
        if self.hf and self.megatron:
            raise ValueError("init.hf and init.megatron are both set; choose one")
        return self


class EvalConfig(_Section):
    sources: tuple[DataSource, ...] = ()
    """Held-out shards, read once in file order for each evaluation."""
    max_batches: int = Field(default=50, gt=0)


class LoggingConfig(_Section):
    wandb: Literal["offline", "online", "disabled"] = "offline"
    """online needs WANDB_API_KEY in the environment (never stored or printed)."""
    project: str = "del-megatron"
    run_name: str | None = None
    progress_bar: bool = True


class RunConfig(_Section):
    model: LlamaArchitecture
    loss: NumericLossConfig = NumericLossConfig()
    parallel: ParallelConfig = ParallelConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig
    data: DataSection
    init: InitConfig = InitConfig()
    eval: EvalConfig = EvalConfig()
    logging: LoggingConfig = LoggingConfig()
    output_dir: str = "runs/default"

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        tp = self.parallel.tensor_parallel
        for field in ("num_attention_heads", "num_query_groups"):
            if getattr(self.model, field) % tp:
                raise ValueError(
                    f"parallel.tensor_parallel={tp} must divide model.{field}="
                    f"{getattr(self.model, field)}"
                )
        if self.train.seq_len > self.model.max_position_embeddings:
            raise ValueError(
                f"train.seq_len={self.train.seq_len} exceeds model.max_position_embeddings="
                f"{self.model.max_position_embeddings}"
            )
        if self.train.global_batch_size % self.train.micro_batch_size:
            raise ValueError(
                f"train.global_batch_size={self.train.global_batch_size} is not a multiple of "
                f"train.micro_batch_size={self.train.micro_batch_size}"
            )
        from .training.engines import kind_of

        engine_problem = kind_of(self.train.engine).config_problem(self)
        if engine_problem:
            raise ValueError(engine_problem)
        if self.parallel.sequence_parallel:
            raise ValueError(
                "parallel.sequence_parallel=true is not supported: DeepSpeed does not all-reduce "
                "the layer-norm gradients across tensor-parallel ranks; set it to false"
            )
        if self.data.tokenizer is None and not (self.init.hf or self.init.megatron):
            raise ValueError(
                "data.tokenizer: required field missing (or set init.hf / "
                "init.megatron, whose tokenizer is then used)"
            )
        window = self.model.sliding_window
        if window is not None and self.train.seq_len > window:
            raise ValueError(
                f"train.seq_len={self.train.seq_len} exceeds model.sliding_window={window}: the "
                "original model attends to the last sliding_window tokens only, which training "
                "here does not reproduce; lower train.seq_len"
            )
        if self.optim.min_lr > self.optim.lr:
            raise ValueError(f"optim.min_lr={self.optim.min_lr} exceeds optim.lr={self.optim.lr}")
        return self

    # ---- derived --------------------------------------------------------------------------

    def tokenizer_path(self) -> str:
        """data.tokenizer, else the tokenizer shipped with the initial weights."""
        if self.data.tokenizer:
            return self.data.tokenizer
        from .models.weight_files import tokenizer_in, tokenizer_of_weights

        found = (
            tokenizer_in(self.init.hf) if self.init.hf else tokenizer_of_weights(self.init.megatron)
        )
        if found is None:
            where = self.init.hf or self.init.megatron
            raise ConfigError(f"data.tokenizer is unset and {where} ships no tokenizer")
        return str(found)

    def data_config(self, *, held_out: bool = False) -> DataConfig:
        """The loader's record of data.sources (training) or, held_out, of eval.sources
        (which must be set), with the run's window, micro-batch and seed."""
        sources = self.eval.sources if held_out else self.data.sources
        return self.data.loader_config(
            sources,
            seq_len=self.train.seq_len,
            micro_batch_size=self.train.micro_batch_size,
            seed=self.train.seed,
            held_out=held_out,
        )

    def data_parallel_size(self, world_size: int) -> int:
        tp, pp = self.parallel.tensor_parallel, self.parallel.pipeline_parallel
        if pp > 1 and world_size % (tp * pp):
            raise ConfigError(
                f"world size {world_size} is not a multiple of parallel.tensor_parallel x "
                f"parallel.pipeline_parallel = {tp} x {pp} (world size = tensor parallel x "
                f"pipeline parallel x data parallel): start {tp * pp} processes (bash "
                f"launch/torchrun.sh --nproc-per-node {tp * pp})"
            )
        if world_size % tp:
            raise ConfigError(
                f"world size {world_size} is not a multiple of parallel.tensor_parallel={tp} "
                f"(world size = tensor parallel x data parallel): start {tp} processes (bash "
                f"launch/torchrun.sh --nproc-per-node {tp}, also with --dry-run) or set "
                f"parallel.tensor_parallel={math.gcd(world_size, tp)}"
            )
        return world_size // (tp * pp)

    def layout_text(self, world_size: int) -> str:
        """'tensor parallel T [x pipeline parallel P[ (V virtual)]] x data parallel D'."""
        parallel = self.parallel
        pipeline = ""
        if parallel.pipeline_parallel > 1:
            virtual = parallel.virtual_pipeline_parallel
            pipeline = f" x pipeline parallel {parallel.pipeline_parallel}" + (
                f" ({virtual} virtual)" if virtual else ""
            )
        dp = self.data_parallel_size(world_size)
        return f"tensor parallel {parallel.tensor_parallel}{pipeline} x data parallel {dp}"

    def accumulation_steps(self, world_size: int) -> int:
        dp = self.data_parallel_size(world_size)
        per_step = self.train.micro_batch_size * dp
        if self.train.global_batch_size % per_step:
            raise ConfigError(
                f"train.global_batch_size={self.train.global_batch_size} is not a multiple of "
                f"train.micro_batch_size x data parallel = {self.train.micro_batch_size} x {dp}"
            )
        accumulation = self.train.global_batch_size // per_step
        pp, vp = self.parallel.pipeline_parallel, self.parallel.virtual_pipeline_parallel
        if vp is not None and accumulation % pp:
            raise ConfigError(
                f"parallel.virtual_pipeline_parallel={vp}: megatron's interleaved schedule "
                f"needs the micro-batches of a step ({accumulation} per data-parallel rank) "
                f"to be a multiple of parallel.pipeline_parallel={pp}; raise "
                "train.global_batch_size or unset parallel.virtual_pipeline_parallel"
            )
        return accumulation


# ---- loading ----------------------------------------------------------------------------


class _YamlLoader(yaml.SafeLoader):
    """YAML 1.1 as PyYAML reads it, except that 1e-5 is a float (PyYAML wants a dot and
    would hand the string "1e-5" to the schema)."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+][0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def _yaml(text: str, where: str, path: str = "") -> Any:
    loader = _YamlLoader(text)  # a SafeLoader
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _refuse_duplicate_keys(node, where, path)
        return loader.construct_document(node)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{where}{line}: not valid YAML") from None
    finally:
        loader.dispose()


def _refuse_duplicate_keys(node: yaml.Node, where: str, path: str = "") -> None:
    """A key written twice in one mapping: refused, naming it and both places (YAML keeps
    the last one without a word: `train: {steps: 6, ..., steps: 600}` would train 600).
    Keys a merge (`<<: *base`) brings in may be overridden, as YAML intends."""
    if isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _refuse_duplicate_keys(item, where, f"{path}{index}.")
    if not isinstance(node, yaml.MappingNode):
        return
    seen: dict[str, yaml.Mark] = {}
    for key, value in node.value:
        if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
            continue
        first = seen.setdefault(key.value, key.start_mark)
        if first is not key.start_mark:
            raise ConfigError(
                f"{where}: {path}{key.value} is set twice ({_places(first, key.start_mark)}); "
                "keep one"
            )
        _refuse_duplicate_keys(value, where, f"{path}{key.value}.")


def _places(first: yaml.Mark, second: yaml.Mark) -> str:
    if first.line == second.line:
        return f"line {first.line + 1}, columns {first.column + 1} and {second.column + 1}"
    return f"lines {first.line + 1} and {second.line + 1}"


def _refuse_repeated_overrides(overrides: list[str]) -> None:
    """Each field set by one override at most: a second one for the same field (or for a
    section holding it) is refused naming both, where the last would win unsaid."""
    given: dict[tuple[str, ...], str] = {}
    for assignment in overrides:
        key = tuple(assignment.partition("=")[0].split("."))
        for earlier, text in given.items():
            if key[: len(earlier)] == earlier or earlier[: len(key)] == key:
                raise ConfigError(
                    f"override {assignment!r} sets {'.'.join(key)} again after {text!r}; "
                    "give each field once"
                )
        given[key] = assignment


def _apply_override(tree: dict[str, Any], assignment: str) -> None:
    key, sep, raw = assignment.partition("=")
    parts = key.split(".")
    if not sep or not key or not all(p.strip() for p in parts):
        raise ConfigError(f"override {assignment!r} is not of the form section.field=value")
    value = _yaml(raw, f"override {key}", f"{key}.") if raw else ""
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {key}: {part} is not a section")
        node = child
    node[parts[-1]] = value


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds (X, X | None, tuple[X, ...])."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _known_fields(loc: tuple) -> list[str]:
    """The field names allowed where `loc` points (its last part being the unknown one)."""
    model: type[BaseModel] = RunConfig
    for part in loc[:-1]:
        if isinstance(part, int):  # an item of a list of sections (data.sources.0)
            continue
        field = model.model_fields.get(part)
        nested = _models_in(field.annotation) if field is not None else []
        if not nested:
            return []
        model = nested[0]
    return list(model.model_fields)


def _unknown_field(loc: tuple, where: str) -> str:
    known = _known_fields(loc)
    parent = ".".join(str(p) for p in loc[:-1])
    close = difflib.get_close_matches(str(loc[-1]), known, n=1)
    if close:
        return f"{where}: unknown field; did you mean {'.'.join([parent, close[0]]).lstrip('.')}?"
    if known:
        return f"{where}: unknown field ({parent or 'the config'} has {', '.join(known)})"
    return f"{where}: unknown field"


def _one_line(err: ValidationError) -> str:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "config"
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        return _unknown_field(tuple(first["loc"]), where)
    if first["type"] == "missing":
        return f"{where}: required field missing"
    if where == "config" or message.startswith(("parallel.", "train.", "optim.", "model.")):
        return message
    return f"{where}: {message} (got {first.get('input')!r})"


def parse_run_config(tree: dict[str, Any], overrides: list[str] = ()) -> RunConfig:
    """Validated strictly: a boolean is no number and a number no boolean (true does not
    become 1), through JSON so that YAML lists still fill tuple fields."""
    tree = json.loads(json.dumps(tree, default=str))  # deep copy, plain JSON types
    _refuse_repeated_overrides(list(overrides))
    for assignment in overrides:
        _apply_override(tree, assignment)
    try:
        return RunConfig.model_validate_json(json.dumps(tree, default=str), strict=True)
    except ValidationError as err:
        raise ConfigError(_one_line(err)) from None


def load_run_config(path: str | Path, overrides: list[str] = ()) -> RunConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read ({err})") from None
    tree = _yaml(text, str(path)) or {}
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: expected a mapping of sections")
    return parse_run_config(tree, overrides)


def dump_run_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
