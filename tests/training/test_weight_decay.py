"""Weight decay by parameter, the same in both engines: no decay on norm weights and biases
(Megatron-LM's, Hugging Face Trainer's and nanoGPT's convention), optim.weight_decay on
every other parameter, read from each optimizer's own groups (what its step applies).

Failed on the code before: megatron's optimizer marks norms and biases `wd_mult=0`, but only
megatron's OptimizerParamScheduler applies it and the engine steps a LambdaLR, so every group
kept weight_decay=0.1; DeepSpeed's engine had one group, decayed whole."""

from __future__ import annotations

import json

import pytest

from ..distributed.launcher import run_torchrun

WEIGHT_DECAY = 0.1


@pytest.fixture(scope="module")
def groups(synth_tokenizer, synth_shards):
    said = run_torchrun(
        "weight_decay.py", 1, str(synth_tokenizer), str(synth_shards), "deepspeed", "megatron"
    )
    found: dict[str, dict[str, dict[str, float]]] = {"DECAY": {}, "LR": {}}
    for line in said.splitlines():
        kind, _, rest = line.partition(" ")
        if kind in found:
            engine, _, values = rest.partition(" ")
            found[kind][engine] = json.loads(values)
    return found


def exempt(name: str) -> bool:
    """A norm weight or a bias (the model's 1-D parameters)."""
    return name.endswith("bias") or "norm" in name


def test_norms_and_biases_are_not_decayed_in_either_engine(groups):
    for engine, decay in groups["DECAY"].items():
        assert any(exempt(n) for n in decay) and any(not exempt(n) for n in decay), engine
        wrong = {n: d for n, d in decay.items() if d != (0.0 if exempt(n) else WEIGHT_DECAY)}
        assert not wrong, f"{engine}: {wrong}"


def test_both_engines_decay_the_same_parameters(groups):
    deepspeed, megatron = groups["DECAY"]["deepspeed"], groups["DECAY"]["megatron"]
    assert set(deepspeed) == set(megatron)
    assert deepspeed == megatron


def test_every_group_follows_the_schedule(groups):
    """The schedule moves every group's learning rate alike (megatron's lr_mult is 1 here)."""
    for engine, lr in groups["LR"].items():
        assert len(set(lr.values())) == 1, f"{engine}: {sorted(set(lr.values()))}"
