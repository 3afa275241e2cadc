"""GPU acceptance: the user's own commands on this machine's GPUs, every figure bounded.

    bash bench/gpu_acceptance.sh [--cpu-smoke] [--plan]

PLAN's checks run in order under their time limits, judging what launch/torchrun.sh,
del-train, del-convert, del-eval and bench/*.py wrote against BOUNDS; two or more GPUs add
the TP 2 runs. Out: a table, and $OUT/gpu_acceptance.json with $OUT/logs/ (OUT: the work
directory unless set). Exit 1 when a check failed, when nvidia-smi lists GPUs this torch
cannot use, or with no GPU. --cpu-smoke: the one-GPU plan on the CPU, tiny, float32 (the
wiring, not the figures); --plan: the checks and their estimates on one H200. The wheels of
.whl/ (bench/fetch_gpu_wheels.sh) go into $DEL_SITE (default /tmp/del-site-pyX.Y).
"""

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import tomllib
import traceback
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

try:  # pip's copy where the image lacks packaging (pip installs the wheels)
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

# Every bound: (GPU, CPU smoke); relative differences are |a - b| / max(1, |b|). GPU, bf16:
# fused and unfused sum in other orders, and a run is not bit-reproducible (atomic adds in
# backward): a resumed run drifts by bf16 ulps a step (0.02 in a weight: 7 Adam steps at lr
# 3e-3); the benchmarks' bounds are docs/benchmarks.md's goals. CPU, float32 on two shared
# cores: resume and one-rank collectives are bit-exact (tests/training), the two model
# implementations agree to rounding (.ci/run); toy timings are noise, the RSS meter coarse.
BOUNDS = {
    "step1": (1e-2, 1e-5),  # fused vs unfused run, step 1 (same weights, batch): loss, grad norm
    "later": (2e-2, 1e-4),  # fused vs unfused run: every step's loss
    "resumed": (2e-2, 0.0),  # stopped+resumed, one-rank collectives vs straight: loss, weights
    "eval": (2e-2, 1e-4),  # del-eval of a checkpoint and of its export: loss, digit entropy
    "hook_time": (1.05, 3),  # hook / megatron's fused CE: time, goal
    "hook_peak": (1.02, 3),  # ... peak memory, logits handed over: goal +2%
    "fused_time": (1.00, 3),  # fused output layer + loss / megatron's: goal
    "fused_peak": (0.10, 1),  # ... peak memory, .grad fresh (ZeRO 2/3): goal
    "chunk_time": (1.00, 3),  # ... at a 4096-token chunk: the same time goal
    "chunk_peak": (0.50, 1),  # ... a quarter of the tokens' logits, twice over
    "del_over_mle": (1.03, 3),  # training step, DEL over MLE: goal
    "mfu": (0.20, None),  # 4-layer 7B-width step: a floor (host syncs, fp32 math); CPU: none
}


@dataclass(frozen=True)
class Mode:
    device: str
    steps: int  # the tiny runs' length
    stop_at: int  # SIGUSR1 once metrics.jsonl reaches this step; also the log interval
    slowdown: int  # time limits x this
    bounds: dict  # a column of BOUNDS
    benches: dict  # the benchmarks' command lines (after the interpreter)


GPU = Mode("cuda", 20, 8, 1, {k: v[0] for k, v in BOUNDS.items()}, {
    "hook": "bench/loss_tp.py --device cuda --dtype bf16 --vocab 152064 --tokens 16384 "
            "--repeats 10",
    "fused": "bench/loss_fused.py --device cuda --dtype bf16 --tp 1 --tokens 16384 --chunk 1024 "
             "--chunks 4096 --paths megatron,fused --memory fresh --repeats 3",
    "step": "bench/train_step.py --gpu-7b --steps 6"})
CPU = Mode("cpu", 8, 3, 4, {k: v[1] for k, v in BOUNDS.items()}, {
    "hook": "bench/loss_tp.py --device cpu --dtype bf16 --vocab 8192 --tokens 2048 --repeats 1",
    "fused": "bench/loss_fused.py --device cpu --dtype fp32 --tp 1 --vocab 16384 --hidden 256 "
             "--tokens 1024 --chunk 256 --chunks 512 --paths megatron,fused --memory fresh "
             "--repeats 1",
    "step": "-m torch.distributed.run --standalone --nproc-per-node=2 bench/train_step.py "
            "--steps 1"})


class Failed(Exception):
    """A command that failed or a figure out of its bound: the row's note."""


class Skipped(Exception):
    """What this machine or branch lacks: a skipped row, never a pass."""


@dataclass
class Check:
    name: str
    mode: Mode
    work: Path
    env: dict
    deadline: float
    figures: dict = field(default_factory=dict)

    def within(self, name: str, value: float, lo=-float("inf"), hi=float("inf")) -> None:
        """Record a figure; out of [lo, hi] (NaN too) fails the check."""
        self.figures[name] = value
        if not lo <= value <= hi:
            raise Failed(f"{name} = {value:.6g}, outside its bound [{lo:g}, {hi:g}]")

    def below(self, name: str, value: float, bound: str) -> None:
        self.within(name, value, 0, self.mode.bounds[bound])

    def run(self, *cmd: str, ok=(0,), env=None, stop_when=None) -> str:
        """The command's output (logged too); stop_when: SIGUSR1 to it once this is true."""
        with (self.work / "logs" / f"{self.name}.log").open("ab+") as log:
            log.write(f"$ {shlex.join(cmd)}\n".encode())
            start = log.tell()
            log.flush()
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env or self.env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                while proc.poll() is None:
                    if time.monotonic() > self.deadline:
                        raise Failed(f"ran past its time limit in: {shlex.join(cmd)[:200]}")
                    if stop_when is not None and stop_when():
                        proc.send_signal(signal.SIGUSR1)
                        stop_when = None
                    time.sleep(0.1)
            finally:  # past the deadline, or this script interrupted: stop what it started
                if proc.poll() is None:
                    stop(proc)
            log.seek(start)
            text = log.read().decode(errors="replace")
        if proc.returncode not in ok:
            raise Failed(f"exit {proc.returncode} (expected {ok[0]}): {failure_line(text)}")
        return text


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to its process group (launch/torchrun.sh: every rank saves), SIGKILL 30 s later
    to all it started (torchrun's ranks have groups of their own; psutil refuses reused pids)."""
    import psutil

    started = psutil.Process(proc.pid).children(recursive=True)
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
    for child in started:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()


def failure_line(text: str) -> str:
    """The line that says why a command failed: the last naming an error, else the last."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    named = [line for line in lines if re.search(r"error|exception", line, re.I)]
    return (named or lines or ["no output"])[-1][:300]


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(1.0, abs(b))


# ---- the checks, in PLAN's order ----------------------------------------------------------


def check_install(c: Check) -> str:
    """.whl/'s wheels where the interpreter lacks the distribution or has an older one (pip
    picks the file for this Python); then what they and pyproject.toml require must be met."""
    site, python = c.env["DEL_SITE"], f"Python {sys.version.split()[0]}"
    carried = {canonical(f.name.split("-")[0]): f.name.split("-")[1] for f in WHEELS.glob("*.whl")}
    have = visible([site, *sys.path])
    todo = [f"{name}=={version}" for name, version in sorted(carried.items())
            if name not in have or Version(have[name].version) < Version(version)]
    if todo:
        c.run(sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
              "--no-compile", "--upgrade", "--find-links", str(WHEELS), "--target", site, *todo)
        have = visible([site, *sys.path])
    c.figures["installed"] = todo
    wanted = [("pyproject.toml", r) for r in carried_requirements(ROOT / "pyproject.toml")]
    wanted += [(n, r) for n in sorted(carried.keys() & have.keys()) for r in have[n].requires or []]
    unmet = []
    for who, text in wanted:
        requirement = Requirement(text)
        if requirement.marker and not requirement.marker.evaluate({"extra": ""}):
            continue  # another platform's, or an extra's
        dist = have.get(canonical(requirement.name))
        if dist is None or not any(requirement.specifier.contains(v, prereleases=True) for v in
                                   (dist.version, Version(dist.version).base_version)):
            # (the base release counts: NGC's torch 2.6.0a0+nv meets >=2.6)
            unmet.append(f"{who} needs {requirement}" + (f", has {dist.version}" if dist else ""))
    if unmet:
        raise Failed(f"{python}: {'; '.join(unmet)[:300]} (wheels: {WHEELS}, "
                     "bash bench/fetch_gpu_wheels.sh)")
    return f"{python}: " + (", ".join(todo) or "nothing missing")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def visible(path: list[str]) -> dict:
    """The distributions a process with this sys.path imports (the first of each name)."""
    return {canonical(d.metadata["Name"]): d for d in [*metadata.distributions(path=path)][::-1]}


def carried_requirements(pyproject: Path) -> list[str]:
    """pyproject.toml's requirements of the carried packages (one source of the versions)."""
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return [d for d in deps if canonical(Requirement(d).name) in CARRIED]


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
    bf16, accumulate = (config.get(a, {}).get(b) for a, b in
                        (("bf16", "enabled"), ("data_types", "grad_accum_dtype")))
    c.figures.update(bf16=bf16, grad_accum_dtype=accumulate)
    if not bf16 or accumulate != "fp32":
        raise Failed(f"bf16 {bf16}, data_types.grad_accum_dtype {accumulate!r}, expected 'fp32'")
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


def loss_diff(ours: dict[int, dict], reference: dict[int, dict]) -> float:
    return max(relative(ours[s]["loss"], reference[s]["loss"]) for s in ours)


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
    if fused:  # issue 25 item 7: step 1 (same weights and batch) forward and backward, then
        unfused = metrics(c.work / f"train-tp{tp}")  # the losses after the fused op's updates
        for key in ("loss", "grad_norm"):
            c.below(f"step1_{key}_rel_diff", relative(ours[1][key], unfused[1][key]), "step1")
        c.below("loss_max_rel_diff", loss_diff(ours, unfused), "later")
    return f"{c.mode.steps} steps at TP {tp}" + (", as the unfused run" if fused else "")


def check_one_rank_collectives(c: Check) -> str:
    if not any(ONE_RANK_SWITCH in p.read_text() for p in (ROOT / "del_megatron").rglob("*.py")):
        raise Skipped(f"del_megatron/ does not read {ONE_RANK_SWITCH} (issue 25 item 13)")
    c.run(*tiny(c, "one-rank", 1, f"train.steps={c.mode.stop_at}"),
          env={**c.env, ONE_RANK_SWITCH: "1"})
    ours = metrics(c.work / "one-rank")
    c.below("loss_max_rel_diff", loss_diff(ours, metrics(c.work / "train-tp1")), "resumed")
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
    c.below("loss_max_rel_diff", loss_diff(metrics(run), metrics(straight)), "resumed")
    final = f"checkpoints/step-{c.mode.steps:07d}/model"
    c.below("weights_max_abs_diff", weights_difference(run / final, straight / final), "resumed")
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
    stored = []
    for file in export.glob("*.safetensors"):  # the header: 8 bytes of length, then JSON
        with file.open("rb") as f:
            stored += json.loads(f.read(int.from_bytes(f.read(8), "little")))
    tied = json.loads((export / "config.json").read_text()).get("tie_word_embeddings")
    if not tied or "lm_head.weight" in stored:
        raise Failed(f"export: tie_word_embeddings {tied}, lm_head.weight stored")
    return "tied export; its del-eval metrics equal the checkpoint's"


def check_del_eval(c: Check) -> str:
    evaluate_with_export(c, c.work / f"train-tp1/checkpoints/step-{c.mode.steps:07d}", "eval")
    return "a checkpoint and its export: the same loss and digit entropy"


def evaluate_with_export(c: Check, checkpoint: Path, name: str) -> Path:
    """del-convert, del-eval of both, del-eval compare. Loss and digit entropy are judged;
    digit accuracy and number errors (argmax near-ties that bf16 flips) only recorded."""
    export = c.work / f"{name}-export"
    results = [c.work / f"{name}-checkpoint", c.work / f"{name}-hf"]
    c.run(sys.executable, "-m", "del_megatron.cli.convert", "megatron-to-hf", "--checkpoint",
          str(checkpoint), "--out", str(export))
    for model, out in zip((checkpoint, export), results, strict=True):
        c.run(sys.executable, "-m", "del_megatron.cli.eval", str(model), "--heldout",
              str(c.work / "data/shards/heldout/manifest.json"), "--seq-len", "128",
              "--max-batches", "10", "--device", c.mode.device, "--quiet", "--out", str(out))
    c.run(sys.executable, "-m", "del_megatron.cli.eval", "compare", *map(str, results), "--out",
          str(c.work / f"{name}-compare"))
    ours, theirs = (json.loads((d / "results.json").read_text())["numeric"] for d in results)
    for key in ("loss", "digit_entropy"):
        c.below(f"{key}_rel_diff", relative(ours[key], theirs[key]), "eval")
    c.figures.update({k: ours.get(k) for k in ("loss", "digit_acc", "number_abs_error")})
    return export


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
    c.below("hook_over_megatron_time", float(time_ratio), "hook_time")
    c.below("hook_over_megatron_peak", float(peak), "hook_peak")


def check_bench_fused(c: Check) -> None:
    # "fused / megatron: time Tx, peak memory Mx"; "chunk   4096: fused time Tx, ... (Mx)"
    pattern = rf"^(fused / megatron|chunk +\d+): (?:fused )?time {NUMBER}x, peak.*?{NUMBER}x"
    rows = bench(c, "fused", pattern)
    if {what[:5] for what, *_ in rows} != {"fused", "chunk"}:
        raise Failed("bench/loss_fused.py printed no 'fused / megatron' and 'chunk' lines")
    for what, time_ratio, peak in rows:
        kind = what[:5]
        name = what.replace(" ", "") if kind == "chunk" else "fused_over_megatron"
        c.below(f"{name}_time", float(time_ratio), f"{kind}_time")
        c.below(f"{name}_peak", float(peak), f"{kind}_peak")


def check_bench_train_step(c: Check) -> None:
    pattern = rf"^(mle|del) +{NUMBER} +{NUMBER}x +{NUMBER} +{NUMBER} +{NUMBER}\s*$"
    rows = {kind: [float(v) for v in values] for kind, *values in bench(c, "step", pattern)}
    if set(rows) != {"mle", "del"}:  # each: step ms, ratio, tokens/s, TFLOP/s, MFU
        raise Failed("bench/train_step.py printed no 'mle' and 'del' rows")
    c.below("del_over_mle", rows["del"][0] / rows["mle"][0], "del_over_mle")
    c.within("tokens_per_s_del", rows["del"][2], lo=1)
    if c.mode.bounds["mfu"] is not None:
        c.within("mfu_del", rows["del"][4], c.mode.bounds["mfu"], 1)


# name, function, estimate on one H200 (s), time limit (s); a TP 2 check needs 2 GPUs. Not
# measured yet: ~15 s to import megatron-core and DeepSpeed, ~1 min for the first compile.
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


def probe_env(device: str) -> dict:
    """Versions, and what decides the GPU paths (issue 25 item 10): which product forms the
    fused op's weight gradient, Transformer Engine, flash SDPA."""
    import importlib

    import torch

    from del_megatron.losses.fused import addmm_out_dtype_supported
    from del_megatron.models.device import select_accelerator, transformer_engine_available

    dev = torch.device(device)
    select_accelerator(dev)  # before DeepSpeed is imported
    addmm = addmm_out_dtype_supported(dev, torch.bfloat16)
    facts = {"python": sys.version.split()[0], "torch": torch.__version__,
             "cuda": torch.version.cuda, "addmm_out_dtype": addmm, "transformer_engine": None,
             "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
             "fused_weight_grad": ("addmm(out_dtype=float32)" if addmm else
                                   "float32 product of upcast chunks (slower)") + " in bf16"}
    modules = ["megatron.core", "deepspeed", "transformers", "pydantic", "webdataset"]
    if transformer_engine_available():
        modules.append("transformer_engine")
    for module in modules:
        facts[module.split(".")[0]] = importlib.import_module(module).__version__
    if dev.type == "cuda":
        from deepspeed.accelerator import get_accelerator
        from torch.nn.attention import SDPBackend, sdpa_kernel

        q = torch.randn(1, 2, 64, 64, device=dev, dtype=torch.bfloat16)
        try:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        except RuntimeError:
            q = None
        facts.update(gpu=torch.cuda.get_device_name(dev), flash_sdpa=q is not None,
                     nccl=".".join(map(str, torch.cuda.nccl.version())),  # a tuple (torch>=2.1)
                     deepspeed_accelerator=get_accelerator()._name)
    return facts


def tiny_qwen2(out: Path, tokenizer: Path) -> None:
    """A random Qwen2ForCausalLM with tied embeddings in the tiny config's shape, saved by the
    installed transformers with the run's tokenizer beside it."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=1024, hidden_size=128, intermediate_size=352, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)).float().eval()
    with torch.no_grad():  # non-trivial norms and biases, so that a dropped one shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(out)
    shutil.copy(tokenizer, out / "tokenizer.model")



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
        except (Failed, Skipped) as err:
            status, note = "skipped" if isinstance(err, Skipped) else "fail", str(err)
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
    return "\n".join([*lines, "{pass} passed, {fail} failed, {skipped} skipped".format(**counts)])


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
    if args.probe_env:  # a check's input
        return print(json.dumps(probe_env(args.probe_env))) or 0
    if args.tiny_qwen2:
        return tiny_qwen2(*args.tiny_qwen2) or 0
    mode, gpus = (CPU, 1) if args.cpu_smoke else (GPU, 1 if args.plan else usable_gpus())
    plan = plan_for(max(gpus, listed_gpus()) if args.plan else gpus)
    estimate = sum(check[2] for check in plan)
    print(f"gpu_acceptance: {'CPU smoke' if args.cpu_smoke else f'{gpus} GPU(s)'}, "
          f"{len(plan)} checks, estimate {estimate} s on H200s (budget {BUDGET_S} s on one)")
    if args.plan:
        return print("\n".join(f"  {n:21s} ~{e:3d} s, limit {lim * mode.slowdown} s"
                               for n, _, e, lim in plan)) or 0
    work = Path(tempfile.mkdtemp(prefix="gpu-acceptance."))
    (work / "logs").mkdir()
    out = Path(os.environ.get("OUT") or work)
    out.mkdir(parents=True, exist_ok=True)
    site = os.environ.get("DEL_SITE", "/tmp/del-site-py{}.{}".format(*sys.version_info[:2]))
    path = os.pathsep.join(filter(None, [str(ROOT), site, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "DEL_SITE": site, "DEL_PYTHON": sys.executable, "PYTHONPATH": path,
           "PATH": f"{site}/bin{os.pathsep}{os.environ['PATH']}", "PYTHONUNBUFFERED": "1",
           "PYTHONWARNINGS": "ignore::UserWarning,ignore::FutureWarning,ignore::DeprecationWarning"}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # Check.run then stops its command
    started = time.monotonic()

    def record(rows: list[dict]) -> None:  # the JSON and the logs so far, replaced atomically
        document = {"mode": "cpu-smoke" if args.cpu_smoke else "gpu", "gpus": gpus,
                    "wall_s": round(time.monotonic() - started), "estimate_s": estimate,
                    "failed": sum(r["status"] == "fail" for r in rows), "checks": rows}
        (out / "gpu_acceptance.json.tmp").write_text(json.dumps(document, indent=1) + "\n")
        os.replace(out / "gpu_acceptance.json.tmp", out / "gpu_acceptance.json")
        if out != work:
            shutil.copytree(work / "logs", out / "logs", dirs_exist_ok=True)

    rows = run_plan(plan, mode, work, env, record)
    print(f"\n{table(rows)}\nwall {round(time.monotonic() - started)} s (estimate {estimate} "
          f"s); work directory {work}; results: {out / 'gpu_acceptance.json'}")
    return 1 if any(r["status"] == "fail" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
