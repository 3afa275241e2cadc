"""GPU acceptance: the user's own commands on this machine's GPUs, every figure bounded.

    bash bench/gpu_acceptance.sh [--cpu-smoke] [--plan]

The checks run in the order of PLAN, each under its time limit; every figure a check reads
has its bound beside it, so every row can fail. One GPU: TP 1; two or more: the TP 2 runs too.
They run launch/torchrun.sh (del-train), del-train --deepspeed-json, del-convert, del-eval
and bench/*.py; this file only probes the environment, builds a tiny random Qwen-2 and
judges what the commands wrote. Out: one table, and $OUT/gpu_acceptance.json with the logs
in $OUT/logs (OUT defaults to the work directory). Exit 1 when a check failed, when
nvidia-smi lists GPUs this interpreter's torch cannot use (a CPU wheel, a driver mismatch),
or when there is no GPU at all (nothing was accepted). --cpu-smoke runs the one-GPU plan on
the CPU at tiny sizes in float32 (the wiring, not figures); --plan prints the checks with
their estimates on one H200 (8 minutes in all, the first step's compile included).

Packages: a wheel of .whl/ (bench/fetch_gpu_wheels.sh, wheels for Python 3.11-3.13) goes
into $DEL_SITE (default /tmp/del-site-pyX.Y) where this interpreter lacks its distribution
or has an older one; then every requirement of the carried distributions, and
pyproject.toml's of megatron-core, DeepSpeed, pydantic and webdataset, must be met, or the
install row fails naming them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

try:  # pip's own copy where the image lacks packaging (pip installs the wheels)
    from packaging.requirements import Requirement
    from packaging.version import Version
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
THIS = str(Path(__file__).resolve())
ONE_RANK_SWITCH = "DEL_COLLECTIVES_ON_ONE_RANK"  # issue 25 item 13: our collectives on 1 rank
BUDGET_S = 8 * 60  # the one-GPU plan on one H200
WHEELS = ROOT / ".whl"  # bench/fetch_gpu_wheels.sh
CARRIED = ("megatron-core", "deepspeed", "pydantic", "webdataset")  # what .whl/ brings
NUMBER = r"([-+0-9.eE]+|nan|inf)"


@dataclass(frozen=True)
class Mode:
    """Sizes and bounds. Relative differences are |a - b| / max(1, |b|)."""

    device: str
    steps: int  # the tiny runs' length
    stop_at: int  # SIGUSR1 once metrics.jsonl reaches this step; also the log interval
    step1: float  # fused vs unfused run, step 1 (same weights, same batch): loss, grad norm
    later: float  # fused vs unfused run: every step's loss
    resumed: float  # stopped+resumed (or one-rank collectives) vs straight: losses, weights
    logits: float  # del-convert export (transformers) vs checkpoint: x max(1, max |logit|)
    eval: float  # del-eval of a checkpoint and of its export: loss, digit entropy
    bounds: dict  # the benchmarks' bounds
    benches: dict  # the benchmarks' command lines (after the interpreter)
    slowdown: int  # time limits x this


# bf16 on the GPU: products summed in another order (fused vs unfused) differ by rounding,
# and these differences grow over the steps; a GPU run is not bit-reproducible (atomic adds
# in backward), so a resumed run drifts by a few bf16 ulps a step (0.02 in a weight is about
# 7 Adam steps at lr 3e-3). Benchmark bounds are the goals of docs/benchmarks.md.
GPU = Mode("cuda", 20, 8, step1=1e-2, later=2e-2, resumed=2e-2, logits=5e-2, eval=2e-2,
           bounds={"hook_time": 1.05,  # hook / megatron's fused CE: time, goal
                   "hook_peak": 1.02,  # ... peak memory, logits handed over: goal +2%
                   "fused_time": 1.00,  # fused output layer + loss / megatron's: goal
                   "fused_peak": 0.10,  # ... peak memory, .grad fresh (ZeRO 2/3): goal
                   "chunk_time": 1.00,  # ... at a 4096-token chunk: the same time goal
                   "chunk_peak": 0.50,  # ... a quarter of the tokens' logits, twice over
                   "del_over_mle": 1.03,  # training step, DEL over MLE: goal
                   "mfu": 0.20},  # 4-layer 7B-width step: a floor (host syncs, fp32 math)
           benches={"hook": "bench/loss_tp.py --device cuda --dtype bf16 --vocab 152064 "
                            "--tokens 16384 --repeats 10",
                    "fused": "bench/loss_fused.py --device cuda --dtype bf16 --tp 1 --tokens "
                             "16384 --chunk 1024 --chunks 4096 --paths megatron,fused "
                             "--memory fresh --repeats 3",
                    "step": "bench/train_step.py --gpu-7b --steps 6"},
           slowdown=1)
# float32 on two shared CPU cores: resume and one-rank collectives are bit-exact
# (tests/training), the two model implementations agree to float32 rounding (.ci/run);
# timings at toy sizes are noise (3x), the peak-RSS meter sees tens of MiB at best (<= 1x).
CPU = Mode("cpu", 8, 3, step1=1e-5, later=1e-4, resumed=0.0, logits=1e-4, eval=1e-4,
           bounds={"hook_time": 3, "hook_peak": 3, "fused_time": 3, "fused_peak": 1,
                   "chunk_time": 3, "chunk_peak": 1, "del_over_mle": 3, "mfu": None},
           benches={"hook": "bench/loss_tp.py --device cpu --dtype bf16 --vocab 8192 "
                            "--tokens 2048 --repeats 1",
                    "fused": "bench/loss_fused.py --device cpu --dtype fp32 --tp 1 --vocab 16384 "
                             "--hidden 256 --tokens 1024 --chunk 256 --chunks 512 --paths "
                             "megatron,fused --memory fresh --repeats 1",
                    "step": "-m torch.distributed.run --standalone --nproc-per-node=2 "
                            "bench/train_step.py --steps 1"},
           slowdown=4)


class Failed(Exception):
    """A command that failed or a figure out of its bound: the row's note."""


class Skipped(Exception):
    """What this machine or branch lacks: a skipped row, never a pass."""


@dataclass
class Check:
    """One check's run: its deadline and log; the figures it read."""

    name: str
    mode: Mode
    work: Path
    env: dict
    deadline: float
    figures: dict = field(default_factory=dict)

    def within(self, name: str, value: float, lo: float = -math.inf, hi: float = math.inf):
        """Record a figure; out of [lo, hi] (NaN too) fails the check."""
        self.figures[name] = value
        if not lo <= value <= hi:
            raise Failed(f"{name} = {value:.6g}, outside its bound [{lo:g}, {hi:g}]")
        return value

    def run(self, *cmd: str, ok=(0,), env=None, stop_when=None) -> str:
        """Run a command in the repository root under the check's deadline (then SIGTERM to
        its process group, SIGKILL 30 s later); its output goes to the log and is returned.
        stop_when: SIGUSR1 to it once this returns true (polled)."""
        log = self.work / "logs" / f"{self.name}.log"
        with log.open("ab") as f:
            f.write(f"$ {shlex.join(cmd)}\n".encode())
            start = f.tell()
            f.flush()
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env or self.env, stdout=f,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            signalled = False
            try:
                while proc.poll() is None:
                    if time.monotonic() > self.deadline:
                        raise Failed(f"ran past its time limit in: {shlex.join(cmd)[:200]}")
                    if stop_when is not None and not signalled and stop_when():
                        proc.send_signal(signal.SIGUSR1)
                        signalled = True
                    time.sleep(0.1)
            finally:  # past the deadline, or this script interrupted: stop what it started
                if proc.poll() is None:
                    stop(proc)
        text = log.read_bytes()[start:].decode(errors="replace")
        if proc.returncode not in ok:
            raise Failed(f"exit {proc.returncode} (expected {ok[0]}): {failure_line(text)}")
        return text


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the command's process group (launch/torchrun.sh then has every rank save and
    exit), then SIGKILL 30 s later to it and to what it started that still runs (torchrun's
    ranks have process groups of their own; psutil refuses a pid that was reused)."""
    import psutil  # DeepSpeed's requirement: in the image

    started = psutil.Process(proc.pid).children(recursive=True)
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
    for child in started:
        try:
            child.kill()
        except psutil.NoSuchProcess:  # ended, or its pid is another process's now
            pass
    proc.wait()


def failure_line(text: str) -> str:
    """The line that says why a command failed: the last naming an error, else the last."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    named = [line for line in lines if re.search(r"error|exception", line, re.I)]
    return (named or lines or ["no output"])[-1][:300]


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(1.0, abs(b))


# ---- the checks, in order ----------------------------------------------------------------


def check_install(c: Check) -> str:
    """A wheel of .whl/ goes into DEL_SITE where the interpreter lacks its distribution or has
    an older one (pip picks the file for this Python); then the carried distributions'
    requirements and pyproject.toml's must all be met by what the commands will import."""
    site = c.env["DEL_SITE"]
    carried = {canonical(f.name.split("-")[0]): f.name.split("-")[1] for f in WHEELS.glob("*.whl")}
    have = visible([site, *sys.path])
    todo = [f"{name}=={version}" for name, version in sorted(carried.items())
            if name not in have or Version(have[name].version) < Version(version)]
    if todo:
        c.run(sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
              "--no-compile", "--upgrade", "--find-links", str(WHEELS), "--target", site, *todo)
    have = visible([site, *sys.path])
    wanted = [("pyproject.toml", r) for r in carried_requirements(ROOT / "pyproject.toml")]
    wanted += [(n, r) for n in sorted(carried.keys() & have.keys()) for r in have[n].requires or []]
    unmet = []
    for who, text in wanted:
        requirement = Requirement(text)
        if requirement.marker and not requirement.marker.evaluate({"extra": ""}):
            continue  # another platform's, or an extra's
        dist = have.get(canonical(requirement.name))
        if not met(requirement, dist):
            unmet.append(f"{who} needs {requirement}" + (f", has {dist.version}" if dist else ""))
    c.figures["installed"] = todo
    if unmet:
        raise Failed(f"Python {sys.version.split()[0]}: {'; '.join(unmet)[:300]} (wheels: "
                     f"{WHEELS}, bash bench/fetch_gpu_wheels.sh)")
    return f"Python {sys.version.split()[0]}: " + (", ".join(todo) or "nothing missing")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def visible(path: list[str]) -> dict:
    """The distributions a process with this sys.path imports, by canonical name."""
    found = {}
    for dist in metadata.distributions(path=path):
        found.setdefault(canonical(dist.metadata["Name"]), dist)
    return found


def met(requirement: Requirement, dist) -> bool:
    """Installed at a version the specifier allows; a pre-release or local build of an allowed
    release counts (NGC's torch 2.6.0a0+nv for >=2.6)."""
    if dist is None:
        return False
    version = Version(dist.version)
    return requirement.specifier.contains(version, prereleases=True) or \
        requirement.specifier.contains(Version(version.base_version))


def carried_requirements(pyproject: Path) -> list[str]:
    """pyproject.toml's requirements of the carried packages (one source of the versions)."""
    import tomllib

    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return [d for d in deps if re.split(r"[<>=!~ \[;]", d, maxsplit=1)[0] in CARRIED]


def check_env(c: Check) -> str:
    facts = json.loads(c.run(sys.executable, THIS, "--probe-env", c.mode.device).splitlines()[-1])
    c.figures.update(facts)
    if c.mode.device == "cuda":
        c.within("gpus", facts["gpus"], lo=1)
        if facts["deepspeed_accelerator"] != "cuda":
            raise Failed(f"DeepSpeed picked accelerator {facts['deepspeed_accelerator']}")
    return f"fused weight gradient: {facts['fused_weight_grad']}"


def check_deepspeed_config(c: Check) -> str:
    """The bf16 config's gradients accumulate in fp32 (issue 25 item 4), not DeepSpeed's bf16."""
    out = c.run(sys.executable, "-m", "del_megatron.cli.train", "--config",
                "configs/qwen2.5_7b.yaml", "--deepspeed-json", "8")
    config = json.loads(out[out.index("{"):])
    accumulate = config.get("data_types", {}).get("grad_accum_dtype")
    c.figures.update(bf16=config.get("bf16", {}).get("enabled"), grad_accum_dtype=accumulate)
    if not c.figures["bf16"] or accumulate != "fp32":
        raise Failed(f"bf16 {c.figures['bf16']}, data_types.grad_accum_dtype {accumulate!r}, "
                     "expected 'fp32'")
    return "bf16, gradients accumulated in fp32"


def check_data(c: Check) -> str:
    c.run("bash", "launch/tiny_data.sh", str(c.work / "data"), "1500")
    for part in ("tokenizer.model", "shards/train/manifest.json", "shards/heldout/manifest.json"):
        if not (c.work / "data" / part).is_file():
            raise Failed(f"launch/tiny_data.sh wrote no {part}")
    return "launch/tiny_data.sh: corpus, tokenizer, shards"


def tiny(c: Check, run: str, tp: int, *overrides: str, data: bool = True) -> list[str]:
    """launch/torchrun.sh of configs/tiny_cpu.yaml on this mode's device, output in work/run."""
    d = c.work / "data"
    own = [f"data.tokenizer={d}/tokenizer.model",
           f"eval.sources=[{{manifest: {d}/shards/heldout/manifest.json}}]"] if data else []
    return ["bash", "launch/torchrun.sh", "--nproc-per-node", str(tp), "configs/tiny_cpu.yaml",
            f"train.device={c.mode.device}", f"train.steps={c.mode.steps}",
            f"train.log_interval={c.mode.stop_at}", "eval.max_batches=2",
            "logging.wandb=disabled", "logging.progress_bar=false",
            f"data.sources=[{{manifest: {d}/shards/train/manifest.json}}]",
            f"output_dir={c.work / run}", f"parallel.tensor_parallel={tp}", *own, *overrides]


def metrics(run: Path) -> dict[int, dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, filter(None, lines))}


def judge_run(c: Check, records: dict[int, dict], steps: int) -> None:
    """Every step logged with a finite loss and gradient norm, and the loss fell."""
    if sorted(records) != list(range(1, steps + 1)):
        raise Failed(f"metrics.jsonl has steps {sorted(records)[:4]}..., expected 1..{steps}")
    for r in records.values():  # finite and sane: loss in (0, 100), gradient norm < 1e4
        if not (0 < r["loss"] < 100 and 0 <= r["grad_norm"] < 1e4):
            raise Failed(f"step {r['step']}: loss {r['loss']}, grad norm {r['grad_norm']}")
    c.within("loss_step1", records[1]["loss"], 0, 100)
    c.within("loss_fall", records[1]["loss"] - records[steps]["loss"], lo=1e-3)
    c.within("tokens_per_s", statistics.median(r["tokens_per_s"] for r in records.values()),
             lo=1)


def check_train(c: Check, tp: int, fused: bool) -> str:
    run = f"train-{'fused-' if fused else ''}tp{tp}"
    c.run(*tiny(c, run, tp, f"loss.fused_output={str(fused).lower()}"))
    ours = metrics(c.work / run)
    judge_run(c, ours, c.mode.steps)
    if not (c.work / run / "checkpoints" / f"step-{c.mode.steps:07d}").is_dir():
        raise Failed(f"no checkpoint of step {c.mode.steps}")
    if fused:
        judge_fused(c, ours, metrics(c.work / f"train-tp{tp}"))
    return f"{c.mode.steps} steps at TP {tp}" + (", as the unfused run" if fused else "")


def judge_fused(c: Check, fused: dict[int, dict], unfused: dict[int, dict]) -> None:
    """Fused against unfused (issue 25 item 7): step 1 is the same weights and batch, so its
    loss (forward) and gradient norm (backward) agree to rounding; every later loss after
    updates made from the fused op's gradients."""
    for key in ("loss", "grad_norm"):
        c.within(f"step1_{key}_rel_diff", relative(fused[1][key], unfused[1][key]),
                 hi=c.mode.step1)
    later = max(relative(fused[s]["loss"], unfused[s]["loss"]) for s in unfused)
    c.within("loss_max_rel_diff", later, hi=c.mode.later)


def check_one_rank_collectives(c: Check) -> str:
    if not any(ONE_RANK_SWITCH in p.read_text() for p in (ROOT / "del_megatron").rglob("*.py")):
        raise Skipped(f"del_megatron/ does not read {ONE_RANK_SWITCH} (issue 25 item 13)")
    c.run(*tiny(c, "one-rank", 1, f"train.steps={c.mode.stop_at}"),
          env={**c.env, ONE_RANK_SWITCH: "1"})
    ours, straight = metrics(c.work / "one-rank"), metrics(c.work / "train-tp1")
    worst = max(relative(ours[s]["loss"], straight[s]["loss"]) for s in ours)
    c.within("loss_max_rel_diff", worst, hi=c.mode.resumed)
    return f"{ONE_RANK_SWITCH}=1: {len(ours)} steps as the run without it"


def check_stop_resume(c: Check, tp: int) -> str:
    run, straight = c.work / f"stop-resume-tp{tp}", c.work / f"train-tp{tp}"
    command = tiny(c, run.name, tp)

    def reached() -> bool:
        try:
            return max(metrics(run), default=0) >= c.mode.stop_at
        except (OSError, ValueError):  # not written yet, or a line half written
            return False

    c.run(*command, ok=(75,), stop_when=reached)  # launch/torchrun.sh: 75, stopped
    stopped_at = max(int(p.name[5:]) for p in (run / "checkpoints").glob("step-*"))
    c.within("stopped_at", stopped_at, c.mode.stop_at, c.mode.steps - 1)
    c.run(*command)  # the same command resumes (torchrun.sh: --resume same)
    judge_run(c, metrics(run), c.mode.steps)
    worst = max(relative(metrics(run)[s]["loss"], r["loss"]) for s, r in metrics(straight).items())
    c.within("loss_max_rel_diff", worst, hi=c.mode.resumed)
    final = f"checkpoints/step-{c.mode.steps:07d}/model"
    c.within("weights_max_abs_diff", weights_difference(run / final, straight / final),
             hi=c.mode.resumed)
    return f"SIGUSR1, exit 75 at step {stopped_at}, resumed to {c.mode.steps}"


def weights_difference(a: Path, b: Path) -> float:
    """Largest |a - b| over every tensor of two directories of tp*.safetensors (0: equal)."""
    from safetensors.torch import load_file

    files = sorted(p.name for p in a.glob("tp*.safetensors"))
    if not files or files != sorted(p.name for p in b.glob("tp*.safetensors")):
        raise Failed(f"weight files differ: {a} {files} vs {b}")
    worst = 0.0
    for name in files:
        x, y = load_file(a / name), load_file(b / name)
        if x.keys() != y.keys() or any(x[k].shape != y[k].shape for k in x):
            raise Failed(f"{name}: tensor names or shapes differ")
        worst = max([worst, *((x[k].double() - y[k].double()).abs().max().item() for k in x)])
    return worst


def check_init_hf(c: Check) -> str:
    """A tied Qwen-2 -> init.hf -> 2 steps -> del-convert: a tied export, evaluated as ours."""
    hf, run = c.work / "qwen2", c.work / "init-hf"
    c.run(sys.executable, THIS, "--tiny-qwen2", str(hf), str(c.work / "data/tokenizer.model"))
    c.run(*tiny(c, run.name, 1, "train.steps=2", "data.tokenizer=null", f"init.hf={hf}",
                "model.family=qwen2", "model.qkv_bias=true", "model.tie_word_embeddings=true",
                "eval.sources=[]", data=False))
    export = evaluate_with_export(c, run / "checkpoints/step-0000002", "init-hf")
    stored = [name for file in export.glob("*.safetensors") for name in tensor_names(file)]
    tied = json.loads((export / "config.json").read_text()).get("tie_word_embeddings")
    if not tied or "lm_head.weight" in stored:
        raise Failed(f"export: tie_word_embeddings {tied}, lm_head.weight stored")
    return "tied export; its del-eval metrics equal the checkpoint's"


def tensor_names(file: Path) -> list[str]:
    """The tensors a safetensors file holds: its header, 8 bytes of length then JSON."""
    with file.open("rb") as f:
        return list(json.loads(f.read(int.from_bytes(f.read(8), "little"))))


def check_del_eval(c: Check) -> str:
    evaluate_with_export(c, c.work / f"train-tp1/checkpoints/step-{c.mode.steps:07d}", "eval")
    return "a checkpoint and its export: the same loss and digit entropy"


def evaluate_with_export(c: Check, checkpoint: Path, name: str) -> Path:
    """del-convert, del-eval of both, del-eval compare. Mean loss and digit entropy are
    smooth: judged; digit accuracy and number errors hang on argmax near-ties that bf16 flips
    between two implementations: recorded."""
    export = c.work / f"{name}-export"
    c.run(sys.executable, "-m", "del_megatron.cli.convert", "megatron-to-hf", "--checkpoint",
          str(checkpoint), "--out", str(export))
    results = [c.work / f"{name}-checkpoint", c.work / f"{name}-hf"]
    for model, out in zip((checkpoint, export), results, strict=True):
        c.run(sys.executable, "-m", "del_megatron.cli.eval", str(model), "--heldout",
              str(c.work / "data/shards/heldout/manifest.json"), "--seq-len", "128",
              "--max-batches", "10", "--device", c.mode.device, "--quiet", "--out", str(out))
    c.run(sys.executable, "-m", "del_megatron.cli.eval", "compare", *map(str, results), "--out",
          str(c.work / f"{name}-compare"))
    ours, theirs = (json.loads((d / "results.json").read_text())["numeric"] for d in results)
    judge_eval(c, ours, theirs)
    return export


def judge_eval(c: Check, ours: dict, theirs: dict) -> None:
    for key in ("loss", "digit_entropy"):
        c.within(f"{key}_rel_diff", relative(ours[key], theirs[key]), hi=c.mode.eval)
    c.figures.update({k: ours.get(k) for k in ("loss", "digit_acc", "number_abs_error")})


def bench(c: Check, kind: str, pattern: str) -> list[tuple]:
    """The figures a bench/*.py prints (pattern: a line of them); none found fails."""
    command = shlex.split(c.mode.benches[kind])
    found = re.findall(pattern, c.run(sys.executable, *command), re.M)
    if not found:
        script = next(word for word in command if word.endswith(".py"))
        raise Failed(f"{script} printed no line like {pattern!r}")
    return found


def check_bench_hook(c: Check) -> None:
    (time_ratio, peak), = bench(c, "hook", rf"^hook / .*?: time {NUMBER}x, peak {NUMBER}x")
    c.within("hook_over_megatron_time", float(time_ratio), 0, c.mode.bounds["hook_time"])
    c.within("hook_over_megatron_peak", float(peak), 0, c.mode.bounds["hook_peak"])


def check_bench_fused(c: Check) -> None:
    pattern = rf"^(fused / megatron|chunk +\d+): (?:fused )?time {NUMBER}x, peak.*?{NUMBER}x"
    # "fused / megatron: time Tx, peak memory Mx" and
    # "chunk   4096: fused time Tx, peak (fresh) N MiB (Mx)"
    rows = bench(c, "fused", pattern)
    for what, time_ratio, peak in rows:
        name = "fused_over_megatron" if what.startswith("fused") else what.replace(" ", "")
        kind = "fused" if what.startswith("fused") else "chunk"
        c.within(f"{name}_time", float(time_ratio), 0, c.mode.bounds[f"{kind}_time"])
        c.within(f"{name}_peak", float(peak), 0, c.mode.bounds[f"{kind}_peak"])
    if len(rows) < 2:
        raise Failed("bench/loss_fused.py printed no 'fused / megatron' and 'chunk' lines")


def check_bench_train_step(c: Check) -> None:
    pattern = rf"^(mle|del) +{NUMBER} +{NUMBER}x +{NUMBER} +{NUMBER} +{NUMBER} +{NUMBER}\s*$"
    rows = {kind: [float(v) for v in values] for kind, *values in bench(c, "step", pattern)}
    if set(rows) != {"mle", "del"}:  # each: step ms, ratio, tokens/s, TFLOP/s, MFU, numeric
        raise Failed("bench/train_step.py printed no 'mle' and 'del' rows")
    if not (math.isnan(rows["mle"][5]) and rows["del"][5] > 0):  # MLE has no numeric term
        raise Failed(f"bench/train_step.py: numeric term {rows['mle'][5]} (mle), "
                     f"{rows['del'][5]} (del): the two variants ran the same loss")
    c.within("del_over_mle", rows["del"][0] / rows["mle"][0], 0, c.mode.bounds["del_over_mle"])
    c.within("tokens_per_s_del", rows["del"][2], lo=1)
    if c.mode.bounds["mfu"] is not None:
        c.within("mfu_del", rows["del"][4], c.mode.bounds["mfu"], 1)


# name, function, estimate on one H200 (s), time limit (s); a TP 2 check needs 2 GPUs.
# The estimates are not measured yet (no GPU lent so far): about 15 s of start-up a process
# that imports megatron-core and DeepSpeed, plus the first step's Inductor compile (about a
# minute) in the first training run; the first GPU run's seconds column replaces them.
PLAN = [
    ("install", check_install, 10, 120),
    ("env", check_env, 15, 120),
    ("deepspeed-config", check_deepspeed_config, 5, 60),
    ("data", check_data, 15, 180),
    ("train-tp1", lambda c: check_train(c, 1, False), 90, 300),  # the first step compiles
    ("train-fused-tp1", lambda c: check_train(c, 1, True), 35, 180),
    ("one-rank-collectives", check_one_rank_collectives, 30, 180),
    ("stop-resume-tp1", lambda c: check_stop_resume(c, 1), 60, 300),
    ("train-tp2", lambda c: check_train(c, 2, False), 40, 240),
    ("train-fused-tp2", lambda c: check_train(c, 2, True), 40, 240),
    ("stop-resume-tp2", lambda c: check_stop_resume(c, 2), 70, 300),
    ("init-hf", check_init_hf, 50, 240),
    ("del-eval", check_del_eval, 40, 240),
    ("bench-hook-ce", check_bench_hook, 20, 120),
    ("bench-fused", check_bench_fused, 55, 240),  # five processes
    ("bench-train-step", check_bench_train_step, 50, 240),
]


def plan_for(gpus: int) -> list[tuple]:
    return [check for check in PLAN if gpus >= 2 or not check[0].endswith("-tp2")]


# ---- the inputs this file builds (run as subprocesses of the checks) ----------------------


def probe_env(device: str) -> dict:
    """Versions, and what decides the GPU paths (issue 25 item 10): which product forms the
    fused op's weight gradient, Transformer Engine, flash SDPA."""
    import importlib
    import platform

    import torch

    from del_megatron.losses.fused import addmm_out_dtype_supported
    from del_megatron.models.device import select_accelerator, transformer_engine_available

    dev = torch.device(device)
    select_accelerator(dev)  # before DeepSpeed is imported
    facts = {"python": platform.python_version(), "torch": torch.__version__,
             "cuda": torch.version.cuda,
             "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0}
    for module in ("megatron.core", "deepspeed", "transformers", "pydantic", "webdataset"):
        facts[module.split(".")[0]] = importlib.import_module(module).__version__
    te = transformer_engine_available()
    facts["transformer_engine"] = importlib.import_module("transformer_engine").__version__ \
        if te else None
    if dev.type == "cuda":
        from deepspeed.accelerator import get_accelerator
        from torch.nn.attention import SDPBackend, sdpa_kernel

        facts["gpu"] = torch.cuda.get_device_name(dev)
        nccl = torch.cuda.nccl.version()  # an int before torch 2.1, a tuple since
        facts["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        facts["deepspeed_accelerator"] = get_accelerator()._name
        q = torch.randn(1, 2, 64, 64, device=dev, dtype=torch.bfloat16)
        try:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
            facts["flash_sdpa"] = True
        except RuntimeError:
            facts["flash_sdpa"] = False
    addmm = addmm_out_dtype_supported(dev, torch.bfloat16)
    facts["addmm_out_dtype"] = addmm
    facts["fused_weight_grad"] = ("addmm(out_dtype=float32)" if addmm else
                                  "float32 product of upcast chunks (slower)") + " in bf16"
    return facts


def tiny_qwen2(out: Path, tokenizer: Path) -> None:
    """A random Qwen2ForCausalLM with tied embeddings in the tiny config's shape, saved by the
    installed transformers with the run's tokenizer beside it."""
    import shutil

    import torch
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=1024, hidden_size=128, intermediate_size=352, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).float().eval()
    with torch.no_grad():  # non-trivial norms and biases, so that a dropped one shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(out)
    shutil.copy(tokenizer, out / "tokenizer.model")


# ---- the run ------------------------------------------------------------------------------


def run_plan(plan: list[tuple], mode: Mode, work: Path, env: dict, record=print) -> list[dict]:
    """The checks in order; record(rows) after each (a run cut short keeps its rows)."""
    rows, blocked = [], None
    for i, (name, function, estimate, limit) in enumerate(plan, 1):
        print(f"[{i:2d}/{len(plan)}] {name:21s} ~{estimate:3d} s  ", end="", flush=True)
        c = Check(name, mode, work, env, time.monotonic() + limit * mode.slowdown)
        start = time.monotonic()
        try:
            if blocked:
                raise Skipped(f"the {blocked} check failed")
            status, note = "pass", function(c) or ""
        except Skipped as err:
            status, note = "skipped", str(err)
        except Failed as err:
            status, note = "fail", str(err)
        except Exception as err:  # our bug: the row names it, the log has the traceback
            with (work / "logs" / f"{name}.log").open("a") as f:
                f.write(traceback.format_exc())
            status, note = "fail", f"{type(err).__name__}: {err}"
        blocked = blocked or (name if status == "fail" and name in ("install", "env") else None)
        seconds = round(time.monotonic() - start, 1)
        print(f"{status} ({seconds} s)" + (f": {note}" if status != "pass" else ""))
        rows.append({"name": name, "status": status, "seconds": seconds,
                     "estimate_s": estimate, "note": note, "figures": c.figures})
        record(rows)
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'check':21s} {'status':7s} {'s':>6s} {'est':>4s}  note; figures"]
    for r in rows:
        figures = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                            for k, v in r["figures"].items())
        text = textwrap.wrap("; ".join(filter(None, [r["note"], figures])), 76) or [""]
        lines.append(f"{r['name']:21s} {r['status']:7s} {r['seconds']:6.1f} "
                     f"{r['estimate_s']:4d}  {text[0]}")
        lines += [" " * 43 + line for line in text[1:]]
    counts = {s: sum(r["status"] == s for r in rows) for s in ("pass", "fail", "skipped")}
    return "\n".join([*lines, f"{counts['pass']} passed, {counts['fail']} failed, "
                      f"{counts['skipped']} skipped"])


def listed_gpus() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU") for line in out.stdout.splitlines())


def usable_gpus() -> int:
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__, "
                            "torch.cuda.device_count() if torch.cuda.is_available() else 0)"],
                           capture_output=True, text=True, timeout=300, check=False)
    if probe.returncode:
        raise SystemExit(f"gpu_acceptance: {sys.executable} cannot import torch: "
                         f"{failure_line(probe.stderr)}")
    version, seen = probe.stdout.split()[-2:]
    return gpus_to_use(listed_gpus(), int(seen), version)


def gpus_to_use(listed: int, seen: int, torch_version: str) -> int:
    """The GPUs torch sees; one line and exit 1 when nvidia-smi lists GPUs that it cannot
    use, or when there is none (nothing would be accepted)."""
    if listed and not seen:
        raise SystemExit(f"gpu_acceptance: nvidia-smi lists {listed} GPU(s) but torch "
                         f"{torch_version} ({sys.executable}) sees none: a CPU build, or a "
                         "driver too old for its CUDA")
    if not seen:
        raise SystemExit("gpu_acceptance: no GPU, nothing checked (--cpu-smoke runs the wiring)")
    return seen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="the wiring, on the CPU")
    parser.add_argument("--plan", action="store_true", help="print the checks and estimates")
    parser.add_argument("--probe-env", metavar="DEVICE", help=argparse.SUPPRESS)
    parser.add_argument("--tiny-qwen2", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe_env:  # inputs for a check
        return print(json.dumps(probe_env(args.probe_env))) or 0
    if args.tiny_qwen2:
        return tiny_qwen2(*args.tiny_qwen2) or 0
    mode = CPU if args.cpu_smoke else GPU
    gpus = 1 if args.cpu_smoke or args.plan else usable_gpus()
    plan = plan_for(max(gpus, listed_gpus()) if args.plan else gpus)
    estimate = sum(check[2] for check in plan)
    print(f"gpu_acceptance: {'CPU smoke' if args.cpu_smoke else f'{gpus} GPU(s)'}, "
          f"{len(plan)} checks, estimate {estimate} s on H200s (budget {BUDGET_S} s on one)")
    if args.plan:
        print("\n".join(f"  {n:21s} ~{e:3d} s, limit {lim * mode.slowdown} s"
                        for n, _, e, lim in plan))
        return 0
    work = Path(tempfile.mkdtemp(prefix="gpu-acceptance."))
    (work / "logs").mkdir()
    out = Path(os.environ.get("OUT") or work)
    site = os.environ.get("DEL_SITE", "/tmp/del-site-py{}.{}".format(*sys.version_info[:2]))
    env = {**os.environ, "DEL_SITE": site, "DEL_PYTHON": sys.executable, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), site,
                                                        os.environ.get("PYTHONPATH")])),
           "PATH": f"{site}/bin{os.pathsep}{os.environ['PATH']}",
           "PYTHONWARNINGS": "ignore::UserWarning,ignore::FutureWarning,ignore::DeprecationWarning"}
    # SIGTERM (an outer timeout) as an exception: the running command is stopped with its ranks
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)

    def record(rows: list[dict]) -> None:  # the JSON and the logs so far, replaced atomically
        document = {"mode": "cpu-smoke" if args.cpu_smoke else "gpu", "gpus": gpus,
                    "wall_s": round(time.monotonic() - started), "estimate_s": estimate,
                    "failed": sum(r["status"] == "fail" for r in rows), "checks": rows}
        (out / "gpu_acceptance.json.tmp").write_text(json.dumps(document, indent=1) + "\n")
        os.replace(out / "gpu_acceptance.json.tmp", out / "gpu_acceptance.json")
        if out != work:
            subprocess.run(["cp", "-r", str(work / "logs"), str(out)], check=False)

    rows = run_plan(plan, mode, work, env, record)
    print(f"\n{table(rows)}\nwall {round(time.monotonic() - started)} s (estimate {estimate} "
          f"s); work directory {work}; results: {out / 'gpu_acceptance.json'}")
    return 1 if any(r["status"] == "fail" for r in rows) else 0

if __name__ == "__main__":
    sys.exit(main())
