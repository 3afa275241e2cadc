"""What the README's Megatron-LM and Megatron-Bridge examples, and
`python -m del_megatron.cli.megatron_lm`, need around them to run here. Tests only.

* Megatron-LM's repository files (`pretrain_gpt.py`, `gpt_builders.py`, `model_provider.py`;
  not in any wheel), one set per version a user runs: `STANDINS[tag]`, for core_v0.16.1 (the
  `partial(model_provider, gpt_builder)` form) and core_v0.19.0 (the config-container form;
  main's three files keep its contract). Each keeps the real file's names, parameters and
  defaults, return shapes, the model call of its forward step and its loss function's return
  and checks, written in our own words; tests/models/test_loop_standins_contract.py checks
  them against facts read from the real files (tag, commit, path). What each leaves out is
  said in its docstring: the GPU's layer spec, the dataset builders, timers, ModelOpt.
* `pretrain` of both loops, which needs CUDA from its first line (megatron.training's
  `initialize_megatron` asserts `torch.cuda.is_available()`; Bridge's too): `install()`
  replaces it with one of the version's signature (`PRETRAIN[tag]`) that builds the model the
  way that version's `pretrain` builds it, on the CPU, and runs one forward step of the
  forward step and loss function it was handed, printing 'OK <form>: <report keys>'. The
  scripts themselves run unchanged.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

CPU = torch.device("cpu")
README = Path(__file__).resolve().parents[1] / "README.md"
MARK = "<!-- not run here: run with its loop standing in ("

# the two forms of pretrain_gpt.py and the tag whose files stand for each
FORMS = {"model_provider": "core_v0.16.1", "config container": "core_v0.19.0"}
# the README's Megatron-LM examples, by their mark, and the tag each is written for
EXAMPLE_TAGS = {
    "Megatron-LM's pretrain_gpt.py at core_v0.16.1": "core_v0.16.1",
    "Megatron-LM's current pretrain_gpt.py": "core_v0.19.0",
}


def examples() -> dict[str, str]:
    """The README's marked examples, by what each mark says it is."""
    pattern = re.escape(MARK) + r"(.*?)\) -->\n```python\n(.*?)```"
    return {m.group(1): m.group(2) for m in re.finditer(pattern, README.read_text(), re.S)}


def write_checkout(directory: Path, tag: str) -> Path:
    """`directory` made a Megatron-LM checkout at `tag`, as far as these files go."""
    for file, text in STANDINS[tag].items():
        (directory / file).write_text(text)
    return directory


# ---- Megatron-LM core_v0.16.1 (commit 55ac7082517c3878ae653c07c09c534b8aed49f6) ----

_PRETRAIN_GPT_V016 = '''"""Stands for Megatron-LM core_v0.16.1's pretrain_gpt.py.

Kept: get_batch's six values, loss_func's sum / token count / {'lm loss': [sum, count]} and
its NaN, Inf and spiky-loss checks, forward_step's model calls (the legacy model without
loss_mask; megatron-core's GPTModel with labels, loss_mask and packed_seq_params; the MoE
schedule plan) and the partial(loss_func, loss_mask, model=model) it hands back,
get_embedding_ranks, and __main__'s pretrain call. Left out: the dataset builders (the
stand-in pretrain feeds batches itself), the timers and straggler detector (they time and
change nothing), the tensor-parallel broadcast and the move to the GPU (one CPU process),
ModelOpt (its package is absent, as on most installs), context parallelism.
"""
from functools import partial

import torch
from megatron.core.enums import ModelType
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.transformer.multi_token_prediction import get_mtp_ranks
from megatron.core.utils import get_attr_wrapped_model
from megatron.training import get_args, inprocess_restart, pretrain
from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.utils import is_first_or_last_pipeline_stage

from gpt_builders import gpt_builder
from model_provider import model_provider

try:  # as the real file: ModelOpt's loss and arguments when its package is there
    from megatron.post_training.arguments import add_modelopt_args
    from megatron.post_training.loss_func import loss_func as loss_func_modelopt

    has_nvidia_modelopt = True
except ImportError:
    has_nvidia_modelopt = False

# a loss above ten times the largest seen so far is reported as spiky
SPIKY_LOSS_FACTOR = 10


def get_batch(data_iterator, vp_stage=None):
    """(tokens, labels, loss_mask, attention_mask, position_ids, packed_seq_params); six
    None on a stage that is neither first nor last (the builder here has no MTP)."""
    if not is_first_or_last_pipeline_stage(vp_stage):
        return None, None, None, None, None, None
    sample = next(data_iterator)  # the dataset's dict, on the CPU already
    cu_seqlens = sample.get("cu_seqlens")
    if sample.get("local_cp_size") is not None:
        raise NotImplementedError("hybrid context parallelism: not stood in")
    packed_seq_params = None
    if cu_seqlens is not None:  # THD: documents packed in one row
        max_seqlen = sample["max_seqlen"]
        assert max_seqlen.dim() == 1
        padded = sample.get("cu_seqlens_padded")
        packed_seq_params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu_seqlens,
            cu_seqlens_kv=cu_seqlens,
            cu_seqlens_q_padded=padded,
            cu_seqlens_kv_padded=padded,
            max_seqlen_q=int(max_seqlen[0].item()),
            max_seqlen_kv=int(max_seqlen[0].item()),
        )
    fields = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")
    return (*(sample.get(name) for name in fields), packed_seq_params)


def loss_func(loss_mask, output_tensor, model=None):
    """(loss sum over unmasked tokens in float32, their count as an int tensor,
    {'lm loss': [sum, count]}), checked before the data-parallel all-reduce."""
    args = get_args()
    if has_nvidia_modelopt and getattr(args, "modelopt_enabled", False):
        loss, num_tokens, report = loss_func_modelopt(loss_mask, output_tensor, model=model)
    else:
        mask = loss_mask.view(-1).float()
        loss = (output_tensor.view(-1).float() * mask).sum()
        num_tokens = mask.sum().clone().detach().to(torch.int)
        report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    machine = get_rerun_state_machine()
    if args.check_for_nan_in_loss_and_grad:
        for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            machine.validate_result(
                result=loss, rejection_func=reject, tolerance=0.0, fatal=True,
                message=f"found {what} in local forward loss calculation",
            )
    if args.check_for_spiky_loss:
        machine.validate_result(
            result=loss, tolerance=0.0, fatal=False, message="Spiky loss",
            rejection_func=partial(
                machine.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR, context="loss"
            ),
        )
    return loss, num_tokens, report


def forward_step(data_iterator, model, return_schedule_plan=False):
    """(the model's output, or its MoE schedule plan; partial(loss_func, loss_mask,
    model=model))."""
    args = get_args()
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    tokens, labels, loss_mask, attention_mask, position_ids, packed_seq_params = get_batch(
        data_iterator, vp_stage
    )
    # megatron.training 0.17+ (where this stand-in runs) dropped --use-legacy-models
    if getattr(args, "use_legacy_models", False):
        output_tensor = model(tokens, position_ids, attention_mask, labels=labels)
    elif return_schedule_plan:
        assert args.overlap_moe_expert_parallel_comm, "the schedule plan needs the MoE overlap"
        plan = model.build_schedule_plan(
            tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask
        )
        return plan, partial(loss_func, loss_mask, model=model)
    else:
        output_tensor = model(
            tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask,
            packed_seq_params=packed_seq_params,
        )
    return output_tensor, partial(loss_func, loss_mask, model=model)


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    raise NotImplementedError("the datasets: not stood in (the stand-in pretrain feeds batches)")


def get_embedding_ranks(pp_ranks):
    """The first pipeline rank; with several, the last too when the embeddings are tied, and
    the MTP ranks; sorted, each once."""
    ranks = {pp_ranks[0]}
    if len(pp_ranks) > 1:
        args = get_args()
        if not args.untie_embeddings_and_output_weights:
            ranks.add(pp_ranks[-1])
        ranks.update(get_mtp_ranks(pp_ranks, core_transformer_config_from_args(args)))
    return sorted(ranks)


if __name__ == "__main__":
    train_valid_test_datasets_provider.is_distributed = True
    pretrain, store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)
    pretrain(
        train_valid_test_datasets_provider,
        partial(model_provider, gpt_builder),
        ModelType.encoder_or_decoder,
        forward_step,
        args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
        extra_args_provider=add_modelopt_args if has_nvidia_modelopt else None,
        store=store,
        get_embedding_ranks=get_embedding_ranks,
    )
'''

_GPT_BUILDERS = '''"""Stands for Megatron-LM {tag}'s gpt_builders.py.

Kept: gpt_builder's parameters, the config from --yaml-cfg or the arguments when none is
given, megatron-core's GPTModel with every keyword the real file passes{legacy}. Left out:
the layer spec the real file picks (--spec, Transformer Engine's, --transformer-impl local's,
MoE, heterogeneous, experimental attention), which cannot run on a CPU: the CPU's here; MTP
(refused).
"""
from megatron.core.models.gpt import GPTModel
from megatron.training import print_rank_0
from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.yaml_arguments import core_transformer_config_from_yaml

import tests.loop_standins as standins


def gpt_builder(args, pre_process, post_process, vp_stage=None, config=None, pg_collection=None):
    """megatron-core's GPTModel (one pipeline stage), on the device the caller moves it to."""
    print_rank_0("building GPT model ...")
    if config is None:
        if args.yaml_cfg is not None:
            config = core_transformer_config_from_yaml(args, "language_model")
        else:
            config = core_transformer_config_from_args(args)
{legacy_branch}    if args.mtp_num_layers is not None:
        raise NotImplementedError("multi-token prediction: not stood in")
    return GPTModel(
        config=config,
        transformer_layer_spec=standins.cpu_spec(),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        mtp_block_spec=None,
        vp_stage=vp_stage,
        pg_collection=pg_collection,
    )
'''

_LEGACY_BRANCH = """    # megatron.training 0.17+ (where this runs) dropped --use-legacy-models
    if getattr(args, "use_legacy_models", False):
        raise NotImplementedError("megatron.legacy's GPTModel: not stood in")
"""

_MODEL_PROVIDER = '''"""Stands for Megatron-LM {tag}'s model_provider.py.

Kept: model_provider's parameters and its call of the builder (the arguments, the stage,
config and pg_collection passed on). Left out: --record-memory-history (CUDA's allocator;
refused) and ModelOpt's builder (its package is absent).
"""
from megatron.training import get_args


def model_provider(
    model_builder, pre_process=True, post_process=True, vp_stage=None, config=None,
    pg_collection=None,
):
    """What model_builder(args, pre_process, post_process, vp_stage, config=...,
    pg_collection=...) returns: one model stage."""
    args = get_args()
    if args.record_memory_history:
        raise NotImplementedError("--record-memory-history (CUDA's allocator): not stood in")
    return model_builder(
        args, pre_process, post_process, vp_stage, config=config, pg_collection=pg_collection
    )
'''

# ---- Megatron-LM core_v0.19.0 (commit 5be9626709af2722333bf54797c954c09edeada3) ----

_PRETRAIN_GPT_V019 = '''"""Stands for Megatron-LM core_v0.19.0's pretrain_gpt.py (main's keeps its
contract).

Kept: get_batch's values in BATCH_KEYS order (only the packing fields on a middle stage of a
packed run), forward_step's PackedSeqParams from cu_seqlens and its model calls,
loss_func's offline-distillation branch (not stood in: refused), sum / token count /
{'lm loss': [sum, count]} and its NaN, Inf and spiky-loss checks, the
partial(loss_func, loss_mask, model=model) it hands back, get_embedding_ranks, and
__main__'s arguments, model config, config container and pretrain call. Left out: the
dataset builders (the stand-in pretrain feeds batches itself), the timers and straggler
detector, the tensor-parallel broadcast and the move to the GPU (one CPU process), ModelOpt
(its package is absent, as on most installs); context parallelism of size 1 only.
"""
from functools import partial

import torch
from megatron.core.enums import ModelType
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.transformer.multi_token_prediction import get_mtp_ranks, mtp_on_this_rank
from megatron.core.utils import flatten_batch_for_packed_sequences, get_attr_wrapped_model
from megatron.training import get_args, inprocess_restart, pretrain
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import core_transformer_config_from_args, parse_and_validate_args
from megatron.training.training import update_seqlen_stats_from_cu_seqlens
from megatron.training.utils import is_first_or_last_pipeline_stage

from gpt_builders import gpt_builder  # imported by the real file, unused in this form
from model_provider import model_provider

try:  # as the real file: ModelOpt's loss, arguments and config when its package is there
    from megatron.post_training.arguments import add_modelopt_args
    from megatron.post_training.loss_func import loss_func as loss_func_modelopt
    from megatron.post_training.model_builder import ModelOptModelConfig
    from megatron.post_training.utils import maybe_enable_modelopt

    has_nvidia_modelopt = True
except ImportError:
    has_nvidia_modelopt = False

# the fields get_batch returns, alphabetical, in this order
BATCH_KEYS = [
    "attention_mask", "cu_seqlens", "cu_seqlens_padded", "hybrid_cp_group", "labels",
    "local_cp_size", "loss_mask", "max_seqlen", "position_ids", "tokens",
]
PACKING_KEYS = ("cu_seqlens", "cu_seqlens_padded", "max_seqlen")
# a loss above ten times the largest seen so far is reported as spiky
SPIKY_LOSS_FACTOR = 10


def get_batch(data_iterator, vp_stage=None):
    """The BATCH_KEYS fields, in order (None where the batch has none); all None on a
    middle stage, except the packing fields when documents are packed."""
    args = get_args()
    config = core_transformer_config_from_args(args)
    packed = args.sft or args.dataloader_inter_document_masking
    on_mtp = mtp_on_this_rank(
        layout=config.pipeline_model_parallel_layout, mtp_num_layers=config.mtp_num_layers,
        ignore_virtual=False, vp_stage=vp_stage,
    )
    ends = is_first_or_last_pipeline_stage(vp_stage) or on_mtp
    if not ends and not packed:
        return [None] * len(BATCH_KEYS)
    sample = next(data_iterator)  # the dataset's dict, on the CPU already
    batch = flatten_batch_for_packed_sequences({key: sample.get(key) for key in BATCH_KEYS})
    if not ends:
        return [batch[key] if key in PACKING_KEYS else None for key in BATCH_KEYS]
    if args.context_parallel_size > 1:
        raise NotImplementedError("context parallelism: not stood in")
    return [batch[key] for key in BATCH_KEYS]


def loss_func(loss_mask, output_tensor, model=None):
    """(loss sum over unmasked tokens in float32, their count as an int tensor,
    {'lm loss': [sum, count]}), checked before the data-parallel all-reduce."""
    args = get_args()
    if args.logits_load_dir is not None:
        raise NotImplementedError("offline distillation (--logits-load-dir): not stood in")
    if has_nvidia_modelopt and getattr(args, "modelopt_enabled", False):
        loss, num_tokens, report = loss_func_modelopt(loss_mask, output_tensor, model=model)
    else:
        mask = loss_mask.view(-1).float()
        loss = (output_tensor.view(-1).float() * mask).sum()
        num_tokens = mask.sum().clone().detach().to(torch.int)
        report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    machine = get_rerun_state_machine()
    if args.check_for_nan_in_loss_and_grad:
        for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            machine.validate_result(
                result=loss, rejection_func=reject, tolerance=0.0, fatal=True,
                message=f"found {what} in local forward loss calculation",
            )
    if args.check_for_spiky_loss:
        machine.validate_result(
            result=loss, tolerance=0.0, fatal=False, message="Spiky loss",
            rejection_func=partial(
                machine.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR, context="loss"
            ),
        )
    return loss, num_tokens, report


def forward_step(data_iterator, model, return_schedule_plan=False):
    """(the model's output, or its MoE schedule plan; partial(loss_func, loss_mask,
    model=model))."""
    args = get_args()
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    batch = dict(zip(BATCH_KEYS, get_batch(data_iterator, vp_stage), strict=True))
    tokens, labels, loss_mask = batch["tokens"], batch["labels"], batch["loss_mask"]
    position_ids, attention_mask = batch["position_ids"], batch["attention_mask"]
    packed_seq_params = None
    if batch["cu_seqlens"] is not None:
        cu_seqlens = batch["cu_seqlens"].squeeze(0)  # [1, n] in the batch, 1-D for attention
        padded = batch["cu_seqlens_padded"]
        padded = None if padded is None else padded.squeeze(0)
        update_seqlen_stats_from_cu_seqlens(cu_seqlens)  # the real lengths, for FLOPs
        bounds = cu_seqlens if padded is None else padded  # the padded ones where given
        local_cp_size = batch["local_cp_size"]
        packed_seq_params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=bounds,
            cu_seqlens_kv=bounds,
            cu_seqlens_q_padded=padded,
            cu_seqlens_kv_padded=padded,
            max_seqlen_q=int(batch["max_seqlen"].item()),
            max_seqlen_kv=int(batch["max_seqlen"].item()),
            local_cp_size=None if local_cp_size is None else int(local_cp_size.item()),
            cp_group=batch["hybrid_cp_group"],
            tokens_per_sample=args.seq_length,
        )
    if return_schedule_plan:
        assert args.overlap_moe_expert_parallel_comm, "the schedule plan needs the MoE overlap"
        plan = model.build_schedule_plan(
            tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask
        )
        return plan, partial(loss_func, loss_mask, model=model)
    output_tensor = model(
        tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask,
        packed_seq_params=packed_seq_params,
    )
    return output_tensor, partial(loss_func, loss_mask, model=model)


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    raise NotImplementedError("the datasets: not stood in (the stand-in pretrain feeds batches)")


def get_embedding_ranks(pp_ranks):
    """The first pipeline rank; with several, the last too when the embeddings are tied, and
    the MTP ranks; sorted, each once."""
    ranks = {pp_ranks[0]}
    if len(pp_ranks) > 1:
        args = get_args()
        if not args.untie_embeddings_and_output_weights:
            ranks.add(pp_ranks[-1])
        ranks.update(get_mtp_ranks(pp_ranks, core_transformer_config_from_args(args)))
    return sorted(ranks)


if __name__ == "__main__":
    train_valid_test_datasets_provider.is_distributed = True
    pretrain, store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)
    args = parse_and_validate_args(
        extra_args_provider=add_modelopt_args if has_nvidia_modelopt else None,
        args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
    )
    if has_nvidia_modelopt:
        maybe_enable_modelopt(args)
    if has_nvidia_modelopt and getattr(args, "modelopt_enabled", False):
        model_cfg = gpt_config_from_args(args, model_config_cls=ModelOptModelConfig)
    else:
        model_cfg = gpt_config_from_args(args)
    full_config = pretrain_cfg_container_from_args(args, model_cfg)
    pretrain(
        full_config,
        train_valid_test_datasets_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        store=store,
        get_embedding_ranks=get_embedding_ranks,
    )
'''

STANDINS = {
    "core_v0.16.1": {
        "pretrain_gpt.py": _PRETRAIN_GPT_V016,
        "gpt_builders.py": _GPT_BUILDERS.format(
            tag="core_v0.16.1",
            legacy=" (and megatron.legacy's for --use-legacy-models: not stood in)",
            legacy_branch=_LEGACY_BRANCH,
        ),
        "model_provider.py": _MODEL_PROVIDER.format(tag="core_v0.16.1"),
    },
    "core_v0.19.0": {
        "pretrain_gpt.py": _PRETRAIN_GPT_V019,
        "gpt_builders.py": _GPT_BUILDERS.format(tag="core_v0.19.0", legacy="", legacy_branch=""),
        "model_provider.py": _MODEL_PROVIDER.format(tag="core_v0.19.0"),
    },
}


def cpu_spec():
    from del_megatron.models.spec import gpt_layer_spec

    return gpt_layer_spec(CPU)


def on_cpu(models: list) -> list:
    from del_megatron.models.spec import apply_device_shims

    return [apply_device_shims(m, CPU) for m in models]


def _vocab_size() -> int:
    """The tokenizer's (real, unpadded) vocabulary, which the batches are drawn from."""
    from megatron.training import get_tokenizer

    return get_tokenizer().vocab_size


def _one_process() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from tests.megatron_cpu import run_megatron_on_cpu

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    run_megatron_on_cpu()


def batch(vocab_size: int, seq: int, rows: int = 2) -> dict[str, torch.Tensor]:
    """One micro-batch as megatron's GPTDataset gives it ([rows, seq] each; no attention
    mask, as without --create-attention-mask-in-dataloader)."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab_size, (rows, seq + 1), generator=gen)
    return {
        "tokens": tokens[:, :-1],
        "labels": tokens[:, 1:].contiguous(),
        "loss_mask": torch.ones(rows, seq),
        "position_ids": torch.arange(seq).expand(rows, seq),
    }


def _step(form: str, model, forward_step, vocab_size: int, seq: int) -> None:
    """One forward step as megatron's schedules call it (forward_step(data_iterator, model)),
    its loss function on the output, a backward, one line naming the report's keys and, for a
    model ending in the numeric loss head, one with its digit vocabulary's fingerprint."""
    output, loss_function = forward_step(iter([batch(vocab_size, seq)]), model)
    _report(form, output, loss_function)
    head = getattr(model, "head", None)  # the numeric loss head, where the model has one
    if head is not None:  # the digit vocabulary the run built, to compare with its tokenizer's
        print(f"VOCAB {head.vocab.fingerprint}", flush=True)


def _report(form: str, output, loss_function) -> None:
    loss, num_tokens, report = loss_function(output)
    (loss / num_tokens).backward()
    print(f"OK {form}: {', '.join(report)}", flush=True)


def _embedding_ranks(get_embedding_ranks) -> None:
    """initialize_megatron hands get_embedding_ranks the pipeline ranks (one here)."""
    if get_embedding_ranks is not None:
        assert get_embedding_ranks([0]) == [0]


def _as_core_v0_16_1s_tokenizer(args) -> None:
    """The global tokenizer in core_v0.16.1's shape: its megatron/training/tokenizer classes
    (not megatron.core.tokenizers', which megatron.training 0.17+ builds here) keep the
    sentencepiece processor in `tokenizer` (_SentencePieceTokenizer and its subclasses) and
    the transformers tokenizer in `_tokenizer` (_HuggingFaceTokenizer); the vocabulary size
    (and so the padded vocabulary) stays the one megatron computed."""
    from megatron.training import global_vars

    built = global_vars.get_tokenizer()
    kind = args.tokenizer_type
    if kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        import sentencepiece

        inner = ("tokenizer", sentencepiece.SentencePieceProcessor(model_file=args.tokenizer_model))
    elif kind == "HuggingFaceTokenizer":
        import transformers

        inner = ("_tokenizer", transformers.AutoTokenizer.from_pretrained(args.tokenizer_model))
    else:
        return
    legacy = type(f"_{kind}", (), {"vocab_size": built.vocab_size})()
    setattr(legacy, *inner)
    global_vars._GLOBAL_TOKENIZER = legacy


def pretrain_core_v0_16_1(
    train_valid_test_dataset_provider,
    model_provider,
    model_type,
    forward_step_func,
    process_non_loss_data_func=None,
    extra_args_provider=None,
    args_defaults={},  # noqa: B006 -- megatron.training's own default, kept to the letter
    get_embedding_ranks=None,
    get_position_embedding_ranks=None,
    non_loss_data_func=None,
    store=None,
    inprocess_call_wrapper=None,
) -> None:
    """megatron.training's pretrain at core_v0.16.1: it parses and validates the arguments
    (with extra_args_provider and args_defaults) and builds the tokenizer, then get_model
    calls the model provider for the one stage without virtual stages as
    model_provider(pre_process=, post_process=, config=None, pg_collection=): the builder
    reads the arguments for its config."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training import get_args
    from megatron.training.arguments import parse_and_validate_args

    parse_and_validate_args(extra_args_provider=extra_args_provider, args_defaults=args_defaults)
    _as_core_v0_16_1s_tokenizer(get_args())
    _one_process()
    _embedding_ranks(get_embedding_ranks)
    model = model_provider(
        pre_process=True,
        post_process=True,
        config=None,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )
    model.model_type = model_type
    (model,) = on_cpu([model])  # where get_model moves the model to the GPU
    _step("model_provider", model, forward_step_func, _vocab_size(), get_args().seq_length)


def pretrain_core_v0_19_0(
    cfg_container,
    train_valid_test_dataset_provider,
    model_type,
    forward_step_func,
    model_provider=None,
    process_non_loss_data_func=None,
    get_embedding_ranks=None,
    get_position_embedding_ranks=None,
    non_loss_data_func=None,
    store=None,
    inprocess_call_wrapper=None,
    p2p_communicator=None,
    pg_collection=None,
    skip_model_parallel_init=False,
) -> None:
    """megatron.training's pretrain at core_v0.19.0 (and main): the arguments were parsed
    into the config container by the script; the model is its model config's build
    (pre-wrap hooks included), as setup_model_and_optimizer makes it, without the DDP
    wrapper (a CUDA stream)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training import get_args

    assert model_provider is None, "the config-container form builds from its model config"
    _one_process()
    _embedding_ranks(get_embedding_ranks)
    model_cfg = cfg_container.model
    model_cfg.transformer_layer_spec = cpu_spec()
    model_cfg.pre_wrap_hooks.insert(0, on_cpu)  # first: where get_model moves to the GPU
    builder = model_cfg.get_builder_cls()(model_cfg)
    (model,) = builder.build_distributed_models(
        ProcessGroupCollection.use_mpu_process_groups(), wrap_with_ddp=False
    )
    _step("config container", model, forward_step_func, _vocab_size(), get_args().seq_length)


PRETRAIN = {"core_v0.16.1": pretrain_core_v0_16_1, "core_v0.19.0": pretrain_core_v0_19_0}


def megatron_lm_pretrain(*args, **kwargs) -> None:
    """megatron.training's pretrain in the form the caller uses: (datasets provider, model
    provider, ...) at core_v0.16.x, (config container, datasets provider, ...) since
    core_v0.18. A keyword the version's pretrain lacks fails as it would there."""
    tag = FORMS["model_provider" if callable(args[0]) else "config container"]
    PRETRAIN[tag](*args, **kwargs)


def megatron_bridge_pretrain(config, forward_step_func) -> None:
    """Bridge's pretrain: its config validated, the model its provider provides on the CPU,
    one forward step of the example's forward step through Bridge's GlobalState."""
    from megatron.bridge.training.state import GlobalState
    from megatron.bridge.training.utils.train_utils import prepare_forward_step_func
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        init_num_microbatches_calculator,
    )
    from megatron.core.process_groups_config import ProcessGroupCollection

    from del_megatron.models.spec import FUSION_FLAGS
    from tests.megatron_cpu import MEGATRON_BRIDGE, run_megatron_on_cpu, tensor_cuda_stays

    model = config.model
    for flag in FUSION_FLAGS:  # the recipe's settings are a GPU's
        setattr(model, flag, False)
    model.use_cpu_initialization = True
    model.transformer_layer_spec = cpu_spec()
    config.mixed_precision = None
    config.optimizer.bf16 = False
    config.dataset.seq_length = model.seq_length
    config.validate()
    _one_process()
    run_megatron_on_cpu(MEGATRON_BRIDGE)
    destroy_num_microbatches_calculator()
    init_num_microbatches_calculator(0, None, 2, 2, 1)
    model.register_pre_wrap_hook(on_cpu)  # after AutoBridge's, which loads the weights
    # Bridge's own build, without its DDP wrapper (a CUDA stream)
    (built,) = model.provide_distributed_model(
        ddp_config=config.ddp,
        wrap_with_ddp=False,
        use_cpu_initialization=True,
        mixed_precision_wrapper=None,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )
    state = GlobalState()
    state.cfg = config
    step = prepare_forward_step_func(forward_step_func, state)
    sample = batch(model.digit_vocab.vocab_size, model.seq_length)
    with tensor_cuda_stays():  # Bridge's get_batch moves the batch with .cuda()
        _report(type(built).__name__, *step(iter([sample]), built))


def install() -> None:
    """megatron.training's pretrain replaced (before the script imports it)."""
    import megatron.training

    megatron.training.pretrain = megatron_lm_pretrain
