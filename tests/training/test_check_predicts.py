"""The start-up checks try what the launch does instead of predicting it (issue 52, item 3).

* The pipeline split is megatron-core's own: `parallel.first_stage_layers` equal to
  `model.num_layers` (the last stage gets none) and `0` passed `--check` and `--dry-run`, then
  crashed at launch in megatron's ValueError, exit 1. A grid of splits against the rule
  megatron documents (every stage and virtual chunk at least one layer) runs on every
  supported megatron-core (marked megatron).
* Every refusal the build can make is said by `--check` (and `--dry-run`) in the same line
  the launch's ranks say, exit 2, no traceback: the table `REFUSALS` (config, engine,
  layout, data, tokenizer, output directory).
* Virtual PP with held-out evaluation passes `--check` and runs: megatron's interleaved
  schedule takes the held-out micro-batches as it takes a step's (Megatron-LM's `evaluate`
  hands it a step's worth too), the short last group filled.
* Writability is tried (a file or directory made and removed), not predicted by access():
  root passes access() where the filesystem refuses (HOME=/proc/nonexistent, a full disk),
  and DeepSpeed's extension build then died in makedirs with a traceback.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from del_megatron import caches
from del_megatron.config import ConfigError, parse_run_config

from ..distributed import launcher

ROOT = Path(__file__).resolve().parents[2]
TRAIN = "-m del_megatron.cli.train"


# ---- the pipeline split ------------------------------------------------------------------


def reference_split(
    layers: int, pp: int, vp: int | None, first: int | None, last: int | None
) -> list[int] | None:
    """Each stage's layers as megatron-core documents its split (None: refused): the first
    and last stage as given, the stages between equal shares of the rest, without either
    every stage layers / pp; every stage at least one layer, and with virtual stages each
    stage's layers in vp equal chunks of at least one (an uneven split with virtual stages
    is refused here: every chunk the same size)."""
    if vp is not None and (first is not None or last is not None):
        return None
    given = [n for n in (first, last) if n is not None]
    if any(n < 1 for n in given):
        return None
    middle, rest = pp - len(given), layers - sum(given)
    if (middle == 0 and rest != 0) or (middle and (rest < middle or rest % middle)):
        return None
    split = ([first] if first is not None else []) + [rest // middle if middle else 0] * middle
    split += [last] if last is not None else []
    if vp is not None and any(n % vp for n in split):
        return None
    return split


def split_config(layers: int, pp: int, vp: int | None, first: int | None, last: int | None):
    parallel = {"pipeline_parallel": pp, "virtual_pipeline_parallel": vp}
    parallel |= {"first_stage_layers": first, "last_stage_layers": last}
    return parse_run_config(
        {
            "model": {
                "vocab_size": 64,
                "hidden_size": 32,
                "ffn_hidden_size": 64,
                "num_layers": layers,
                "num_attention_heads": 4,
                "num_query_groups": 2,
                "max_position_embeddings": 32,
            },
            "parallel": parallel,
            "train": {
                "engine": "megatron",
                "checkpoints": False,
                "steps": 1,
                "micro_batch_size": 1,
                "global_batch_size": 12,  # a multiple of every pp here: VP's rule holds
                "seq_len": 16,
            },
            "data": {"tokenizer": "t.model", "sources": [{"manifest": "m.json"}]},
        }
    )


@pytest.mark.megatron
def test_the_pipeline_split_is_megatrons():
    """Every split of 1-6 layers over 2-4 stages (uneven first / last stages, virtual
    stages) is accepted by the config exactly when megatron's rule accepts it, and the
    stages' layers (the dry run's memory plan) are megatron's. Before: first_stage_layers=4
    of 4 at PP 2 was accepted with a last stage of 0 layers, first_stage_layers=0 with a
    first stage of none; both crashed at launch."""
    from del_megatron.training.engines.megatron import stage_layers

    disagree = []
    choices = [None, 0, 1, 2, 3, 4, 5, 6]
    for layers in range(1, 7):
        for pp in (2, 3, 4):
            splits = [(None, first, last) for first in choices for last in choices]
            splits += [(vp, None, None) for vp in (2, 3)]
            for vp, first, last in splits:
                if (first or 0) > layers or (last or 0) > layers:
                    continue
                want = reference_split(layers, pp, vp, first, last)
                try:
                    got = stage_layers(split_config(layers, pp, vp, first, last))
                except ConfigError as err:
                    got = None
                    assert "\n" not in str(err), err
                if got != want:
                    disagree.append(((layers, pp, vp, first, last), got, want))
    assert not disagree, f"{len(disagree)} splits differ, e.g. {disagree[:5]}"


# ---- every refusal: --check says the launch's line -----------------------------------------


def base_tree(tmp_path: Path, tokenizer: Path, manifest: Path) -> dict:
    """A run of 1 step of a 4-layer model on 2 ranks (the deepspeed engine's DP 2)."""
    return {
        "model": {
            "vocab_size": 832,
            "hidden_size": 32,
            "ffn_hidden_size": 64,
            "num_layers": 4,
            "num_attention_heads": 4,
            "num_query_groups": 2,
            "max_position_embeddings": 64,
            "make_vocab_size_divisible_by": 64,
        },
        "parallel": {"tensor_parallel": 1},
        "train": {
            "steps": 1,
            "micro_batch_size": 1,
            "global_batch_size": 4,
            "seq_len": 32,
            "device": "cpu",
            "checkpoints": False,
        },
        "data": {"tokenizer": str(tokenizer), "sources": [{"manifest": str(manifest)}]},
        "logging": {"wandb": "disabled", "progress_bar": False},
        "output_dir": str(tmp_path / "run"),
    }


MEGATRON_PP2 = ["train.engine=megatron", "parallel.pipeline_parallel=2"]

# (case, overrides, what the line says): every refusal del-train's config, start-up checks,
# engines and build make before the first step (grep UserError / ConfigError / ValueError in
# config.py, training/{preflight,build,initial_weights,trainer}.py, engines/, models/)
REFUSALS = [
    # the pipeline split (issue 52): megatron's own rule
    (
        "last stage gets no layers",
        [*MEGATRON_PP2, "parallel.first_stage_layers=4"],
        "does not split over parallel.pipeline_parallel=2 stages with "
        "parallel.first_stage_layers=4",
    ),
    (
        "first stage of no layers",
        [*MEGATRON_PP2, "parallel.first_stage_layers=0"],
        "num_layers_in_first_pipeline_stage must be larger than 0",
    ),
    (
        "last stage of every layer",
        [*MEGATRON_PP2, "parallel.last_stage_layers=4"],
        "with parallel.last_stage_layers=4",
    ),
    (
        "a virtual chunk of no layers",
        [*MEGATRON_PP2, "parallel.virtual_pipeline_parallel=4"],
        "= 8 equal chunks of at least one layer",
    ),
    (
        "uneven stages with virtual stages",
        [*MEGATRON_PP2, "parallel.virtual_pipeline_parallel=2", "parallel.first_stage_layers=1"],
        "with parallel.virtual_pipeline_parallel: not supported here",
    ),
    (
        "virtual stages without a pipeline",
        ["train.engine=megatron", "parallel.virtual_pipeline_parallel=2"],
        "parallel.virtual_pipeline_parallel needs parallel.pipeline_parallel > 1",
    ),
    (
        "interleaved schedule's micro-batches",
        [*MEGATRON_PP2, "parallel.virtual_pipeline_parallel=2", "train.global_batch_size=3"],
        "megatron's interleaved schedule needs the micro-batches of a step (3 per",
    ),
    (
        "uneven stages without a pipeline",
        ["train.engine=megatron", "parallel.first_stage_layers=2"],
        "need parallel.pipeline_parallel > 1",
    ),
    # the engines and the layout
    (
        "pipeline on deepspeed",
        ["parallel.pipeline_parallel=2"],
        "parallel.pipeline_parallel needs train.engine=megatron",
    ),
    (
        "megatron without layout-free checkpoints",
        ["train.engine=megatron", "train.checkpoints=true", "train.layout_free_checkpoints=false"],
        "train.layout_free_checkpoints=false keeps DeepSpeed's own optimizer state",
    ),
    (
        "overlapped gather without the distributed optimizer",
        [
            "train.engine=megatron",
            "parallel.distributed_optimizer=false",
            "parallel.overlap_param_gather=true",
        ],
        "parallel.overlap_param_gather=true needs parallel.distributed_optimizer",
    ),
    (
        "a world the layout does not divide",
        [*MEGATRON_PP2, "parallel.tensor_parallel=2"],
        "world size 2 is not a multiple of parallel.tensor_parallel x parallel.pipeline_parallel",
    ),
    (
        "a global batch the ranks do not divide",
        ["train.global_batch_size=3"],
        "train.global_batch_size=3 is not a multiple of train.micro_batch_size x data parallel",
    ),
    (
        "heads the tensor-parallel ranks do not divide",
        ["parallel.tensor_parallel=3"],
        "parallel.tensor_parallel=3 must divide model.num_attention_heads=4",
    ),
    ("sequence parallelism", ["parallel.sequence_parallel=true"], "parallel.sequence_parallel"),
    (
        "a window past the positions",
        ["train.seq_len=128"],
        "train.seq_len=128 exceeds model.max_position_embeddings=64",
    ),
    # the start-up checks: tokenizer, data, weights, output, credentials
    (
        "a vocabulary smaller than the tokenizer's",
        ["model.vocab_size=256"],
        "model.vocab_size=256 is smaller than the tokenizer's 800 tokens",
    ),
    ("no tokenizer file", ["data.tokenizer=/nonexistent/t.model"], "tokenizer not found"),
    ("no manifest", ["data.sources=[{manifest: /nonexistent/m.json}]"], "data.sources: "),
    ("no initial weights", ["init.megatron=/nonexistent/weights"], "init.megatron"),
    (
        "output_dir under a file",
        ["output_dir={tmp}/a-file/run"],
        "output_dir {tmp}/a-file/run: {tmp}/a-file is not a directory",
    ),
    (
        "output_dir where nothing can be made",
        ["output_dir=/proc/nonexistent/run"],
        "output_dir /proc/nonexistent/run: cannot write there",
    ),
    (
        "wandb online without a key",
        ["logging.wandb=online"],
        "logging.wandb=online needs WANDB_API_KEY",
    ),
]


def rank0_env() -> dict[str, str]:
    """The environment launch/torchrun.sh runs --check in: rank 0 of the launch's N."""
    env = launcher.torchrun_env()
    env.pop("WANDB_API_KEY", None)
    return {**env, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}


def said_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("del-train: error: ")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def run_inputs(synth_tokenizer, synth_shards, tmp_path_factory):
    """The config file of `base_tree` and a file for the output_dir case to sit under."""
    tmp = tmp_path_factory.mktemp("refusals")
    (tmp / "a-file").write_text("")
    config = tmp / "run.yaml"
    config.write_text(yaml.safe_dump(base_tree(tmp, synth_tokenizer, synth_shards)))
    return tmp, config


@pytest.mark.slow
@pytest.mark.parametrize(("case", "overrides", "said"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_check_says_the_line_the_launch_says(case, overrides, said, run_inputs):
    """`del-train --check` (as launch/torchrun.sh runs it: rank 0 of 2) and `--dry-run` exit 2
    with one line, and the launch's ranks (started as srun starts them, no check before)
    stop with the same line, exit 2, no traceback. Before: the pipeline splits and the
    uncreatable output_dir passed --check, and the launch failed with a traceback."""
    tmp, config = run_inputs
    overrides = [o.replace("{tmp}", str(tmp)) for o in overrides]
    said = said.replace("{tmp}", str(tmp))
    args = ["--config", str(config), *overrides]
    lines = []
    for mode in ("--check", "--dry-run"):
        checked = launcher.run_python(TRAIN, mode, *args, env=rank0_env(), timeout=300)
        assert checked.returncode == 2, (mode, checked.stdout[-2000:], checked.stderr[-3000:])
        assert "Traceback" not in checked.stderr, checked.stderr[-3000:]
        lines.append(said_line(checked.stderr))
    assert lines[0] == lines[1] and said in lines[0], lines
    env = launcher.torchrun_env()
    env.pop("WANDB_API_KEY", None)
    ranks = launcher.start_ranks(TRAIN, args, 2, env)  # as srun starts them: each on its own
    try:
        outputs = [rank.communicate(timeout=300)[0] for rank in ranks]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
    for rank, output in zip(ranks, outputs, strict=True):
        assert rank.returncode == 2 and "Traceback" not in output, output[-3000:]
        assert lines[0] in output.splitlines(), (lines[0], output[-3000:])
    assert not (tmp / "run" / "metrics.jsonl").exists()


# ---- held-out evaluation at virtual PP -------------------------------------------------------


@pytest.mark.slow
def test_virtual_pipeline_with_held_out_evaluation_checks_and_runs(
    tmp_path, synth_tokenizer, synth_shards
):
    """PP 2 x VP 2 with eval.sources: --check passes and the run evaluates before and after
    its steps. 3 held-out batches at 2 micro-batches a step: the last schedule call has 1,
    filled to the pipeline's 2 (megatron refuses fewer: "should range in [PP=2 , M=1]").
    Before (commit 6edbb22): --check passed, then every rank stopped in that ValueError."""
    tree = base_tree(tmp_path, synth_tokenizer, synth_shards)
    tree["train"] |= {"engine": "megatron", "steps": 2, "global_batch_size": 2, "log_interval": 1}
    tree["parallel"] |= {"pipeline_parallel": 2, "virtual_pipeline_parallel": 2}
    tree["eval"] = {"sources": [{"manifest": str(synth_shards)}], "max_batches": 3}
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(tree))
    checked = launcher.run_python(TRAIN, "--check", "--config", str(config), env=rank0_env())
    assert checked.returncode == 0, checked.stderr[-3000:]
    assert "pipeline parallel 2 (2 virtual)" in checked.stdout, checked.stdout
    output = launcher.run_torchrun(TRAIN, 2, "--config", str(config))
    assert "held-out evaluation before training (3 batches at most)" in output, output[-3000:]
    assert "held-out CE" in output and "step 2/2" in output, output[-3000:]


# ---- writability: tried, not predicted -----------------------------------------------------


@pytest.mark.skipif(os.getuid() != 0, reason="root passes access() where nothing can be made")
def test_a_home_where_nothing_can_be_made_moves_the_caches(tmp_path, capsys, monkeypatch):
    """HOME=/proc/nonexistent as root: access() says /proc is writable, mkdir says no. The
    caches move under the temporary directory, said once; before, none moved and DeepSpeed's
    extension build died in makedirs with a traceback."""
    assert not caches.writable(Path("/proc/nonexistent/.cache/torch_extensions"))
    monkeypatch.setattr(caches.tempfile, "gettempdir", lambda: str(tmp_path))
    env = {"HOME": "/proc/nonexistent", "LOCAL_RANK": "0"}
    base = caches.use_writable_caches("del-train", env)
    assert base is not None and env["TORCH_EXTENSIONS_DIR"].startswith(str(base)), env
    assert capsys.readouterr().err.startswith("del-train: HOME=/proc/nonexistent is not writable")
    assert caches.writable(tmp_path / "x" / "y")
    assert not list(tmp_path.glob(".del-megatron-probe-*"))  # the probe leaves nothing


PROBE_FULL_HOME = """
import sys
from pathlib import Path
from del_megatron import caches
home = Path(sys.argv[1])
env = {"HOME": str(home), "LOCAL_RANK": "0"}
print(caches.writable(home / ".cache" / "torch_extensions"), caches.use_writable_caches("t", env))
"""


@pytest.mark.skipif(
    os.getuid() != 0 or shutil.which("unshare") is None, reason="mounts a filesystem of its own"
)
def test_a_full_home_moves_the_caches(tmp_path):
    """A home on a full filesystem (a tmpfs with no inode left, mounted in a mount namespace
    of the test's own): access() says yes to anyone with the mode bits, mkdir says ENOSPC.
    The caches move, as for any home that cannot hold them."""
    mount = tmp_path / "fs"
    mount.mkdir()
    script = (
        f"mount -t tmpfs -o size=1m,nr_inodes=2 tmpfs {mount} && mkdir {mount}/home && "
        f'exec "{sys.executable}" -c "$PROBE" {mount}/home'
    )
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        env={**os.environ, "PROBE": PROBE_FULL_HOME, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    if "mount:" in done.stderr or "unshare:" in done.stderr:
        pytest.skip(f"no mount here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr[-3000:]
    first = done.stdout.splitlines()[0]
    assert first.startswith("False ") and "del-megatron-cache" in first, done.stdout
    assert f"HOME={mount}/home is not writable: caches (" in done.stderr, done.stderr
