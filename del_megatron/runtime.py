"""The process's compute runtime: which device a run uses, the process groups' backend,
batches moved to the device, waiting for it, determinism and seeds, the device's peak
FLOP/s for MFU. torch only: no megatron-core import at module level (`parallel.py`, the
checkpoints' generators and del-eval read it before any model exists). Which GPU a rank
takes is parallel.py's (it reads the rank's place from the launcher's environment)."""

from __future__ import annotations

import contextlib
import io
from typing import Any

import torch

from .errors import UserError


def resolve_device(requested: str) -> torch.device:
    """'auto' -> cuda when available, else cpu; a named device must exist."""
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(requested)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but no CUDA device is available")
    return device


def select_accelerator(device: torch.device, tensor_parallel: int | None = None) -> None:
    """Tell DeepSpeed which accelerator to use, and CUDA how this run uses the device; call
    before deepspeed is imported and before the first CUDA context. tensor_parallel: the
    run's (None: unknown, taken as more than one). A user's own settings are kept.

    * CUDA_DEVICE_MAX_CONNECTIONS=1 where megatron needs it, at tensor parallel > 1: its
      asynchronous all-reduce of input gradients across tensor-parallel ranks relies on
      kernels starting in launch order, which one hardware queue per device gives
      (Megatron-LM and NeMo set it; megatron warns without it). At tensor parallel 1 it
      would only serialise the data-parallel reductions DeepSpeed and megatron's DDP overlap
      with compute.
    * PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: the caching allocator grows segments
      instead of keeping fixed blocks, so the varying sizes of a step (packed windows, the
      loss's chunks) fragment less (Megatron-LM's and torchtitan's recommendation).
    Neither has an effect on CPU."""
    import os

    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if tensor_parallel is None or tensor_parallel > 1:
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


def deterministic_algorithms(enabled: bool) -> None:
    """train.deterministic: torch's deterministic kernels only, an error where an op has
    none (torch.use_deterministic_algorithms; embedding and attention backwards, scatters and
    index adds take their ordered forms), and cuBLAS's workspace fixed before its first use
    (CUBLAS_WORKSPACE_CONFIG, which it reads then), and what the other libraries read:
    Transformer Engine's NVTE_ALLOW_NONDETERMINISTIC_ALGO=0, NCCL's ring algorithm
    (NCCL_ALGO; another one refused in one line), megatron's deterministic_mode (on the
    model's config): what two runs need to repeat bit for bit, as Megatron-LM's
    --deterministic-mode asks. Call before the first CUDA kernel and the first
    communicator."""
    import os

    if not enabled:
        return
    problem = deterministic_problem(os.environ)
    if problem:
        raise UserError(problem)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # Transformer Engine's attention picks only deterministic kernels with this at 0 (read
    # when its attention runs); NCCL's ring reduces in a fixed order (read at communicator
    # creation, after this); megatron's own deterministic_mode is set on the model's
    # TransformerConfig (training/build.py)
    os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    os.environ.setdefault("NCCL_ALGO", "Ring")
    torch.use_deterministic_algorithms(True)


def deterministic_problem(env) -> str | None:
    """Why train.deterministic cannot hold in the environment `env`, in one line (None: it
    can): an NCCL algorithm other than Ring or Tree (NVLS, CollNet) reduces in an order that
    can change between runs. Asked by `deterministic_algorithms` and the start-up checks."""
    algorithm = env.get("NCCL_ALGO")
    if algorithm is not None and algorithm.lower() not in ("ring", "tree"):
        return (
            f"train.deterministic needs NCCL_ALGO=Ring or Tree (set: {algorithm}): other "
            "algorithms (NVLS, CollNet) reduce in an order that can change between runs"
        )
    return None


@contextlib.contextmanager
def quiet_communication_setup(device: torch.device):
    """On CPU, DeepSpeed loads its shared-memory all-reduce op and prints that it 'built
    successfully' on every rank: nothing a user can act on. Its stdout is dropped there."""
    if device.type != "cpu":
        yield
        return
    with contextlib.redirect_stdout(io.StringIO()):
        yield


def bf16_on(setting: bool | None, device: torch.device) -> bool:
    """Whether a run computes in bf16 (train.bf16): the setting, else on any accelerator
    (float32 on CPU). The one rule of the default precision (models/spec.model_dtype too)."""
    return device.type != "cpu" if setting is None else setting


def precision_overrides(bf16: bool) -> dict[str, Any]:
    """TransformerConfig fields of a model built in bf16 or float32 (the device's default,
    models/spec.transformer_config_overrides, when the run sets neither)."""
    return {"params_dtype": torch.bfloat16 if bf16 else torch.float32, "bf16": bf16}


def process_group_backend(device: torch.device) -> str:
    """NCCL on GPU, gloo on CPU: the backend every group of the run inherits."""
    return "nccl" if device.type == "cuda" else "gloo"


def batch_to_device(
    batch: dict[str, torch.Tensor], device: torch.device
) -> dict[str, torch.Tensor]:
    """A loader's host batch on the compute device. CUDA: copied into page-locked memory,
    then an asynchronous transfer (`non_blocking`), so the host goes on queueing the step
    instead of waiting for the GPU to drain; CPU: the tensors as they are."""
    if device.type != "cuda":
        return {k: v.to(device) for k, v in batch.items()}
    return {k: v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()}


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work: around a timing, so it measures the work and not
    only its launch. Nothing to wait for on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# bf16 dense (no sparsity) peak FLOP/s, for MFU, by the exact name CUDA gives the device
# (torch.cuda.get_device_name): NVIDIA's datasheets. One chip sold in several forms differs
# in clocks and power: an H100 PCIe peaks at 756, an H100 NVL at 835, the SXM part at 989.
PEAK_FLOPS = {
    "NVIDIA H100 80GB HBM3": 989e12,  # SXM5
    "NVIDIA H100 PCIe": 756e12,
    "NVIDIA H100 NVL": 835e12,
    "NVIDIA H200": 989e12,  # SXM
    "NVIDIA H200 NVL": 835e12,
    "NVIDIA GH200 480GB": 989e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    "NVIDIA A100-PCIE-40GB": 312e12,
    "NVIDIA B200": 2250e12,
    "NVIDIA L40S": 362e12,
}


def peak_flops(device: torch.device) -> float | None:
    """This device's bf16 dense peak, None for a name not in PEAK_FLOPS (no MFU is reported
    then, rather than another part's peak)."""
    if device.type != "cuda":
        return None
    return PEAK_FLOPS.get(torch.cuda.get_device_name(device))


def seed_rngs(seed: int, *, cuda_tracker: bool) -> None:
    """torch's generators (every device) and, with `cuda_tracker`, megatron's tensor-parallel
    CUDA RNG tracker. A model built for CUDA (`use_cpu_initialization=False`) draws from the
    tracker: megatron's weight init (`_initialize_affine_weight_gpu`), dropout inside
    tensor-parallel regions and activation recompute fork it, and an unseeded tracker raises
    "cuda rng state model-parallel-rng is not added". Every build seeds it first
    (models/llama.model_config)."""
    torch.manual_seed(seed)
    if cuda_tracker:
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)
