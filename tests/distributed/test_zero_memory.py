"""The memory plan is what DeepSpeed allocates: its engine at ZeRO 1, 2 and 3 under the run's
own DeepSpeed config for a GPU run (bf16, gradients summed and reduced in float32), 2
data-parallel ranks on gloo, every live tensor counted (workers/zero_memory.py), against
`engines/deepspeed.model_state_bytes` for the same tensors.

On the code before, the plan took DeepSpeed's estimators, which assume bf16 gradients: at
ZeRO 1 (then the default stage) DeepSpeed's BF16_Optimizer held 14.0 bytes a parameter at DP
2 against the plan's 12.0 (a float32 gradient of every parameter on every rank where the
plan had 4/N bytes), so `--dry-run` could say "fits" for a run short of 4P(1 - 1/N) bytes; at
ZeRO 3 the plan missed the float32 reduce bucket DeepSpeed holds for the whole run and the
persistent parameters."""

from __future__ import annotations

import json

import pytest

from del_megatron.training.engines.deepspeed import ZeroSizes, model_state_bytes

from .launcher import run_torchrun

SIZES = {"reduce_bucket_size": 300_000, "stage3_prefetch_bucket_size": 300_000}
PERSISTENT = 512 + 512 + 1536  # the worker's norm and last bias, under ZeRO 3's threshold
SLACK = 64 << 10  # the activations of one [1, 512] micro-batch and DeepSpeed's scalars


@pytest.fixture(scope="module")
def engines():
    out = run_torchrun("zero_memory.py", 2, json.dumps(SIZES))
    rows = [json.loads(line) for line in out.splitlines() if line.startswith('{"stage"')]
    return {row["stage"]: row for row in rows}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_plan_counts_what_deepspeed_allocates(engines, stage):
    got = engines[stage]
    sizes = ZeroSizes.of(SIZES)
    plan = model_state_bytes(got["tensors"], got["largest"], 2, stage, sizes)
    # at the accumulation boundary: the model states, and ZeRO 3's reduce bucket, held always
    held = plan["weights"] + plan["gradients"] + plan["optimizer"]
    held += 4 * sizes.reduce_bucket_size if stage == 3 else 0
    assert abs(got["boundary"] - held) <= SLACK, (got, plan)
    # during backward, DeepSpeed's buffers too, which the plan bounds: seen at every layer's
    # output gradient, ZeRO 2's bf16 reduce bucket and, at ZeRO 3, every parameter gathered
    # (this model is within DeepSpeed's reuse distance); their float32 copies for the
    # reduction live inside a call, between the snapshots
    total = sum(plan.values())
    seen = {1: 0, 2: 2 * sizes.reduce_bucket_size, 3: 2 * (sum(got["tensors"]) - PERSISTENT)}
    assert held + seen[stage] <= got["peak"] <= total + SLACK, (got, plan)
    optimizer = {1: "BF16_Optimizer", 2: "DeepSpeedZeroOptimizer"}
    assert got["optimizer"] == optimizer.get(stage, "DeepSpeedZeroOptimizer_Stage3")
