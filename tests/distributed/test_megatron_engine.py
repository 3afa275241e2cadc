"""train.engine=megatron against the deepspeed engine's single-process run: 5 optimizer steps
of del-train's step (trainer.setup / train_step) from one set of initial weights, at pipeline
parallel 2 (4 layers split 1 + 3) for every loss kind, with tied embeddings (EMO's output
weights on the last stage, the embedding on the first, kept equal), with virtual stages, at
PP 2 x TP 2 (the vocabulary of 800 pads to 832 at TP 1 and 896 at TP 2) and PP 2 x DP 2.

Each step's loss and gradient norm before clipping within 1e-4 relative, every parameter
after the last step within 2e-5 absolute (2% of one Adam step at lr 1e-3;
workers/megatron_engine.py gathers them over stages and tensor-parallel ranks). The two
engines' Adam is torch's AdamW; the schedules' per-token loss and finalize_model_grads make
megatron's gradient that of the global batch's token mean, as the deepspeed engine's
explicit scaling does, so a loss normalised per micro-batch, rank or stage fails here
(token counts differ between micro-batches and ranks).

The deepspeed engine at TP 2 from the same initial weights is a row too: megatron's layers
set their tensor-parallel attributes only when they initialize randomly, and without them
the gradient norm left out tensor-parallel rank 1's shards (0.530 against 0.848 at step 1:
models/llama.mark_tensor_parallel)."""

from __future__ import annotations

import json

import pytest

from del_megatron.config import ConfigError, parse_run_config

from ..utils import assert_close, logged_steps
from .launcher import run_torchrun

KINDS = ["mle", "del", "del_distance", "ntl_was", "ntl_mse", "dist2", "mixce", "emo"]
REFERENCES = [f"deepspeed:1:1/{k}" for k in KINDS] + ["deepspeed:1:1/emo+tied"]
ONE = ["megatron:1:1/del"]
TWO = [f"megatron:1:2/{k}" for k in KINDS] + [
    "megatron:1:2/emo+tied",
    "megatron:1:2:2/del",
    "deepspeed:2:1/del",
]
FOUR = ["megatron:2:2/del", "megatron:2:2/emo+tied", "megatron:1:2/del"]  # the last: DP 2
CHECKS = {2: ["random-start"]}  # worker checks that print OK (workers/megatron_engine.py)


def _load(out_dir, variant):
    import torch

    path = out_dir / f"{variant.replace('/', '_')}.json"
    trajectory = json.loads(path.read_text())
    trajectory["params"] = torch.load(str(path) + ".pt", weights_only=True)
    return trajectory


@pytest.fixture(scope="module")
def trajectories(synth_tokenizer, synth_shards, tmp_path_factory):
    """Every variant's trajectory: {(processes, variant): trajectory}."""
    root = tmp_path_factory.mktemp("megatron-engine")
    init = root / "init"
    found = {}
    for processes, variants in ((1, ["init", *REFERENCES, *ONE]), (2, TWO), (4, FOUR)):
        out = root / f"np{processes}"
        out.mkdir()
        args = [str(synth_tokenizer), str(synth_shards), str(out), str(init)]
        said = run_torchrun(
            "megatron_engine.py", processes, *args, *variants, *CHECKS.get(processes, [])
        )
        for variant in variants:
            if variant != "init":
                found[processes, variant] = _load(out, variant)
        found[processes, "output"] = said
    return found


def _reference_of(variant: str) -> str:
    kind = variant.partition("/")[2]
    return f"deepspeed:1:1/{kind}"


CASES = [(1, v) for v in ONE] + [(2, v) for v in TWO] + [(4, v) for v in FOUR]


@pytest.mark.slow
@pytest.mark.parametrize(("processes", "variant"), CASES, ids=[f"{n}-{v}" for n, v in CASES])
def test_follows_the_single_process_deepspeed_run(trajectories, processes, variant):
    got = trajectories[processes, variant]
    want = trajectories[1, _reference_of(variant)]
    what = f"{variant} on {processes} process(es)"
    for key in ("losses", "grad_norms"):
        for step, (a, b) in enumerate(zip(got[key], want[key], strict=True)):
            assert abs(a - b) <= 1e-4 * abs(b), (what, key, step, a, b)
    assert got["params"].keys() == want["params"].keys(), what
    for name, value in want["params"].items():
        assert_close(got["params"][name], value, atol=2e-5, what=f"{what} {name}")


@pytest.mark.slow
def test_a_random_start_is_one_model_at_every_layout(trajectories):
    """From no initial weights (a random start, train.seed), megatron's engine at PP 2 x 2
    virtual stages with tied embeddings and the deepspeed engine at TP 2 hold, gathered,
    bit for bit the model one process builds (models/random_start.py: each tensor drawn from
    the seed and its global name). Before, each chunk drew from train.seed + 100 x pipeline
    rank + virtual stage and the deepspeed engine's TP 2 padded the vocabulary to 896 rows
    against 832 at TP 1, so each layout started from another model. The point of the test it
    replaces holds too: no two layers are copies (one seed for all chunks once made them
    copies); and another seed draws another model."""
    said = "OK one random start: PP 2 x VP 2 and TP 2 as one process; seeds differ"
    assert said in trajectories[2, "output"]


# ---- what the engines refuse, in one line -------------------------------------------------


def _config(**sections):
    base = {
        "model": {
            "vocab_size": 64,
            "hidden_size": 32,
            "ffn_hidden_size": 64,
            "num_layers": 4,
            "num_attention_heads": 4,
            "num_query_groups": 2,
            "max_position_embeddings": 32,
        },
        "train": {"steps": 1, "micro_batch_size": 1, "global_batch_size": 4, "seq_len": 16},
        "data": {"tokenizer": "t.model", "sources": [{"manifest": "m.json"}]},
    }
    for section, fields in sections.items():
        base[section] = {**base.get(section, {}), **fields}
    return parse_run_config(base)


MEGATRON = {"engine": "megatron", "checkpoints": False}


@pytest.mark.parametrize(
    ("sections", "said"),
    [
        (
            {"parallel": {"pipeline_parallel": 2}},
            "parallel.pipeline_parallel needs train.engine=megatron",
        ),
        (
            {"train": {"engine": "megatron", "layout_free_checkpoints": False}},
            "train.layout_free_checkpoints=false keeps DeepSpeed's own optimizer state",
        ),
        (
            {"train": MEGATRON, "parallel": {"pipeline_parallel": 3}},
            "model.num_layers=4 does not split over parallel.pipeline_parallel=3 stages",
        ),
        (
            {"train": MEGATRON, "parallel": {"pipeline_parallel": 3, "first_stage_layers": 1}},
            "with parallel.first_stage_layers=1: the stages between take equal shares",
        ),
        (
            {
                "train": MEGATRON,
                "parallel": {"pipeline_parallel": 2, "virtual_pipeline_parallel": 3},
            },
            "does not split into parallel.pipeline_parallel x virtual_pipeline_parallel = 6",
        ),
        (
            {"train": MEGATRON, "parallel": {"virtual_pipeline_parallel": 2}},
            "parallel.virtual_pipeline_parallel needs parallel.pipeline_parallel > 1",
        ),
    ],
)
def test_refusals_name_the_field(sections, said):
    with pytest.raises(ConfigError) as err:
        _config(**sections)
    assert said in str(err.value)
    assert "\n" not in str(err.value)


def test_pipeline_layout_splits_the_world_and_the_micro_batches():
    cfg = _config(train=MEGATRON, parallel={"pipeline_parallel": 2, "tensor_parallel": 2})
    assert cfg.data_parallel_size(8) == 2
    assert cfg.layout_text(8) == "tensor parallel 2 x pipeline parallel 2 x data parallel 2"
    with pytest.raises(ConfigError, match="not a multiple of parallel.tensor_parallel x"):
        cfg.data_parallel_size(6)
    virtual = _config(
        train={**MEGATRON, "global_batch_size": 3},
        parallel={"pipeline_parallel": 2, "virtual_pipeline_parallel": 2},
    )
    with pytest.raises(ConfigError, match="interleaved schedule needs the micro-batches"):
        virtual.accumulation_steps(2)


# ---- del-train itself --------------------------------------------------------------------


@pytest.mark.slow
def test_a_stop_signal_to_the_last_stage_stops_every_stage(tmp_path, synth_tokenizer, synth_shards):
    """del-train at PP 2 on two processes started as srun starts them; SIGUSR1 to rank 1
    (the last stage) only: both stop at the same step, say there is no checkpoint to continue
    from, and exit 1 (not 75: a requeue would start again from step 0)."""
    import signal
    import time

    from ..training.test_resume import start_ranks, train_args

    out = tmp_path / "run"
    args = train_args(
        out,
        synth_tokenizer,
        synth_shards,
        "train.steps=400",
        "train.log_interval=1",
        "train.engine=megatron",
        "train.checkpoints=false",
        "parallel.pipeline_parallel=2",
        tp=1,
    )
    ranks = start_ranks(args, 2)
    metrics_file = out / "metrics.jsonl"
    deadline = time.time() + 300
    while len(logged_steps(metrics_file)) < 3:
        assert time.time() < deadline and all(r.poll() is None for r in ranks)
        time.sleep(0.05)
    ranks[1].send_signal(signal.SIGUSR1)
    outputs = [r.communicate(timeout=300)[0] for r in ranks]  # no hang
    assert [r.returncode for r in ranks] == [1, 1], outputs
    assert "tensor parallel 1 x pipeline parallel 2 x data parallel 1" in outputs[0]
    assert "nothing to continue from" in outputs[0], outputs[0]
    steps = [json.loads(line)["step"] for line in metrics_file.read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1)) and 3 <= len(steps) < 400
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())


@pytest.mark.slow
def test_a_pipeline_run_stopped_then_killed_resumes_bit_for_bit(
    tmp_path, synth_tokenizer, synth_shards
):
    """del-train at PP 2 (1 + 3 layers, EMO: its cost embedding and output layer on the last
    stage), started as srun starts it, against its uninterrupted twin: SIGUSR1 to the last
    stage only makes both stages save the step they are at and exit 75; `--resume same`
    continues, is SIGKILLed on both ranks once the checkpoint of step 8 is published, and
    continues again from the newest checkpoint to step 16. Every step's loss equals the
    twin's bit for bit, and so do the last checkpoint's weights (model/tp00-pp00 and -pp01)
    and its optimizer state's files."""
    import signal
    import time

    from ..training.test_resume import losses, start_ranks, train_args

    def args(out):
        return train_args(
            out,
            synth_tokenizer,
            synth_shards,
            "train.steps=16",
            "train.log_interval=1",
            "train.save_interval=4",
            "train.engine=megatron",
            "loss.kind=emo",
            "parallel.pipeline_parallel=2",
            "parallel.first_stage_layers=1",
            tp=1,
        )

    def until(ranks, metrics, step):
        deadline = time.time() + 300
        while not any(s >= step for s in logged_steps(metrics)):
            assert time.time() < deadline and all(r.poll() is None for r in ranks)
            time.sleep(0.05)

    # the uninterrupted twin and the last resume on warm ranks (runs to their end); the
    # stopped and the killed runs in fresh processes (their subject is the process)
    straight, out = tmp_path / "straight", tmp_path / "interrupted"
    ranks = start_ranks(args(straight), 2, warm=True)
    said = [r.communicate(timeout=600)[0] for r in ranks]
    assert [r.returncode for r in ranks] == [0, 0], said[0][-3000:]

    ranks = start_ranks(args(out), 2)
    until(ranks, out / "metrics.jsonl", 2)
    ranks[1].send_signal(signal.SIGUSR1)  # the last stage alone
    said = [r.communicate(timeout=300)[0] for r in ranks]
    assert [r.returncode for r in ranks] == [75, 75], said
    stopped = sorted((out / "checkpoints").glob("step-*"))
    assert stopped and int(stopped[-1].name.split("-")[1]) < 16, said[0]

    ranks = start_ranks([*args(out), "--resume", "same"], 2)
    deadline = time.time() + 300
    while not (out / "checkpoints" / "step-0000008" / "files.json").is_file():
        assert time.time() < deadline and all(r.poll() is None for r in ranks)
        time.sleep(0.02)
    for rank in ranks:
        rank.send_signal(signal.SIGKILL)
        rank.wait()
    newest = sorted((out / "checkpoints").glob("step-*"))[-1]
    assert (newest / "files.json").is_file() and newest.name != "step-0000016"

    ranks = start_ranks([*args(out), "--resume", "same"], 2, warm=True)
    said = [r.communicate(timeout=600)[0] for r in ranks]
    assert [r.returncode for r in ranks] == [0, 0], said[0][-3000:]
    resumed_at = int(newest.name.split("-")[1])
    assert f"at step {resumed_at}" in said[0], said[0][-3000:]
    a, b = losses(straight), losses(out)
    assert sorted(a) == sorted(b) == list(range(1, 17))
    for step in range(1, 17):
        assert a[step] == b[step], (step, a[step], b[step])  # bit for bit
    last = "checkpoints/step-0000016"
    names = ["model/tp00-pp00.safetensors", "model/tp00-pp01.safetensors"]
    names += [f"optim/tp00-pp{k:02d}-dp00.safetensors" for k in range(2)]
    for name in names:
        assert (straight / last / name).read_bytes() == (out / last / name).read_bytes(), name


@pytest.mark.slow
def test_the_stages_between_the_first_and_the_last_read_no_data(
    tmp_path, synth_tokenizer, synth_shards
):
    """del-train's loop at PP 3 (2 + 1 + 1 layers) on the streaming loader: the middle stage
    reads no training batch (as Megatron-LM's get_batch: activations only), the first and the
    last read every one, 4 steps x 6 micro-batches, and the losses follow the deepspeed
    engine's one-process run from the same weights on the same data (1e-4 relative; the
    counts show a middle stage
    that read the data, the losses one that fed the schedule wrong shapes or batches)."""
    args = [str(synth_tokenizer), str(synth_shards), str(tmp_path)]
    run_torchrun("pipeline_data.py", 1, *args, "one")  # first: it writes the initial weights
    run_torchrun("pipeline_data.py", 3, *args, "pp3")
    pp3, one = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("pp3", "one"))
    assert pp3["batches"] == [24, 0, 24] and one["batches"] == [24]
    assert len(pp3["losses"]) == len(one["losses"]) == 4
    for step, (a, b) in enumerate(zip(pp3["losses"], one["losses"], strict=True), start=1):
        assert abs(a - b) <= 1e-4 * abs(b), (step, a, b)
