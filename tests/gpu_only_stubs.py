"""Import stubs for the GPU-only libraries Megatron-Bridge's modules import at module level
(`transformer_engine`, NVIDIA's `modelopt`, and `nvidia_resiliency_ext`, which
`megatron.bridge.training.pretrain` imports: its CPU-installable 0.4.1 breaks megatron-core
0.19's own version check), which cannot be installed without CUDA. Tests only.

Bridge's own code is never stubbed: with these installed, `megatron.bridge.training.losses`,
`gpt_step` and `models.gpt_provider` import as they are and run on the CPU. A stub module
answers any attribute with a placeholder class (so Bridge's `isinstance(x, te.Linear)` and
annotations work); its version is 0.0.0. Called, a Transformer Engine placeholder raises (no
test may run TE); the others' return None, what ModelOpt's helpers answer for a model it has
not converted (Bridge's train_step asks `get_tensor_shapes_adjust_fn_for_distillation`).

Installed after megatron-core's modules are imported (`install()` imports the ones the tests
build models with first), so that megatron-core's own "is Transformer Engine installed"
checks, made at their import, still see the truth.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types

STUBBED = ("transformer_engine", "modelopt", "nvidia_resiliency_ext")
# megatron-core modules whose import-time Transformer Engine checks must see it absent
MEGATRON_FIRST = (
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.tensor_parallel",
    "megatron.core.distributed",
    "megatron.core.optimizer",
    "megatron.core.pipeline_parallel",
    "megatron.core.dist_checkpointing",
    "del_megatron.models.spec",
)


class _Placeholder(type):
    """A class standing for one name of a stubbed library."""

    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{cls.__name__}.{name}")

    def __call__(cls, *args, **kwargs):
        if not cls.__name__.startswith("transformer_engine."):
            return None
        raise RuntimeError(f"{cls.__name__} is a stub of a GPU-only library (tests only)")


def _placeholder(name: str) -> type:
    return _Placeholder(name, (), {})


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{self.__name__}.{name}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names: list[str]) -> None:
        self.names = names

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.names:
            return importlib.util.spec_from_loader(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StubModule(spec.name)

    def exec_module(self, module):
        module.__version__ = "0.0.0"
        module.__path__ = []


def install() -> None:
    """Stub the GPU-only libraries that are not installed (idempotent)."""
    for name in MEGATRON_FIRST:
        importlib.import_module(name)
    missing = [n for n in STUBBED if importlib.util.find_spec(n) is None]
    if missing and not any(isinstance(f, _StubFinder) for f in sys.meta_path):
        sys.meta_path.append(_StubFinder(missing))
