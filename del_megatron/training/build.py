"""The run's model on a device, as every engine builds it (a whole model for DeepSpeed's, one
chunk per virtual stage for megatron's): the one builder, the initial weights, EMO's cost
embedding frozen from them."""

from __future__ import annotations

from typing import Any

import torch

from ..config import RunConfig
from ..runtime import bf16_on, precision_overrides
from .initial_weights import initialize_weights, open_initial_weights


def decays(name: str, param: torch.Tensor) -> bool:
    """Whether weight decay applies to `param`: not to norm weights and biases (the 1-D
    parameters and `.bias`), megatron-core's rule (its optimizer's wd_mult=0 groups), which
    Megatron-LM, Hugging Face's Trainer and nanoGPT follow; both engines group by it."""
    return param.ndim > 1 and not name.endswith(".bias")


def parameter_groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """The model's trained parameters in optimizer groups: decayed (the optimizer's
    weight_decay), then the rest at weight_decay 0 (`decays`); an empty group left out."""
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in trained if decays(n, p)]},
        {"params": [p for n, p in trained if not decays(n, p)], "weight_decay": 0.0},
    ]
    return [group for group in groups if group["params"]]


def build_model(
    cfg: RunConfig,
    device: torch.device,
    tokenizer,
    *,
    stage: tuple[bool, bool, int | None] = (True, True, None),
    **overrides: Any,
) -> torch.nn.Module:
    """The run's model on `device` (megatron's parallel state initialized): built by the one
    builder (`models/llama.build_llama`: RNGs seeded with train.seed for what draws in the
    forward, megatron's random init skipped), the initial weights loaded or, for a random
    start, drawn per tensor from train.seed and its global name (`initialize_weights`: one
    model at any layout), the EMO cost embedding frozen from them. stage: (pre_process,
    post_process, vp_stage) of a pipeline stage's model chunk (`engines/megatron.stage_flags`);
    overrides: TransformerConfig fields."""
    from ..models import build_llama
    from ..models.spec import recompute_overrides

    initial = open_initial_weights(cfg)
    pre_process, post_process, vp_stage = stage
    model = build_llama(
        cfg.model,
        tokenizer.digit_vocab,
        cfg.loss,
        device,
        seed=cfg.train.seed,
        weights_follow=True,  # every parameter loaded or drawn by name right after
        # both engines' backward is of loss_func's sum times one factor (DeepSpeed's
        # loss_sum * scale, megatron's grad_scale_func): the fused loss's backward scales
        # its gradient on the device, no host read
        promise_scaled_loss=True,
        pre_process=pre_process,
        post_process=post_process,
        vp_stage=vp_stage,
        **recompute_overrides(device, cfg.train.activation_checkpointing),
        **precision_overrides(bf16_on(cfg.train.bf16, device)),
        **({"deterministic_mode": True} if cfg.train.deterministic else {}),
        **overrides,
    )
    initialize_weights(cfg, model, initial)
    model.freeze_emo_cost_embedding()  # from the weights the run starts from
    return model
