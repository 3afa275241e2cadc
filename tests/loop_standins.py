"""What the README's Megatron-LM and Megatron-Bridge examples need around them to run here
(tests/models/test_readme_megatron.py). Tests only.

* Megatron-LM's repository files the examples import (`pretrain_gpt.py`, `gpt_builders.py`,
  `model_provider.py`; not in megatron-core's wheel), written beside the example with the
  signatures and return contracts of core_v0.16.1's and today's: `STANDINS`.
* `pretrain` of both loops, which needs CUDA from its first line (megatron.training's
  `initialize_megatron` asserts `torch.cuda.is_available()`; Bridge's too): `install()`
  replaces it with one that builds the model the way that `pretrain` builds it, on the CPU,
  and runs one forward step of the example's own forward step and loss function, printing
  'OK <form>: <report keys>'. The examples themselves run unchanged.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

CPU = torch.device("cpu")
README = Path(__file__).resolve().parents[1] / "README.md"
MARK = "<!-- not run here: run with its loop standing in ("


def examples() -> dict[str, str]:
    """The README's marked examples, by what each mark says it is."""
    pattern = re.escape(MARK) + r"(.*?)\) -->\n```python\n(.*?)```"
    return {m.group(1): m.group(2) for m in re.finditer(pattern, README.read_text(), re.S)}


STANDINS = {
    "pretrain_gpt.py": '''"""Megatron-LM's pretrain_gpt.py, its contract:
forward_step(data_iterator, model, return_schedule_plan=False) calls the model with labels,
loss_mask and packed_seq_params and returns (output, partial(loss_func, loss_mask,
model=model))."""
from functools import partial


def loss_func(loss_mask, output_tensor, model=None):
    raise AssertionError("megatron_lm.forward_step hands back its own loss function")


def forward_step(data_iterator, model, return_schedule_plan=False):
    tokens, labels, loss_mask, position_ids = next(data_iterator)
    output = model(tokens, position_ids, None, labels=labels, loss_mask=loss_mask,
                   packed_seq_params=None)
    return output, partial(loss_func, loss_mask, model=model)


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    raise AssertionError("not called here")


def get_embedding_ranks(pp_ranks):
    return [pp_ranks[0]]
''',
    "gpt_builders.py": '''"""Megatron-LM's gpt_builders.py, its contract:
gpt_builder(args, pre_process, post_process, vp_stage=None, config=None, pg_collection=None)
-> megatron-core GPTModel (here with the CPU's layer spec: --transformer-impl local's cannot
run on a CPU)."""
from megatron.core.models.gpt import GPTModel
from megatron.training.arguments import core_transformer_config_from_args

import tests.loop_standins as standins


def gpt_builder(args, pre_process, post_process, vp_stage=None, config=None, pg_collection=None):
    config = config or core_transformer_config_from_args(args)
    model = GPTModel(
        config=config,
        transformer_layer_spec=standins.cpu_spec(),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
        vp_stage=vp_stage,
        pg_collection=pg_collection,
    )
    return standins.on_cpu([model])[0]
''',
    "model_provider.py": '''"""Megatron-LM's model_provider.py, its contract."""
from megatron.training import get_args


def model_provider(model_builder, pre_process=True, post_process=True, vp_stage=None,
                   config=None, pg_collection=None):
    return model_builder(get_args(), pre_process, post_process, vp_stage, config=config,
                         pg_collection=pg_collection)
''',
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


def _batch(vocab_size: int, seq: int):
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab_size, (2, seq + 1), generator=gen)
    mask = torch.ones(2, seq)
    return tokens[:, :-1], tokens[:, 1:].contiguous(), mask, torch.arange(seq).expand(2, seq)


def _step(form: str, model, forward_step, vocab_size: int, seq: int) -> None:
    _report(form, *forward_step(iter([_batch(vocab_size, seq)]), model))


def _report(form: str, output, loss_function) -> None:
    """The loss function's products, a backward, and one line naming the report's keys."""
    loss, num_tokens, report = loss_function(output)
    (loss / num_tokens).backward()
    print(f"OK {form}: {', '.join(report)}", flush=True)


def megatron_lm_pretrain(*args, **kwargs) -> None:
    """megatron.training's pretrain, both forms: (config container, datasets provider, model
    type, forward step, ...) today, (datasets provider, model provider, model type, forward
    step, args_defaults=...) at core_v0.16.1."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training import get_args

    if callable(args[0]):  # core_v0.16.1: pretrain parses the arguments itself
        from megatron.training.arguments import (
            core_transformer_config_from_args,
            parse_and_validate_args,
        )

        parse_and_validate_args(
            extra_args_provider=kwargs.get("extra_args_provider"),
            args_defaults=kwargs.get("args_defaults", {}),
        )
        _one_process()
        margs = get_args()
        # get_model's call of the model provider
        model = args[1](
            pre_process=True,
            post_process=True,
            config=core_transformer_config_from_args(margs),
            pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
        )
        _step("model_provider", model, args[3], _vocab_size(), margs.seq_length)
        return
    container, forward_step = args[0], args[3]
    _one_process()
    margs = get_args()
    model_cfg = container.model
    model_cfg.transformer_layer_spec = cpu_spec()
    model_cfg.pre_wrap_hooks.insert(0, on_cpu)
    builder = model_cfg.get_builder_cls()(model_cfg)
    # the build setup_model_and_optimizer makes, without its DDP wrapper (a CUDA stream)
    (model,) = builder.build_distributed_models(
        ProcessGroupCollection.use_mpu_process_groups(), wrap_with_ddp=False
    )
    _step("config container", model, forward_step, _vocab_size(), margs.seq_length)


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
    tokens, labels, mask, positions = _batch(model.digit_vocab.vocab_size, model.seq_length)
    sample = {"tokens": tokens, "labels": labels, "loss_mask": mask, "position_ids": positions}
    with tensor_cuda_stays():  # Bridge's get_batch moves the batch with .cuda()
        _report(type(built).__name__, *step(iter([sample]), built))


def install() -> None:
    """megatron.training's pretrain replaced (before the example imports it)."""
    import megatron.training

    megatron.training.pretrain = megatron_lm_pretrain
