"""Every shipped 7B (and 1.5B) config at its real size, without real memory: the model built
on the meta device has the published parameter count, and the Hugging Face mapping covers
every tensor name and shape of the transformers model of that architecture (built on the
meta device too), sliced for every rank at the config's tensor-parallel size."""

from __future__ import annotations

import json

import pytest

from ..distributed.launcher import ROOT, run_torchrun

PUBLISHED = {
    "llama2_7b": 6_738_415_616,
    "codellama_7b": 6_738_546_688,  # Llama-2-7B with 16 more tokens: 6,738,415,616 + 2 x 16 x 4096
    "mistral_7b": 7_241_732_096,
    "qwen2.5_7b": 7_615_616_512,
    "qwen2.5_1.5b": 1_543_714_304,
    "deepseek_math_7b": 6_910_365_696,  # from its config.json: 30 layers, 102400 tokens
    "llama3.1_8b": 8_030_261_248,
}


@pytest.mark.slow
def test_shipped_configs_have_the_published_sizes_and_a_complete_mapping():
    configs = [str(ROOT / "configs" / f"{name}.yaml") for name in PUBLISHED]
    output = run_torchrun("real_shapes.py", 1, *configs, timeout=900)
    results = {
        json.loads(line[7:])["config"]: json.loads(line[7:])
        for line in output.splitlines()
        if line.startswith("SHAPES ")
    }
    for name, count in PUBLISHED.items():
        found = results[str(ROOT / "configs" / f"{name}.yaml")]
        assert found["unpadded"] == count, (name, found["unpadded"], count)
        assert found["hf"] == count, (name, "transformers' model", found["hf"])
