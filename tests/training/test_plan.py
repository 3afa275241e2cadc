"""The --dry-run memory plan: DeepSpeed's sizes (what it allocates is counted against its engine
in tests/distributed/test_zero_memory.py), the parameter count of the built model, and the plan
of every shipped 7B config at 4 nodes x 8 GPUs (with what to download when the weights are
missing); MFU's FLOPs per token as Megatron-LM counts them."""

from __future__ import annotations

import pytest

from del_megatron.cli.train import main
from del_megatron.config import load_run_config
from del_megatron.training.engines.deepspeed import ZeroSizes, model_state_bytes
from del_megatron.training.plan import GIB, count_parameters, plan_run, rank_tensors

from ..distributed.launcher import ROOT

SEVEN_B = ["llama2_7b", "codellama_7b", "mistral_7b", "qwen2.5_7b", "deepseek_math_7b"]


def test_the_zero_sizes_are_deepspeeds_defaults():
    """The plan's bucket and threshold sizes are DeepSpeed's own defaults (the run's config
    sets none), read back from its config class, and a config that sets one is read."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    theirs = DeepSpeedZeroConfig()
    assert ZeroSizes() == ZeroSizes(
        reduce_bucket_size=theirs.reduce_bucket_size,
        stage3_prefetch_bucket_size=theirs.prefetch_bucket_size,
        stage3_max_reuse_distance=theirs.max_reuse_distance,
        stage3_param_persistence_threshold=theirs.param_persistence_threshold,
    )
    assert ZeroSizes.of({"stage": 2, "reduce_bucket_size": 5e7}).reduce_bucket_size == 50_000_000


def test_zero_1_keeps_every_gradient_in_float32_on_every_rank():
    """DeepSpeed's BF16_Optimizer (ZeRO 1 with float32 sums) holds 8 bytes of gradients a
    parameter whatever the data parallelism; ZeRO 2 holds 4/N: the default stage is 2."""
    from del_megatron.config import ParallelConfig

    tensors = [10**9, 10**6]
    one, two = (model_state_bytes(tensors, 10**9, 8, stage, ZeroSizes()) for stage in (1, 2))
    assert one["gradients"] == 6 * sum(tensors) and two["gradients"] == 4 * sum(tensors) // 8
    assert ParallelConfig().zero_stage == 2


@pytest.mark.parametrize("name", SEVEN_B)
def test_dry_run_of_each_7b_config_at_32_gpus_prints_the_plan(name, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "32")
    monkeypatch.chdir(ROOT)
    code = main(["--config", f"configs/{name}.yaml", "--dry-run", "--gpu-memory", "80"])
    out, err = capsys.readouterr()
    plan = [line for line in out.splitlines() if line.startswith("# plan: ")]
    assert plan[0].startswith("# plan: parameters: ") and "per tensor-parallel rank" in plan[0]
    assert "optimizer" in plan[1] and "activations" in plan[1] and "logits" in plan[1]
    assert plan[2].endswith("of 80 GiB (assumed 80 GiB GPU)")
    assert len(plan) == 3  # they fit: no warning
    # the weights are not downloaded here: one line says where from
    cfg = load_run_config(ROOT / "configs" / f"{name}.yaml")
    assert code == 2
    assert f"hf download {cfg.init.hf_hub_id} --local-dir {cfg.init.hf}" in err


def test_a_plan_that_does_not_fit_names_the_knob(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "32")
    monkeypatch.chdir(ROOT)
    main(
        [
            "--config",
            "configs/mistral_7b.yaml",
            "--dry-run",
            "--gpu-memory",
            "80",
            "train.micro_batch_size=16",
            "train.activation_checkpointing=false",
        ]
    )
    out = capsys.readouterr().out
    assert (
        "# plan: warning: this will not fit in GPU memory; set train.activation_checkpointing: true"
        in out
    )


def test_counts_and_parts_add_up():
    cfg = load_run_config(ROOT / "configs" / "mistral_7b.yaml")
    plan = plan_run(cfg, 32, gpu_memory_gib=80)
    assert plan.parameters.unpadded == 7_241_732_096
    assert count_parameters(cfg.model, 4).per_rank == plan.parameters.per_rank
    assert sum(rank_tensors(cfg.model, 4)) == plan.parameters.per_rank
    parts = {k: v for k, v in plan.per_gpu.items() if k != "total"}
    assert sum(parts.values()) == plan.per_gpu["total"]
    assert plan.device_bytes == 80 * GIB and plan.fits


def test_the_tiny_configs_size_in_words_is_the_plans():
    """configs/tiny_cpu.yaml names its size in its first line; the plan counts it."""
    import re

    text = (ROOT / "configs" / "tiny_cpu.yaml").read_text()
    said = float(re.search(r"~([\d.]+)M-parameter", text).group(1))
    counted = count_parameters(load_run_config(ROOT / "configs" / "tiny_cpu.yaml", []).model, 2)
    assert said == round(counted.unpadded / 1e6, 1)


def megatron_lm_flops_per_token(cfg) -> float:
    """Megatron-LM's count (megatron/training/training.py, `num_floating_point_operations`,
    `transformer_flops`: a dense GPT with SwiGLU and grouped-query attention, one sequence of
    `seq_length` per sample), divided by the tokens of the batch, in its own terms."""
    arch, s = cfg.model, cfg.train.seq_len
    forward_backward_expansion_factor, fma_expansion_factor, ffn_expansion_factor = 3, 2, 3
    query_projection_size = arch.kv_channels * arch.num_attention_heads
    key_projection_size = value_projection_size = arch.kv_channels * arch.num_query_groups
    standard_self_attn_term = (
        forward_backward_expansion_factor
        * fma_expansion_factor
        * (
            arch.hidden_size * (query_projection_size + key_projection_size + value_projection_size)
            + query_projection_size * s / 2 * 2  # core attention, causal half
            + query_projection_size * arch.hidden_size
        )
    )
    batch_size = 1
    total = (
        batch_size
        * s
        * (
            forward_backward_expansion_factor
            * fma_expansion_factor
            * arch.hidden_size
            * (arch.ffn_hidden_size * ffn_expansion_factor)
            * arch.num_layers
            + standard_self_attn_term * arch.num_layers
            + forward_backward_expansion_factor
            * fma_expansion_factor
            * arch.hidden_size
            * arch.padded_vocab_size(cfg.parallel.tensor_parallel)
        )
    )
    return total / (batch_size * s)


@pytest.mark.parametrize("name", [*SEVEN_B, "llama3.1_8b", "qwen2.5_1.5b", "tiny_cpu"])
def test_flops_per_token_are_megatron_lms(name):
    """MFU's FLOPs: the logits matmul once, the input embedding (a lookup) not at all, the
    core attention over the causal half. Before: 6 per parameter, the untied input embedding
    included, and 12 x layers x h x s of attention (MFU of bench/train_step.py --gpu-7b
    overstated by a quarter)."""
    from del_megatron.training.plan import flops_per_token

    cfg = load_run_config(ROOT / "configs" / f"{name}.yaml", [])
    tp = cfg.parallel.tensor_parallel
    assert flops_per_token(cfg.model, tp, cfg.train.seq_len) == megatron_lm_flops_per_token(cfg)


def test_tied_and_untied_embeddings_cost_the_same():
    from del_megatron.training.plan import flops_per_token

    untied = load_run_config(ROOT / "configs" / "llama2_7b.yaml", []).model
    tied = untied.model_copy(update={"tie_word_embeddings": True})
    assert flops_per_token(tied, 8, 4096) == flops_per_token(untied, 8, 4096)


def _pipelined(name: str, **parallel):
    cfg = load_run_config(ROOT / "configs" / f"{name}.yaml")
    fields = {**cfg.parallel.model_dump(), **parallel}
    train = {**cfg.train.model_dump(), "engine": "megatron", "checkpoints": False}
    return cfg.model_validate({**cfg.model_dump(), "parallel": fields, "train": train})


@pytest.mark.parametrize(("tied", "first"), [(False, 5), (True, 4)])
def test_stage_tensors_add_up_to_the_model_with_a_tied_copy(tied, first):
    """The stages' tensors are the model's, the last stage's copy of a tied embedding
    besides; the split follows parallel.first_stage_layers."""
    from del_megatron.training.engines.megatron import stage_layers

    name = "qwen2.5_1.5b" if tied else "mistral_7b"
    cfg = _pipelined(name, pipeline_parallel=4, first_stage_layers=first)
    arch, tp = cfg.model, cfg.parallel.tensor_parallel
    split = stage_layers(cfg)
    assert split[0] == first and sum(split) == arch.num_layers and len(set(split[1:])) == 1
    stages = [rank_tensors(arch, tp, (n, i == 0, i == 3)) for i, n in enumerate(split)]
    vocab = arch.padded_vocab_size(tp) // tp * arch.hidden_size
    assert sum(map(sum, stages)) == sum(rank_tensors(arch, tp)) + (vocab if tied else 0)


def test_in_flight_micro_batches_follow_megatrons_warm_up():
    from del_megatron.training.engines.megatron import in_flight

    assert [in_flight(4, s, 8, None) for s in range(4)] == [4, 3, 2, 1]
    assert in_flight(4, 0, 2, None) == 2  # fewer micro-batches than stages
    # interleaved, 2 chunks a stage: (4 - s - 1) x 2 + 4 + 1 chunk-micro-batches
    assert [in_flight(4, s, 8, 2) for s in range(4)] == [11, 9, 7, 5]


def test_the_megatron_engine_plans_the_stage_that_needs_the_most():
    """PP 4 at 32 GPUs: the first stage (4 micro-batches in flight, the embedding) is the
    largest with the same layers everywhere; its optimizer is sharded over data parallel."""
    cfg = _pipelined("llama2_7b", pipeline_parallel=4, tensor_parallel=2)
    plan = plan_run(cfg, 32, gpu_memory_gib=80)
    assert plan.stage == 0
    params = sum(rank_tensors(cfg.model, 2, (8, True, False)))
    assert plan.per_gpu["weights"] == 2 * params
    assert plan.per_gpu["optimizer"] == 12 * params // 4  # DP 4
    assert "per GPU (stage 0, the largest)" in plan.lines(1, True)[1]
