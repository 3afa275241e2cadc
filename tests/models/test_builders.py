"""Every entry point builds its megatron layers the way a GPU run does, on the CPU.

On CUDA the device module builds with `use_cpu_initialization=False`: megatron allocates
each weight on `torch.cuda.current_device()` and, unless `perform_initialization=False`,
initializes it under `get_cuda_rng_tracker().fork()`, which raises "cuda rng state
model-parallel-rng is not added" unless `model_parallel_cuda_manual_seed` ran first. Only the
trainer seeded it; del-eval's checkpoint backend (and bench/loss_fused.py's output layer)
built unseeded and failed on any GPU. `gpu_init` runs that path here: the device module's
overrides with `use_cpu_initialization=False`, and the few CUDA calls megatron makes on it
answered by the CPU (`cuda_on_cpu`, tests/models/conftest.py).

`test_checkpoint_backend_builds_without_random_init` failed on the old code with
"Exception: cuda rng state model-parallel-rng is not added" (backends.py -> build_llama ->
ColumnParallelLinear -> _initialize_affine_weight_gpu).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

from .tiny_hf import tiny_hf_model

pytestmark = pytest.mark.megatron  # run on every supported megatron-core

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def gpu_init(monkeypatch, cuda_on_cpu, one_process_groups):
    """The device module's overrides with the GPU's `use_cpu_initialization=False`."""
    from del_megatron.models import llama
    from del_megatron.models import spec as device

    gpu_style = {**device.transformer_config_overrides(CPU), "use_cpu_initialization": False}
    monkeypatch.setattr(llama, "transformer_config_overrides", lambda _device: gpu_style)


@pytest.fixture
def weights_dir(tmp_path, spm_split_digits):
    """A del-megatron weights directory (hf_to_megatron of a tiny Llama, with a tokenizer)."""
    from del_megatron.models.conversion import hf_to_megatron, open_hf

    tiny_hf_model("llama-mha", tmp_path / "hf", vocab_size=640)
    shutil.copy(spm_split_digits, tmp_path / "hf" / "tokenizer.model")
    checkpoint, arch = open_hf(tmp_path / "hf", divisible_by=64)
    hf_to_megatron(checkpoint, arch, tmp_path / "weights", tensor_parallel=1)
    return tmp_path / "weights"


def parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_checkpoint_backend_builds_without_random_init(gpu_init, weights_dir):
    """del-eval's checkpoint backend builds (seeded, no random init) and its logits are the
    Hugging Face model's it was converted from: every weight came from the load."""
    from del_megatron.evaluation.backends import load_model

    loaded = load_model(weights_dir, CPU)
    tokens = torch.randint(0, 600, (2, 9), generator=torch.Generator().manual_seed(0))
    logits = loaded.forward(tokens)
    hf = tiny_hf_model("llama-mha", vocab_size=640)
    with torch.no_grad():
        expected = hf(tokens).logits[..., : loaded.tokenizer.vocab_size]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def run_config(tokenizer: Path, tmp_path: Path, seed: int, **init):
    from del_megatron.config import parse_run_config

    arch = {
        "vocab_size": 640,
        "hidden_size": 64,
        "ffn_hidden_size": 96,
        "num_layers": 2,
        "num_attention_heads": 4,
        "num_query_groups": 4,
        "max_position_embeddings": 64,
        "norm_epsilon": 1e-6,
        "make_vocab_size_divisible_by": 64,
    }
    return parse_run_config(
        {
            "model": arch,
            "parallel": {"tensor_parallel": 1, "zero_stage": 1},
            "train": {
                "steps": 1,
                "micro_batch_size": 1,
                "global_batch_size": 1,
                "seq_len": 8,
                "seed": seed,
                "device": "cpu",
            },
            "data": {"tokenizer": str(tokenizer), "sources": [{"manifest": "unused.json"}]},
            "init": init,
            "output_dir": str(tmp_path / "run"),
        }
    )


def test_trainer_builds_seeded_and_skips_the_init_it_loads_over(
    gpu_init, weights_dir, spm_split_digits, tmp_path
):
    """megatron's random init is skipped on every start: a random start draws each tensor
    from train.seed and its name (models/random_start.py; tests/models/test_random_start.py),
    initial weights load over every parameter."""
    from del_megatron.tokenizer import Tokenizer
    from del_megatron.training.build import build_model

    tokenizer = Tokenizer(spm_split_digits)
    random = [
        build_model(run_config(spm_split_digits, tmp_path, s), CPU, tokenizer) for s in (1, 2)
    ]
    assert not random[0].config.perform_initialization
    a, b = (parameters(m) for m in random)
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    assert not torch.equal(a[name], b[name])  # drawn from train.seed
    again = parameters(build_model(run_config(spm_split_digits, tmp_path, 1), CPU, tokenizer))
    assert all(torch.equal(a[n], again[n]) for n in a)

    loaded = [
        build_model(
            run_config(spm_split_digits, tmp_path, s, megatron=str(weights_dir)), CPU, tokenizer
        )
        for s in (1, 2)
    ]
    assert not loaded[0].config.perform_initialization
    a, b = (parameters(m) for m in loaded)
    assert all(torch.equal(a[n], b[n]) for n in a)  # every parameter loaded


def test_benchmark_output_layer(gpu_init, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    sys.modules.pop("loss_fused", None)
    import loss_fused

    layer = loss_fused.output_layer(1000, 256, 64, CPU, torch.float32)
    assert layer.weight.shape == (1024, 256)
    assert layer.weight.std() > 0.5  # torch.nn.init.normal_ ran, under the tracker's fork
