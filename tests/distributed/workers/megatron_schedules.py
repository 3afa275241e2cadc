"""torchrun worker (2 ranks): the numeric loss hook in megatron-core's own engine, against the
single-device reference.

Each layout named on the command line (`tp2`, `dp2`, `pp2`, `vpp2x2`; `+emo` for kind emo,
`+tied` for tied embeddings, e.g. `pp2+emo+tied`) builds the model's stages at that layout
with the weights of the reference, wraps them in megatron-core's DistributedDataParallel,
and runs STEPS optimizer steps of M micro-batches each through `get_forward_backward_func()`
(megatron's schedules: no pipelining, 1F1B, interleaved), `finalize_model_grads` and
megatron's optimizer (Adam), with megatron's per-token loss
(`calculate_per_token_loss`) and `megatron_lm.loss_func`. Compared with the reference (one
process, the same weights, the whole global batch, torch's AdamW):

* the reported 'objective' and 'lm loss' (CE) of each step, summed over micro-batches and
  data-parallel ranks as Megatron's loop sums them;
* every parameter's gradient after `finalize_model_grads` at step 1 (this rank's shard; the
  padded vocabulary rows zero), and megatron's gradient norm, at every step;
* every parameter after the last step.

megatron's schedules sum per-token losses over micro-batches and data-parallel ranks and
divide by their token count (`calculate_per_token_loss`), so the reference is one forward of
the whole global batch: a split that changed the loss (megatron's default division by each
micro-batch's own token count, `normalize="digits"`) fails here.

The vocabulary (130, padded to 192 at TP 1 and 256 at TP 2) pads differently at the two
sizes; pp2 splits 4 layers 1 + 3. Prints 'OK <layout> ...' per layout.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, fields
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from del_megatron import DigitVocab, NumericLossConfig
from del_megatron.models import LlamaArchitecture, build_llama, megatron_lm
from del_megatron.models.hf_tensors import pad_vocab
from del_megatron.models.sharding import global_name, partition_of_param, split
from tests.megatron_cpu import (
    MEGATRON_BRIDGE,
    MEGATRON_LM,
    run_megatron_on_cpu,
    tensor_cuda_stays,
)
from tests.utils import assert_close

VOCAB_SIZE = 130
DIGITS = list(range(10, 20))
VOCAB = DigitVocab(digit_ids=DIGITS, point_ids=[20], vocab_size=VOCAB_SIZE)
MICRO_BATCHES, MICRO_BATCH, SEQ, STEPS = 4, 2, 16, 2
# no clipping: megatron's clip asserts 'torch.cuda.FloatTensor' gradients (clip_grads.py);
# its gradient norm over the TP and PP shards, which the clip would use, is compared
LR = 3e-3


def arch(tied: bool) -> LlamaArchitecture:
    return LlamaArchitecture(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        ffn_hidden_size=64,
        num_layers=4,
        num_attention_heads=4,
        num_query_groups=2,
        max_position_embeddings=SEQ,
        qkv_bias=True,
        tie_word_embeddings=tied,
        make_vocab_size_divisible_by=64,
    )


@dataclass(frozen=True)
class MicroBatch:
    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    positions: torch.Tensor


def global_batch(step: int) -> list[MicroBatch]:
    """MICRO_BATCHES micro-batches [MICRO_BATCH, SEQ] with digits and loss masks that keep a
    different number of tokens in each (so a mean of micro-batch means differs)."""
    gen = torch.Generator().manual_seed(100 + step)
    batches = []
    for m in range(MICRO_BATCHES):
        tokens = torch.randint(0, VOCAB_SIZE, (MICRO_BATCH, SEQ + 1), generator=gen)
        digits = torch.rand(tokens.shape, generator=gen) < 0.4
        tokens = torch.where(digits, torch.randint(10, 21, tokens.shape, generator=gen), tokens)
        keep = 0.9 - 0.2 * m
        mask = (torch.rand(MICRO_BATCH, SEQ, generator=gen) < keep).float()
        positions = torch.arange(SEQ).expand(MICRO_BATCH, SEQ)
        batches.append(MicroBatch(tokens[:, :-1], tokens[:, 1:].contiguous(), mask, positions))
    return batches


def whole(batches: list[MicroBatch]) -> MicroBatch:
    """The micro-batches as one batch."""
    columns = ([getattr(b, f.name) for b in batches] for f in fields(MicroBatch))
    return MicroBatch(*(torch.cat(column) for column in columns))


def loss_config(kind: str) -> NumericLossConfig:
    return NumericLossConfig(kind=kind, normalize="tokens")


# ---- the single-device reference ------------------------------------------------------


@dataclass
class Reference:
    weights: dict[str, torch.Tensor]  # at the start
    grads: dict[str, torch.Tensor]  # of step 1
    norms: list[float]  # gradient norm of each step, before clipping
    losses: list[dict[str, float]]  # 'objective' and 'lm loss' of each step
    final: dict[str, torch.Tensor]  # after the last step


def reference(kind: str, tied: bool) -> Reference:
    """STEPS steps of one process: the loss of the whole global batch in one forward (its
    loss sum divided by its token count) and torch's AdamW (what megatron's FP32 optimizer
    runs without Apex or Transformer Engine). EMO's weight r is a ratio of sums over a
    micro-batch (docs/losses.md), so for emo the reference sums the micro-batches' losses,
    as every loop accumulating micro-batches does."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    model = build_llama(arch(tied), VOCAB, loss_config(kind), torch.device("cpu"), seed=1234)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    grads, norms, losses = {}, [], []
    for step in range(STEPS):
        optimizer.zero_grad()
        batches = global_batch(step)
        if kind != "emo":
            batches = [whole(batches)]
        tokens = sum(b.loss_mask.sum() for b in batches)
        sums = {"objective": 0.0, "lm loss": 0.0}
        for b in batches:
            output = model(b.tokens, b.positions, None, labels=b.labels, loss_mask=b.loss_mask)
            loss_sum, _, report = megatron_lm.loss_func(b.loss_mask, output)
            (loss_sum / tokens).backward()
            for key in sums:
                sums[key] += report[key][0].item()
        losses.append({k: v / tokens.item() for k, v in sums.items()})
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
        optimizer.step()
    final = {n: p.detach().clone() for n, p in model.named_parameters()}
    parallel_state.destroy_model_parallel()
    return Reference(weights, grads, norms, losses, final)


# ---- a layout on megatron's engine -----------------------------------------------------


@dataclass(frozen=True)
class Layout:
    name: str
    tp: int = 1
    pp: int = 1
    vp: int | None = None
    dp: int = 1
    kind: str = "del"
    tied: bool = False

    @classmethod
    def parse(cls, text: str) -> Layout:
        base, *flags = text.split("+")
        sizes = {"tp2": {"tp": 2}, "dp2": {"dp": 2}, "pp2": {"pp": 2}, "vpp2x2": {"pp": 2, "vp": 2}}
        return cls(
            text,
            **sizes[base],
            kind="emo" if "emo" in flags else "del",
            tied="tied" in flags,
        )


def stage_tensor(full: dict, chunk, name: str, param: torch.Tensor, layout: Layout, tied: bool):
    """This rank's part of the reference tensor `full[...]` for `param` of `chunk`."""
    key = global_name(chunk, name)
    padded = arch(tied).padded_vocab_size(layout.tp)
    tensor = pad_vocab(key, full[key], arch(tied), padded)
    rank = parallel_state.get_tensor_model_parallel_rank()
    return split(tensor, partition_of_param(param), rank, layout.tp)


def build_stages(layout: Layout) -> list:
    """This rank's model chunks at `layout` (megatron's parallel state initialized)."""
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    first, last = pp_rank == 0, pp_rank == layout.pp - 1
    overrides = {"calculate_per_token_loss": True}
    if layout.pp > 1:
        overrides["batch_p2p_comm"] = False  # gloo reorders batched sends
    if layout.pp > 1 and layout.vp is None:
        overrides["num_layers_in_first_pipeline_stage"] = 1  # 1 + 3: an uneven split
    chunks = []
    for v in range(layout.vp or 1):
        vp_first, vp_last = v == 0, v == (layout.vp or 1) - 1
        with tensor_cuda_stays():  # tied embeddings: the last stage's copy is .cuda()-ed
            chunk = build_llama(
                arch(layout.tied),
                VOCAB,
                loss_config(layout.kind),
                torch.device("cpu"),
                seed=99,  # not the reference's: its weights are loaded
                pre_process=first and vp_first,
                post_process=last and vp_last,
                vp_stage=v if layout.vp else None,
                **overrides,
            )
        chunks.append(chunk)
    return chunks


def wrap(chunks: list, ref: Reference, layout: Layout):
    """The reference's weights loaded, megatron's DDP around each chunk, its optimizer, and
    the config hooks its training loop sets (Megatron-LM's `train`)."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    with torch.no_grad():
        for chunk in chunks:
            for name, param in chunk.named_parameters():
                param.copy_(stage_tensor(ref.weights, chunk, name, param, layout, layout.tied))
            chunk.freeze_emo_cost_embedding()
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True)
    model = [
        DistributedDataParallel(c.config, ddp_config, c, disable_bucketing=i > 0)
        for i, c in enumerate(chunks)
    ]
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=LR, weight_decay=0.0, clip_grad=0.0), model
    )
    config = chunks[0].config
    config.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    return model, optimizer


def forward_step(data_iterator, model):
    """The forward step megatron's schedules call: the model with labels and loss_mask, and
    the loss function bound to the micro-batch's mask."""
    b = next(data_iterator)
    output = model(b.tokens, b.positions, None, labels=b.labels, loss_mask=b.loss_mask)
    return output, partial(megatron_lm.loss_func, b.loss_mask)


def megatron_step(model, optimizer, layout: Layout, step: int):
    """One optimizer step as Megatron-LM's train_step takes it: the schedule, then the
    optimizer. Returns (reported objective and CE of the global batch, grads after
    finalize_model_grads, gradient norm)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    dp_rank = parallel_state.get_data_parallel_rank()
    local = MICRO_BATCHES // layout.dp
    batches = global_batch(step)[dp_rank * local : (dp_rank + 1) * local]
    iterators = [iter(batches) for _ in model]
    reports = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(model) > 1 else iterators[0],
        model=model if len(model) > 1 else model[0],
        num_microbatches=local,
        seq_length=SEQ,
        micro_batch_size=MICRO_BATCH,
        forward_only=False,
    )
    grads = {
        (i, n): p.main_grad.detach().clone()
        for i, chunk in enumerate(model)
        for n, p in chunk.module.named_parameters()
    }
    _, norm, _ = optimizer.step()
    return reduced(reports), grads, norm


def reduced(reports: list[dict]) -> dict[str, float] | None:
    """'objective' and 'lm loss' as Megatron's loop reduces them: pairs summed over the
    micro-batches, all-reduced over data-parallel ranks, sum / count (last stage only)."""
    if not reports:
        return None
    out = {}
    for key in ("objective", "lm loss"):
        pair = torch.stack([r[key] for r in reports]).sum(0)
        dist.all_reduce(pair, group=parallel_state.get_data_parallel_group())
        out[key] = (pair[0] / pair[1]).item()
    return out


def run_layout(layout: Layout, ref: Reference) -> str:
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vp,
    )
    chunks = build_stages(layout)
    model, optimizer = wrap(chunks, ref, layout)
    for step in range(STEPS):
        losses, grads, norm = megatron_step(model, optimizer, layout, step)
        if losses is not None:  # the last pipeline stage
            for key, value in losses.items():
                assert_close(value, ref.losses[step][key], atol=2e-6, what=f"step {step} {key}")
        assert_close(norm, ref.norms[step], atol=1e-6, rtol=1e-5, what=f"step {step} grad norm")
        if step == 0:
            for (i, name), grad in grads.items():
                param = dict(chunks[i].named_parameters())[name]
                expected = stage_tensor(ref.grads, chunks[i], name, param, layout, layout.tied)
                assert_close(grad, expected, atol=2e-7, rtol=1e-5, what=f"grad {name}")
    compared = 0
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            expected = stage_tensor(ref.final, chunk, name, param, layout, layout.tied)
            # Adam's step is about LR per element whatever the gradient's size, so a gradient
            # near 0 amplifies its rounding: LR / 100 still sees a step missed or doubled
            assert_close(param, expected, atol=LR / 100, what=f"weight {name} after {STEPS} steps")
            compared += 1
    heads = sum(c.head is not None for c in chunks)
    parallel_state.destroy_model_parallel()
    return f"{compared} parameters, {heads} head(s)"


# ---- Megatron-LM's own loop: megatron.training (0.17+) ---------------------------------

# Megatron-LM's arguments for the reference's model and batch, data parallel over the 2 ranks:
# on CPU, validate_args needs CUDA at tensor parallel > 1 (get_device_arch_version)
MEGATRON_LM_ARGS = (
    "--num-layers 4 --hidden-size 32 --ffn-hidden-size 64 --num-attention-heads 4 "
    "--group-query-attention --num-query-groups 2 --add-qkv-bias --disable-bias-linear "
    "--normalization RMSNorm --swiglu --position-embedding-type rope "
    "--untie-embeddings-and-output-weights --attention-dropout 0 --hidden-dropout 0 "
    f"--seq-length {SEQ} --max-position-embeddings {SEQ} --micro-batch-size {MICRO_BATCH} "
    f"--global-batch-size {MICRO_BATCHES * MICRO_BATCH} --vocab-size {VOCAB_SIZE} "
    "--make-vocab-size-divisible-by 64 --tokenizer-type NullTokenizer "
    f"--lr {LR} --lr-decay-style constant --weight-decay 0 --clip-grad 0 --adam-eps 1e-8 "
    f"--train-iters {STEPS} --calculate-per-token-loss --transformer-impl local "
    "--use-cpu-initialization --no-gradient-accumulation-fusion --no-bias-swiglu-fusion "
    "--no-bias-dropout-fusion --no-rope-fusion --no-masked-softmax-fusion "
    "--no-persist-layer-norm"
)


def pretrain_gpt_forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """What Megatron-LM's pretrain_gpt.forward_step does (its get_batch is a next() here, the
    file is not in megatron-core's wheel): the model called with labels, loss_mask and
    packed_seq_params, and its own loss function bound to the loss mask and the model."""
    b = next(data_iterator)
    output = model(
        b.tokens,
        b.positions,
        None,
        labels=b.labels,
        loss_mask=b.loss_mask,
        packed_seq_params=None,
    )
    return output, partial(plain_gpt_loss, b.loss_mask, model=model)


def plain_gpt_loss(loss_mask, output_tensor, model=None):
    raise AssertionError("megatron_lm.forward_step must hand back its own loss_func")


def megatron_lm_step(ref: Reference) -> str:
    """STEPS steps of megatron.training's own `train_step`, on its parsed arguments, the model
    of the config-container form (`gpt_config_from_args`, GPTModelBuilder) with
    `numeric_loss_hook` among its pre-wrap hooks, its DDP and optimizer configs and
    scheduler, and `megatron_lm.forward_step` around pretrain_gpt's forward step."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.rerun_state_machine import (
        RerunDataIterator,
        RerunMode,
        destroy_rerun_state_machine,
        initialize_rerun_state_machine,
    )
    from megatron.training import get_timers
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_global_variables
    from megatron.training.training import (
        get_megatron_ddp_config,
        get_megatron_optimizer_config,
        get_optimizer_param_scheduler,
        train_step,
        wrap_model_chunks_with_ddp,
    )

    from del_megatron.models.spec import apply_device_shims, gpt_layer_spec

    run_megatron_on_cpu(MEGATRON_LM)
    sys.argv = ["pretrain_gpt.py", *MEGATRON_LM_ARGS.split()]
    args = parse_args()
    validate_args(args, {})
    set_global_variables(args, build_tokenizer=False)
    destroy_rerun_state_machine()  # as initialize_megatron starts it, in the mode asked
    initialize_rerun_state_machine(mode=RerunMode(args.rerun_mode))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    cpu = torch.device("cpu")

    model_cfg = gpt_config_from_args(args)
    model_cfg.transformer_layer_spec = gpt_layer_spec(cpu)  # the CPU's core attention
    model_cfg.pre_wrap_hooks.append(lambda chunks: [apply_device_shims(c, cpu) for c in chunks])
    model_cfg.pre_wrap_hooks.append(megatron_lm.numeric_loss_hook(VOCAB, loss_config("del")))
    pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    builder = model_cfg.get_builder_cls()(model_cfg)
    # wrap_with_ddp=False: megatron.training's DDP wrapper opens a CUDA stream
    # (megatron/training/models/dist_utils.py _ddp_wrap, torch.cuda.Stream())
    chunks = builder.build_distributed_models(pg_collection, wrap_with_ddp=False)
    layout = Layout("megatron-lm", dp=2)
    with torch.no_grad():
        for chunk in chunks:
            for name, param in chunk.named_parameters():
                param.copy_(stage_tensor(ref.weights, chunk, name, param, layout, False))
    config = chunks[0].config
    model = wrap_model_chunks_with_ddp(
        chunks, config, get_megatron_ddp_config(args), pg_collection=pg_collection
    )
    optimizer_config, overrides = get_megatron_optimizer_config(args)
    optimizer = get_megatron_optimizer(optimizer_config, model, config_overrides=overrides)
    scheduler = get_optimizer_param_scheduler(optimizer)
    # what megatron.training's train() sets before its loop
    config.grad_scale_func = optimizer.scale_loss
    config.timers = get_timers()
    config.no_sync_func = model[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    forward_step = megatron_lm.forward_step(pretrain_gpt_forward_step)
    for step in range(STEPS):
        dp_rank = parallel_state.get_data_parallel_rank()
        local = MICRO_BATCHES // 2
        # Megatron-LM's data iterators are wrapped so its rerun state machine can replay them
        batches = RerunDataIterator(
            iter(global_batch(step)[dp_rank * local : (dp_rank + 1) * local])
        )
        losses, skipped, *_ = train_step(
            forward_step,
            batches,
            model,
            optimizer,
            scheduler,
            config,
            get_forward_backward_func(),
            iteration=step,
        )
        assert not skipped
        for key in ("objective", "lm loss"):
            assert_close(losses[key], ref.losses[step][key], atol=2e-6, what=f"step {step} {key}")
    for name, param in chunks[0].named_parameters():
        expected = stage_tensor(ref.final, chunks[0], name, param, layout, False)
        assert_close(param, expected, atol=LR / 100, what=f"weight {name} after {STEPS} steps")
    parallel_state.destroy_model_parallel()
    destroy_rerun_state_machine()  # the next user starts it afresh (megatron's default mode)
    return f"{len(losses)} report keys: {', '.join(losses)}"


# ---- Megatron-Bridge's own loop (megatron-bridge 0.6.2) ---------------------------------


def megatron_bridge_step(ref: Reference, directory: str) -> str:
    """STEPS steps of Megatron-Bridge's own `train_step` on a recipe's ConfigContainer
    (`_pretrain_common`) whose model is AutoBridge's provider of a tiny Qwen2 (the reference's
    architecture: QKV bias, untied) made `NumericLossGPTModelProvider`, Bridge's GlobalState,
    optimizer and scheduler (`setup_optimizer`), and `megatron_bridge.forward_step` (Bridge's
    get_batch and forward step). Data parallel over the 2 ranks, float32; only
    transformer_engine and modelopt are stubbed (tests/gpu_only_stubs.py)."""
    from tests.gpu_only_stubs import install

    install()
    run_megatron_on_cpu(MEGATRON_BRIDGE)
    from megatron.bridge import AutoBridge
    from megatron.bridge.recipes.common import _pretrain_common
    from megatron.bridge.training.optim import setup_optimizer
    from megatron.bridge.training.state import GlobalState
    from megatron.bridge.training.train import train_step
    from megatron.bridge.training.utils.train_utils import prepare_forward_step_func
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        init_num_microbatches_calculator,
    )
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.rerun_state_machine import RerunDataIterator
    from transformers import Qwen2Config

    from del_megatron.models.megatron_bridge import NumericLossGPTModelProvider, forward_step
    from del_megatron.models.spec import FUSION_FLAGS, apply_device_shims, gpt_layer_spec

    shape, cpu = arch(False), torch.device("cpu")
    if dist.get_rank() == 0:
        Qwen2Config(
            vocab_size=VOCAB_SIZE,
            hidden_size=shape.hidden_size,
            intermediate_size=shape.ffn_hidden_size,
            num_hidden_layers=shape.num_layers,
            num_attention_heads=shape.num_attention_heads,
            num_key_value_heads=shape.num_query_groups,
            max_position_embeddings=SEQ,
            rope_theta=shape.rope_theta,
            rms_norm_eps=shape.norm_epsilon,
            tie_word_embeddings=False,
            architectures=["Qwen2ForCausalLM"],
        ).save_pretrained(directory)
    dist.barrier()
    cfg = _pretrain_common()
    hf = AutoBridge.from_hf_pretrained(directory).to_megatron_provider(load_weights=False)
    # DEL: the one line of the recipe
    cfg.model = NumericLossGPTModelProvider.from_provider(hf, VOCAB, loss_config("del"))
    cfg.model.calculate_per_token_loss = True
    cfg.model.make_vocab_size_divisible_by = 64
    cfg.model.should_pad_vocab = True
    # the CPU: float32, no fusion, megatron's local layers with the CPU's core attention
    for flag in FUSION_FLAGS:
        setattr(cfg.model, flag, False)
    cfg.model.use_cpu_initialization = True
    cfg.model.transformer_layer_spec = gpt_layer_spec(cpu)
    cfg.mixed_precision = None
    cfg.ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True)
    cfg.optimizer.use_distributed_optimizer = False  # megatron's refuses CPU tensors
    cfg.optimizer.lr, cfg.optimizer.weight_decay, cfg.optimizer.clip_grad = LR, 0.0, 0.0
    cfg.optimizer.bf16 = False
    # torch's AdamW defaults, the reference's (the recipe's beta2 is 0.95)
    cfg.optimizer.adam_beta1, cfg.optimizer.adam_beta2, cfg.optimizer.adam_eps = 0.9, 0.999, 1e-8
    cfg.scheduler.lr_decay_style, cfg.scheduler.lr_warmup_iters = "constant", 0
    cfg.train.micro_batch_size, cfg.train.global_batch_size = MICRO_BATCH, 2 * MICRO_BATCHES
    cfg.dataset.seq_length = SEQ
    cfg.validate()  # what Bridge's pretrain() does first: finalizes model, scheduler, ...

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    destroy_num_microbatches_calculator()
    init_num_microbatches_calculator(dist.get_rank(), None, 2 * MICRO_BATCHES, MICRO_BATCH, 2)
    state = GlobalState()
    state.cfg = cfg
    pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    cfg.model.register_pre_wrap_hook(lambda chunks: [apply_device_shims(c, cpu) for c in chunks])
    # Bridge's own build (it calls provide(pre_process=, post_process=)), without its DDP
    # wrapper, which opens a CUDA stream
    (chunk,) = cfg.model.provide_distributed_model(
        ddp_config=cfg.ddp,
        wrap_with_ddp=False,
        use_cpu_initialization=True,
        pg_collection=pg_collection,
    )
    layout = Layout("megatron-bridge", dp=2)
    with torch.no_grad():
        for name, param in chunk.named_parameters():
            param.copy_(stage_tensor(ref.weights, chunk, name, param, layout, False))
    from megatron.core.distributed import DistributedDataParallel

    model = [DistributedDataParallel(chunk.config, cfg.ddp, chunk)]
    optimizer, scheduler = setup_optimizer(cfg.optimizer, cfg.scheduler, model)
    chunk.config.no_sync_func = model[0].no_sync
    chunk.config.finalize_model_grads_func = finalize_model_grads
    chunk.config.grad_scale_func = optimizer.scale_loss
    step_func = prepare_forward_step_func(forward_step, state)
    for step in range(STEPS):
        dp_rank = parallel_state.get_data_parallel_rank()
        local = global_batch(step)[dp_rank * 2 : (dp_rank + 1) * 2]
        samples = [
            {
                "tokens": b.tokens,
                "labels": b.labels,
                "loss_mask": b.loss_mask,
                "position_ids": b.positions,
                "attention_mask": None,
            }
            for b in local
        ]
        with tensor_cuda_stays():  # Bridge's get_batch moves each tensor with .cuda()
            losses, skipped, *_ = train_step(
                step_func,
                RerunDataIterator(iter(samples)),
                model,
                optimizer,
                scheduler,
                state,
                pg_collection,
                get_forward_backward_func(),
                None,
            )
        assert not skipped
        for key in ("objective", "lm loss"):
            assert_close(losses[key], ref.losses[step][key], atol=2e-6, what=f"step {step} {key}")
    for name, param in chunk.named_parameters():
        expected = stage_tensor(ref.final, chunk, name, param, layout, False)
        assert_close(param, expected, atol=LR / 100, what=f"weight {name} after {STEPS} steps")
    parallel_state.destroy_model_parallel()
    return f"{len(losses)} report keys: {', '.join(losses)}"


# ---- EMO's cost embedding in megatron's distributed checkpoints -------------------------


def emo_checkpoint_round_trip(directory: str) -> str:
    """At TP 2: a model's sharded state dict saved by megatron's dist_checkpointing and loaded
    into a model built with other weights gives each rank its own rows of EMO's cost
    embedding back (declared replicated, every rank would get rank 0's)."""
    from megatron.core import dist_checkpointing

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    cpu = torch.device("cpu")
    saved = build_llama(arch(False), VOCAB, loss_config("emo"), cpu, seed=1)
    dist_checkpointing.save(saved.sharded_state_dict(), directory)
    loaded = build_llama(arch(False), VOCAB, loss_config("emo"), cpu, seed=2)
    expected = saved.head.emo_cost_embedding
    assert not torch.equal(loaded.head.emo_cost_embedding, expected)
    loaded.load_state_dict(dist_checkpointing.load(loaded.sharded_state_dict(), directory))
    assert_close(loaded.head.emo_cost_embedding, expected, atol=0, what="emo cost embedding")
    assert_close(loaded.output_layer.weight, saved.output_layer.weight, atol=0, what="output")
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, expected[:2].tolist())
    assert rows[0] != rows[1]  # each rank holds rows of its own
    parallel_state.destroy_model_parallel()
    return f"{tuple(expected.shape)} rows of this rank back"


def main() -> None:
    dist.init_process_group("gloo")
    run_megatron_on_cpu()
    references: dict[tuple[str, bool], Reference] = {}
    for text in sys.argv[1:]:
        if text.startswith("emo-checkpoint="):
            _gather_and_print(text.split("=")[0], emo_checkpoint_round_trip(text.split("=")[1]))
            continue
        if text.startswith("megatron-bridge="):
            if ("del", False) not in references:
                references["del", False] = reference("del", False)
            ref = references["del", False]
            _gather_and_print(text.split("=")[0], megatron_bridge_step(ref, text.split("=")[1]))
            continue
        layout = Layout.parse(text) if text != "megatron-lm" else Layout(text)
        key = (layout.kind, layout.tied)
        if key not in references:
            references[key] = reference(*key)
        run = megatron_lm_step if text == "megatron-lm" else partial(run_layout, layout)
        _gather_and_print(text, run(references[key]))
    dist.destroy_process_group()


def _gather_and_print(what: str, result: str) -> None:
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, result)
    if dist.get_rank() == 0:
        print(f"OK {what}: " + "; ".join(found), flush=True)


if __name__ == "__main__":
    main()
