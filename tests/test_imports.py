"""The schemas and the plan import no megatron-core: the run config, the config.json mapping
and the memory plan are read on login nodes and in --check / --dry-run before anything is
built, and megatron-core is not needed to describe a model. Each module is imported in a
fresh interpreter (one already holding megatron would hide the import)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from .distributed.launcher import ROOT

FREE_OF_MEGATRON = [
    "del_megatron.config",
    "del_megatron.models.hf_config",
    "del_megatron.training.plan",
    "del_megatron.models.hf_tensors",
    "del_megatron.models.weight_files",
]


@pytest.mark.parametrize("module", FREE_OF_MEGATRON)
def test_module_imports_no_megatron_core(module):
    probe = (
        f"import sys, {module}\n"
        "found = sorted(m for m in sys.modules if m == 'megatron' or m.startswith('megatron.'))\n"
        "print(found[:3])\n"
        "sys.exit(1 if found else 0)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"{module} imports {done.stdout.strip()} {done.stderr[-2000:]}"


def test_the_record_is_still_exported_by_the_models_package():
    from del_megatron.models import LlamaArchitecture
    from del_megatron.models.architecture import LlamaArchitecture as record

    assert LlamaArchitecture is record


def test_del_eval_help_waits_for_no_torch():
    """`del-eval --help` took 6 s: torch and megatron-core were imported before argparse ran
    (by the package's loss exports and the evaluation package)."""
    probe = (
        "import sys, del_megatron.cli.eval, del_megatron.evaluation\n"
        "sys.exit(1 if 'torch' in sys.modules else 0)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.megatron
@pytest.mark.skipif(
    importlib.util.find_spec("megatron.training") is None,
    reason="nothing to import by mistake: megatron.training ships with megatron-core 0.17+",
)
def test_the_megatron_lm_adapter_imports_neither_megatron_training_nor_bridge():
    """megatron-core 0.16's wheel has no megatron.training, and Megatron-Bridge is an install
    of its own: the package and its Megatron-LM adapter import without either (the Bridge
    adapter, models/megatron_bridge.py, is imported only by its users)."""
    probe = (
        "import sys, del_megatron, del_megatron.models.gpt, del_megatron.models.megatron_lm\n"
        "from del_megatron.models import build_llama, loss_func\n"
        "found = sorted(m for m in sys.modules\n"
        "               if m.startswith(('megatron.training', 'megatron.bridge')))\n"
        "print(found[:3])\n"
        "sys.exit(1 if found else 0)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"imports {done.stdout.strip()} {done.stderr[-2000:]}"
