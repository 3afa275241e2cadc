"""megatron-core's training engine on the CPU: what a run on `train.device=cpu` (the tiny
config, the tests) needs of megatron's schedules, DDP and optimizers, and nothing a GPU run
ever calls (applied by the run's device: training/engines/megatron.py `engine_on`; the model
spec, models/spec.py `apply_device_shims`). With them a CPU run takes the GPU configuration
too (the distributed optimizer, overlapped reduce and gather, bf16: the config's choices).

megatron-core's pipeline schedules, its DistributedDataParallel buffers, its optimizer and
its rerun state machine allocate a few small tensors on a hard-coded CUDA device
(`torch.zeros(..., device="cuda")`, `device=torch.cuda.current_device()`; 0.16.1 and 0.19.2
alike), so they cannot run on a machine without a GPU, although every other op of theirs runs
on gloo. `rebind()` rebinds one name, `torch`, in each of those modules (and in no other) to
a view of torch whose tensor factories put a CUDA device on the CPU and whose
`torch.cuda.current_device()` is the CPU; everything else is torch itself; and it rebinds
megatron's gradient clip in its optimizer module to the same clip without its assertion of
`torch.cuda.FloatTensor` gradients. Idempotent.

`keep_rotary_on_cpu(model)` gives a built model's rotary embeddings a class whose
frequencies stay on the CPU (the stock one moves them to CUDA).

`cuda_type_names()`, around building megatron's optimizers, has a CPU tensor's `type()`
name its CUDA twin, which is all their checks of a parameter's device read.

`tensor_cuda_stays()` is the one other shim, for code that moves a tensor with
`tensor.cuda()` (megatron's tied embeddings on the last pipeline stage,
`LanguageModule.setup_embeddings_and_output_layer`; Megatron-Bridge's `get_batch`): inside
it, `Tensor.cuda` returns the tensor where it is (a torch function mode, so no name changes).
"""

from __future__ import annotations

import contextlib
import importlib
import types
from typing import Any

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from torch.overrides import TorchFunctionMode

# the megatron-core modules with hard-coded CUDA allocations on the paths the tests run
MODULES = (
    "megatron.core.pipeline_parallel.schedules",  # total_num_tokens
    "megatron.core.pipeline_parallel.p2p_communication",  # receive buffers, shapes
    "megatron.core.distributed.param_and_grad_buffer",  # DDP's parameter and gradient buffers
    "megatron.core.optimizer.optimizer",  # the FP32 optimizer's scale
    "megatron.core.optimizer.distrib_optimizer",  # its state buffers
    "megatron.core.optimizer.clip_grads",  # the gradient norm
    "megatron.core.utils",  # ... its fallback without Apex (local_multi_tensor_l2_norm)
    "megatron.core.rerun_state_machine",  # its saved generator; a rejected result's device
    # distributed checkpoints: a synchronize before the write, the agreement after it
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
)
# the loops' modules of the same kind, patched where a test runs that loop (`also=`): their
# train_step's reductions across ranks
MEGATRON_LM = "megatron.training.utils.common_utils"  # megatron-core's wheel, 0.17+
MEGATRON_BRIDGE = "megatron.bridge.training.utils.train_utils"
_FACTORIES = ("empty", "full", "ones", "tensor", "zeros")


def _on_cpu(device: Any) -> Any:
    if device is None:
        return None
    if isinstance(device, int) or torch.device(device).type == "cuda":
        return torch.device("cpu")
    return device


class _NoStream:
    """The CPU's one stream: nothing to wait for."""

    def wait_event(self, event: Any) -> None:
        return None

    def wait_stream(self, stream: Any) -> None:
        return None


class _CudaOnCpu:
    """torch.cuda, but its current device is the CPU, its current stream the CPU's (0.19's
    gradient sync asks for it unconditionally), its generator the CPU's and synchronize waits
    for nothing."""

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def current_stream(*args: Any) -> _NoStream:
        return _NoStream()

    @staticmethod
    def synchronize(*args: Any) -> None:
        return None

    # the rerun state machine saves and restores the generator of the device it runs on
    @staticmethod
    def get_rng_state(*args: Any) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, *args: Any) -> None:
        torch.set_rng_state(state)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class CpuTorch(types.ModuleType):
    """torch, with a CUDA device given to a tensor factory read as the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CudaOnCpu()
        for name in _FACTORIES:
            vars(self)[name] = _factory(getattr(torch, name))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _factory(make):
    def on_cpu(*args, device=None, **kwargs):
        return make(*args, device=_on_cpu(device), **kwargs)

    return on_cpu


_CPU_TORCH = CpuTorch()


@torch.no_grad()
def clip_by_total_norm(parameters, max_norm, total_norm, use_decoupled_grad: bool = False):
    """megatron's `clip_grad_by_total_norm_fp32` (optimizer/clip_grads.py, 0.16.1 and
    0.19.2) on CPU gradients: the same coefficient, max_norm / (total_norm + 1e-6), applied
    where it is below 1, without the assertion that each gradient is a CUDA tensor."""
    coeff = max_norm / (total_norm + 1.0e-6)
    if isinstance(coeff, torch.Tensor):
        coeff = coeff.clamp(max=1.0)
    elif coeff >= 1.0:
        return
    for param in parameters:
        grad = getattr(param, "decoupled_grad", None) if use_decoupled_grad else param.grad
        if grad is not None:
            grad.mul_(coeff)


# (module, name) -> the CPU's stand-in, rebound by `rebind` beside `torch`
FUNCTIONS = {
    ("megatron.core.optimizer.optimizer", "clip_grad_by_total_norm_fp32"): clip_by_total_norm
}


def rebind(*also: str) -> None:
    """Rebind `torch` in MODULES and the modules named in `also` (MEGATRON_LM,
    MEGATRON_BRIDGE) to the CPU view, and FUNCTIONS (idempotent)."""
    for name in MODULES + also:
        module = importlib.import_module(name)
        if module.torch is not _CPU_TORCH:
            module.torch = _CPU_TORCH
    for (name, attribute), stand_in in FUNCTIONS.items():
        vars(importlib.import_module(name))[attribute] = stand_in


class _CudaTypeNames(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            if not args[0].is_cuda and name.startswith("torch."):
                return "torch.cuda." + name.removeprefix("torch.")
            return name
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def cuda_type_names():
    """Inside: `tensor.type()` of a CPU tensor names its CUDA twin ('torch.cuda.FloatTensor',
    'torch.cuda.BFloat16Tensor'), the names megatron's optimizers sort parameters by when
    they build their float32 masters (optimizer.py and distrib_optimizer.py: anything else
    is refused, "Wrapped parameters must be one of torch.cuda.FloatTensor ...")."""
    with _CudaTypeNames():
        yield


class _CudaCallStays(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.cuda:
            return args[0]
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def tensor_cuda_stays():
    """Inside: `tensor.cuda(...)` is `tensor`."""
    with _CudaCallStays():
        yield



class CPURotaryEmbedding(RotaryEmbedding):
    """RotaryEmbedding whose frequencies stay on the CPU (the stock one moves them to CUDA)."""

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        if self.rotary_interleaved:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1)
            emb = emb.view(freqs.shape[0], -1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, None, None, :]  # [s, 1, 1, dim]


def keep_rotary_on_cpu(model: torch.nn.Module) -> None:
    """Every stock RotaryEmbedding of `model` made a `CPURotaryEmbedding`. Idempotent."""
    for module in model.modules():
        if type(module) is RotaryEmbedding:
            module.__class__ = CPURotaryEmbedding
