"""train.deterministic sets what every library reads before it initialises: torch's flag and
cuBLAS's workspace, Transformer Engine's NVTE_ALLOW_NONDETERMINISTIC_ALGO=0, NCCL's ring
algorithm, megatron's deterministic_mode on the model's config; an NCCL algorithm that
reduces in a varying order is refused in one line. Failed on the code before: only torch's
flag and CUBLAS_WORKSPACE_CONFIG were set (issue 50, item 4)."""

from __future__ import annotations

import pytest
import torch

from del_megatron import runtime
from del_megatron.errors import UserError

SET = ("CUBLAS_WORKSPACE_CONFIG", "NVTE_ALLOW_NONDETERMINISTIC_ALGO", "NCCL_ALGO")


@pytest.fixture
def clean(monkeypatch):
    for name in SET:  # set, then deleted: what the test sets is undone after it
        monkeypatch.setenv(name, "before")
        monkeypatch.delenv(name)
    before = torch.are_deterministic_algorithms_enabled()
    yield monkeypatch
    torch.use_deterministic_algorithms(before)


def test_every_library_is_told(clean):
    import os

    runtime.deterministic_algorithms(True)
    assert torch.are_deterministic_algorithms_enabled()
    assert os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] == "0"
    assert os.environ["NCCL_ALGO"] == "Ring"
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_a_users_tree_is_kept_and_nvls_refused(clean):
    import os

    clean.setenv("NCCL_ALGO", "Tree")
    runtime.deterministic_algorithms(True)
    assert os.environ["NCCL_ALGO"] == "Tree"
    clean.setenv("NCCL_ALGO", "NVLS")
    with pytest.raises(UserError, match="NCCL_ALGO=Ring or Tree"):
        runtime.deterministic_algorithms(True)


def test_off_sets_nothing(clean):
    import os

    runtime.deterministic_algorithms(False)
    assert not any(name in os.environ for name in SET)


def test_megatrons_deterministic_mode_is_on_the_models_config(
    one_process_groups, spm_split_digits, tmp_path
):
    from del_megatron.tokenizer import Tokenizer
    from del_megatron.training.build import build_model

    from .test_output_weight_hooks import config

    cfg = config(spm_split_digits, tmp_path, fused=False, tied=False)
    on = cfg.model_copy(update={"train": cfg.train.model_copy(update={"deterministic": True})})
    tokenizer = Tokenizer(spm_split_digits)
    assert not build_model(cfg, torch.device("cpu"), tokenizer).config.deterministic_mode
    assert build_model(on, torch.device("cpu"), tokenizer).config.deterministic_mode
