"""Host or device, told apart on a CPU: what a GPU run would refuse, seen without a GPU.

On CPU the loader's tensors and the compute device's tensors are the same memory, so a host
tensor handed to an NCCL collective, or a host tensor mixed with a device tensor in an op,
cannot fail here. `Residency` (a TorchFunctionMode) tracks where each tensor *would* live on
a GPU run and records each place where such a run would fail or stall:

* host tensors (`HostTensor`, a marker subclass): the loader's batches (`host_batches`),
  what `torch.tensor` and the other factories make without a `device=` when called from
  del_megatron/ (and torch's optimizers' scalar steps, host tensors unless fused or
  capturable), and what `.cpu()` and `.to("cpu")` return; ops on host tensors give host
  tensors; `.to(device)` with a device (the compute device: on this CPU run, `cpu`) gives a
  device tensor, as it would on the GPU. Host and compute device are both `cpu` here: our code
  names the host by the string "cpu" and the compute device by the `torch.device` the run
  resolved (runtime.resolve_device), which is how the two are told apart; a host tensor's
  `.device` says `HOST` (cpu:0), not the compute device, so code that moves what is not on
  the device yet (`engines/megatron._on`) moves it here as on a GPU.
* page-locked host memory (`Pinned`, a host tensor): what `checkpoint/host.host_buffer`
  returns, marked by `pinned`. On CUDA that function is `torch.empty(..., pin_memory=True)`,
  which a CPU-only torch refuses: on CPU it makes plain memory, and the mark stands for the
  CUDA branch, one line beside it (the copy into it and the wait run as on a GPU). Also what
  a `non_blocking` `.to("cpu")` of a device tensor returns (torch allocates it page-locked).
* a violation: a host tensor handed to a torch.distributed collective (NCCL takes CUDA
  tensors only), or an op of our code mixing host and device tensors of more than zero
  dimensions (CUDA refuses that; 0-dim host tensors are scalars it accepts).
* a host synchronisation, from our code, counted per phase:
  - a read: `.item()`, `.tolist()`, `float()`/`int()`/`bool()` of a device tensor, or
    `.cpu()` of one;
  - a shape that depends on a device tensor's values (`DATA_DEPENDENT`: nonzero,
    masked_select, unique, ..., and indexing with a boolean mask, read or written): the host
    waits for the device to learn the size;
  - a blocking host-to-device copy: `torch.tensor` / `as_tensor` of Python data onto the
    device, or `.to(device)` of a host tensor that is not a loader batch (those are pinned
    and copied `non_blocking` on a GPU, `runtime.batch_to_device`) and not
    `non_blocking` itself;
  - a device-to-host copy (`.cpu()`, `.to("cpu")`, `host.copy_(device_tensor)`) unless it
    is `non_blocking` into page-locked memory (`Pinned`): into pageable memory CUDA stages
    the copy and the host waits, once per tensor. That a non-blocking copy is waited for
    before it is read is not checked here (checkpoint/save.py waits once);
  - a wait for the device, `runtime.synchronize` (`waits` wraps it: it does nothing on CPU).

Only calls made from del_megatron/ are judged; megatron-core, DeepSpeed and torch make their
own tensors (megatron's CPU shims, models/megatron_on_cpu.py, act for megatron: their calls
are megatron's). `Residency(library_phases=("train_step",))` judges the reads (`SYNCS`,
device-to-host copies, shapes from values) that megatron-core's own code makes, too, in the
phases named: what its schedules, DDP and optimizer read during a step. The rules are a model
of CUDA's, kept small: factories, `to`/`cpu`, copies, and "an op's result lives where its
inputs live". A mark is the tensor's class, set in place on an op's result (`_mark`: no view,
which megatron refuses of a parameter's data and a stage's output).
"""

from __future__ import annotations

import collections
import functools
import importlib.util
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

OURS = str(Path(__file__).resolve().parents[2] / "del_megatron") + "/"
TORCH = str(Path(torch.__file__).resolve().parent) + "/"
HERE = str(Path(__file__).resolve())
OPTIM = TORCH + "optim/"
SHIMS = OURS + "models/megatron_on_cpu.py"
# what a host tensor's `.device` says: not the compute device (`cpu`), as on a GPU run, where
# code that moves what is not on the device yet compares the two (and a CPU device still)
HOST = torch.device("cpu", 0)
DEVICE = torch.Tensor.device.__get__
MEGATRON = str(Path(importlib.util.find_spec("megatron.core").origin).resolve().parent) + "/"

FACTORIES = {
    "tensor",
    "as_tensor",
    "from_numpy",
    "frombuffer",
    "zeros",
    "ones",
    "empty",
    "full",
    "arange",
    "rand",
    "randn",
    "randint",
    "linspace",
    "eye",
}
SYNCS = {"item", "tolist", "__float__", "__int__", "__bool__", "__index__", "numpy"}
# ops whose result's shape depends on the values of a device tensor
DATA_DEPENDENT = {
    "nonzero",
    "argwhere",
    "masked_select",
    "masked_scatter",
    "unique",
    "unique_consecutive",
    "bincount",
}
INDEXING = {"__getitem__", "__setitem__", "index_put", "index_put_"}
COPIES_DATA = {"tensor", "as_tensor"}  # factories that copy Python data
KEEPS_SELF = {"copy_", "__setitem__", "set_"}  # cross-device copies are allowed
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "broadcast",
    "reduce",
    "all_to_all_single",
)


class HostTensor(torch.Tensor):
    """A tensor that, on a GPU run, lives in host memory (a marker only)."""

    __torch_function__ = torch._C._disabled_torch_function_impl


class HostBatch(HostTensor):
    """A loader's batch tensor: host memory that a GPU run pins and copies `non_blocking`."""


class Pinned(HostTensor):
    """Page-locked host memory: a `non_blocking` copy from the device into it does not wait."""


def _bool_index(args) -> bool:
    """Whether an indexing call's index holds a boolean tensor (a mask)."""
    index = args[1] if len(args) > 1 else None
    parts = index if isinstance(index, (tuple, list)) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


def _host(t) -> bool:
    return isinstance(t, HostTensor)


def _mark(t: torch.Tensor, cls: type, inputs=()) -> torch.Tensor:
    """`t` as a `cls` (a marker class, or torch.Tensor: no mark). An op's own result is
    marked in place (its class set: no view, the autograd graph kept); an input an op
    returned as it is (`to` with nothing to do) is aliased, as the input keeps its mark: in
    the autograd graph by `as_subclass` (a view), elsewhere with no view, as megatron asserts
    of a parameter's data (param_and_grad_buffer.py: a module's `.to(device)` sets each
    parameter's data to what `to` returns) and of a stage's output (schedules.py
    `deallocate_output_tensor`)."""
    if not any(t is i for i in inputs):
        t.__class__ = cls
        return t
    if t.requires_grad and torch.is_grad_enabled():
        return t.as_subclass(cls)
    return torch.Tensor._make_subclass(cls, t, False)


def _as(t, host: bool, inputs=()):
    """`t` marked as a host tensor, or not."""
    if not isinstance(t, torch.Tensor) or _host(t) == host:
        return t
    return _mark(t, HostTensor if host else torch.Tensor, inputs)


def _caller() -> str | None:
    """file:line of the first frame outside torch, this module and megatron's CPU shims
    (models/megatron_on_cpu.py: its factories and modes stand in for megatron's own calls,
    which are megatron's, not ours)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(TORCH) and name not in (HERE, SHIMS):
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    return None


def _is_host_name(device) -> bool:
    return (isinstance(device, str) and device == "cpu") or (
        isinstance(device, torch.device) and device == HOST
    )


def _names_host(func_name: str, args, kwargs) -> bool:
    """Whether a `to`/factory call names host memory: the device as the string "cpu", or a
    host tensor's `.device` (HOST)."""
    if _is_host_name(kwargs.get("device")):
        return True
    return func_name == "to" and any(_is_host_name(a) for a in args[1:])


def _device_arg(func_name: str, args, kwargs):
    """The device a `to`/factory call names, or None."""
    if "device" in kwargs and kwargs["device"] is not None:
        return torch.device(kwargs["device"])
    if func_name == "to":
        for a in args[1:]:
            if isinstance(a, (torch.device, str)):
                return torch.device(a)
            if isinstance(a, torch.Tensor):
                return a.device
    return None


class Residency(TorchFunctionMode):
    def __init__(self, library_phases: tuple[str, ...] = ()) -> None:
        """library_phases: the phases (name prefixes) in which megatron-core's reads are
        counted too."""
        super().__init__()
        self.violations: list[str] = []
        self.syncs: collections.Counter[str] = collections.Counter()
        self.sync_places: dict[str, list[str]] = collections.defaultdict(list)
        self.phase = "setup"
        self.library_phases = library_phases
        self._originals: dict[str, object] = {}

    # ---- tensors ----------------------------------------------------------------------

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == DEVICE and args and _host(args[0]):
            return HOST
        name = getattr(func, "__name__", "")
        where = _caller()
        ours = where is not None and where.startswith(OURS)
        # whose reads are judged: ours, and megatron-core's in the phases asked for
        judged = ours or (
            where is not None
            and where.startswith(MEGATRON)
            and any(self.phase.startswith(p) for p in self.library_phases)
        )
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        hosts = [t for t in tensors if _host(t)]
        result = func(*args, **kwargs)
        on_device = bool(tensors) and not _host(tensors[0])
        # DeepSpeed names its CPU accelerator "cpu" too: our and megatron's `to` only
        to_host = judged and name == "to" and _names_host(name, args, kwargs)
        if name in SYNCS and judged and on_device:
            self._sync(name, where)
        elif to_host and on_device and not kwargs.get("non_blocking", False):
            self._sync("to() to the host (a blocking copy)", where)
        elif (
            judged
            and name == "copy_"
            and _host(args[0])
            and len(args) > 1
            and isinstance(args[1], torch.Tensor)
            and not _host(args[1])
            and not (kwargs.get("non_blocking", False) and isinstance(args[0], Pinned))
        ):
            self._sync("copy_() to the host, not non_blocking into page-locked memory", where)
        elif (
            judged
            and on_device
            and (
                name in DATA_DEPENDENT
                or (name == "where" and len(args) + len(kwargs) == 1)
                or (name in INDEXING and _bool_index(args))
            )
        ):
            self._sync(f"{name} (a shape from the device's values)", where)
        elif ours and name in COPIES_DATA and not tensors:
            if _device_arg(name, args, kwargs) is not None:
                self._sync(f"torch.{name} of Python data onto the device", where)
        elif (
            ours
            and name in ("to", "cuda")
            and not to_host
            and _host(args[0])
            and not isinstance(args[0], HostBatch)
            and not kwargs.get("non_blocking", False)
            and (_device_arg(name, args, kwargs) is not None or name == "cuda")
        ):
            self._sync(f"{name}() of a host tensor (a blocking copy)", where)
        if name in KEEPS_SELF:
            return result
        if name == "cpu" or name == "pin_memory":
            if judged and name == "cpu" and not _host(args[0]):
                self._sync("cpu()", where)
            return _as(result, True, tensors)
        if to_host:
            if on_device and kwargs.get("non_blocking", False):
                return _mark(result, Pinned, tensors)  # torch allocates it page-locked
            return _as(result, True, tensors)
        if name == "to" or name == "cuda":
            device = _device_arg(name, args, kwargs)
            if device is not None or name == "cuda":
                return _as(result, False, tensors)  # on the compute device now
            return _as(result, _host(args[0]), tensors)
        if name in FACTORIES:
            host = _device_arg(name, args, kwargs) is None or _names_host(name, args, kwargs)
            # torch's optimizers make their scalar steps on the host (unless fused or capturable)
            optim = sys._getframe(1).f_code.co_filename.startswith(OPTIM)
            if host and (ours or optim):
                return _as(result, True, tensors)
            return result
        if not hosts:
            return result
        devices = [t for t in tensors if not _host(t)]
        big_hosts = [t for t in hosts if t.dim() > 0]
        if devices and big_hosts and any(t.dim() > 0 for t in devices) and ours:
            self.violations.append(f"{name} mixes host and device tensors at {where}")
        if devices and not big_hosts:
            return result  # 0-dim host tensors act as scalars on the device
        if isinstance(result, (tuple, list)):
            return type(result)(_as(r, True, tensors) for r in result)
        return _as(result, True, tensors)

    def _sync(self, what: str, where: str | None) -> None:
        self.syncs[self.phase] += 1
        self.sync_places[self.phase].append(f"{what} at {where}")

    # ---- collectives ------------------------------------------------------------------

    def watch_collectives(self) -> None:
        """Wrap torch.distributed's collectives (everyone's: ours, megatron's, DeepSpeed's
        look them up at call time) with the host-tensor check."""
        for name in COLLECTIVES:
            original = getattr(dist, name)
            self._originals[name] = original
            setattr(dist, name, self._checked(name, original))

    def _checked(self, name, original):
        @functools.wraps(original)
        def call(*args, **kwargs):
            leaves = tree_flatten((args, kwargs))[0]
            if any(_host(t) for t in leaves):
                frame = sys._getframe(1)
                while frame.f_code.co_filename.startswith(TORCH):
                    frame = frame.f_back
                self.violations.append(
                    f"{name} got a host tensor at {frame.f_code.co_filename}:{frame.f_lineno}"
                )
            return original(*args, **kwargs)

        return call

    @staticmethod
    def pinned(allocate):
        """checkpoint/host.host_buffer, whose memory is page-locked on a GPU run: its results
        marked `Pinned` (on CPU it makes plain memory: pinning needs CUDA)."""

        @functools.wraps(allocate)
        def call(*args, **kwargs):
            return _mark(allocate(*args, **kwargs), Pinned)

        return call

    def waits(self, synchronize):
        """runtime.synchronize, counted as the host synchronisation it is on a GPU run (on
        CPU it waits for nothing)."""

        @functools.wraps(synchronize)
        def call(*args, **kwargs):
            frame = sys._getframe(1)
            self._sync("runtime.synchronize", f"{frame.f_code.co_filename}:{frame.f_lineno}")
            return synchronize(*args, **kwargs)

        return call

    @staticmethod
    def host_batches(iterate):
        """A loader's __iter__ whose batches are host tensors, as a loader's are on a GPU run
        (torch.from_numpy, where they are born, is not seen by torch function modes)."""

        @functools.wraps(iterate)
        def call(*args, **kwargs):
            for batch in iterate(*args, **kwargs):
                yield {k: v.as_subclass(HostBatch) for k, v in batch.items()}

        return call

    def in_backward(self, function: type[torch.autograd.Function]) -> staticmethod:
        """`function.backward` run under this mode too (set it on the class): torch runs
        backward with no torch function mode active, and our ops form their gradients there."""
        original = function.backward

        def backward(ctx, *grads):
            with self:
                return original(ctx, *grads)

        return staticmethod(backward)

    def phased(self, phase: str, fn):
        """fn, run with `self.phase` set to `phase` (numbered by call)."""
        counter = collections.Counter()

        @functools.wraps(fn)
        def call(*args, **kwargs):
            counter[phase] += 1
            previous, self.phase = self.phase, f"{phase}#{counter[phase]}"
            try:
                return fn(*args, **kwargs)
            finally:
                self.phase = previous

        return call
