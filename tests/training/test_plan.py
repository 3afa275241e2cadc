"""The --dry-run memory plan: model states as DeepSpeed's own estimators account them, the
parameter count of the built model, and the plan of every shipped 7B config at 4 nodes x 8
GPUs (with what to download when the weights are missing)."""

from __future__ import annotations

import pytest

from del_megatron.cli.train import main
from del_megatron.config import load_run_config
from del_megatron.training.plan import GIB, count_parameters, model_state_bytes, plan_run

from ..distributed.launcher import ROOT

SEVEN_B = ["llama2_7b", "codellama_7b", "mistral_7b", "qwen2.5_7b", "deepseek_math_7b"]


@pytest.mark.parametrize("params", [7 * 10**9 // 4 * 8, 1_811_156_992 * 8, 48_000_000])
@pytest.mark.parametrize("data_parallel", [1, 8, 32])
def test_model_states_match_deepspeeds_estimators(params, data_parallel):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    _, zero2 = estimate_zero2_model_states_mem_needs(
        params, num_gpus_per_node=data_parallel, num_nodes=1, cpu_offload=False
    )
    ours = model_state_bytes(params, 0, data_parallel, 2, param_bytes=2)
    assert sum(ours.values()) == zero2
    largest = params // 20
    _, zero3, _ = estimate_zero3_model_states_mem_needs(
        params, largest, num_gpus_per_node=data_parallel, num_nodes=1, cpu_offload=False
    )
    assert (
        sum(model_state_bytes(params, largest, data_parallel, 3, param_bytes=2).values()) == zero3
    )
    # stage 1 keeps whole bf16 gradients: more than stage 2 unless nothing is partitioned
    stage1 = sum(model_state_bytes(params, 0, data_parallel, 1, param_bytes=2).values())
    assert stage1 >= zero2 and (stage1 == zero2) == (data_parallel == 1)


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
