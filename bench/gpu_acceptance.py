"""GPU acceptance: the user's own commands on this machine's GPUs, every figure bounded.

    bash bench/gpu_acceptance.sh [--cpu-smoke] [--plan]

PLAN's checks run in order, each under its time limit, each bound (GPU, CPU smoke) beside its
figure; what they run, print and exit with: docs/benchmarks.md, "GPU".
"""

import argparse
import contextlib
import json
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ONE_RANK_SWITCH = "DEL_COLLECTIVES_ON_ONE_RANK"  # del_megatron/collectives.py's ON_ONE_RANK
BUDGET_S = 8 * 60  # the one-GPU plan on one H200
WHEELS = ROOT / ".whl"  # bench/fetch_gpu_wheels.sh; installed into $DEL_SITE
CARRIED = ("megatron-core", "deepspeed", "pydantic", "webdataset")  # what .whl/ brings
NUMBER = r"([-+0-9.eE]+|nan|inf)"


@dataclass(frozen=True)
class Mode:
    device: str
    steps: int  # the tiny runs' length
    stop_at: int  # SIGUSR1 once metrics.jsonl reaches this step; also the log interval
    slowdown: int  # time limits x this


# CPU smoke: limits that catch a hang only (two shared cores: a tiny run took 199 s, then 740 s)
GPU, CPU = Mode("cuda", 20, 8, 1), Mode("cpu", 8, 3, 10)


class Failed(Exception):
    """A command that failed or a figure out of its bound: the row's note."""


@dataclass
class Check:
    """One row: its commands, run under its deadline, and its figures, each judged."""
    name: str
    mode: Mode
    work: Path
    env: dict
    deadline: float
    figures: dict = field(default_factory=dict)

    def pick(self, gpu, cpu):
        return gpu if self.mode.device == "cuda" else cpu

    def within(self, name: str, value: float, lo=-math.inf, hi=math.inf) -> None:
        """Record a figure; out of [lo, hi] (NaN too) fails the check."""
        self.figures[name] = value
        if not lo <= value <= hi:
            raise Failed(f"{name} = {value:.6g}, outside its bound [{lo:g}, {hi:g}]")

    def below(self, name: str, value: float, gpu: float, cpu: float) -> None:
        self.within(name, value, 0, self.pick(gpu, cpu))

    def run(self, *cmd: str, ok=(0,), env=None, stop_when=None, pattern=None):
        """cmd's output (an exit status not in ok fails); with pattern, the figures of each line
        that matches it (none fails). stop_when: SIGUSR1 to cmd once this is true."""
        status, text = self.spawn(cmd, env or self.env, stop_when)
        if status not in ok:
            raise Failed(f"exit {status} (expected {ok[0]}): {failure_line(text)}")
        if pattern is None:
            return text
        if not (found := re.findall(pattern, text, re.M)):
            script = next((word for word in cmd if word.endswith(".py")), cmd[0])
            raise Failed(f"{script} printed no line like {pattern!r}")
        return found

    def spawn(self, cmd, env, stop_when) -> tuple[int, str]:
        """Run cmd from the checkout, its output into logs/NAME.log; stopped at the deadline."""
        with (self.work / "logs" / f"{self.name}.log").open("ab+") as log:
            log.write(f"$ {shlex.join(cmd)}\n".encode())
            start = log.tell()
            log.flush()
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
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
            return proc.returncode, log.read().decode(errors="replace")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to its process group (launch/torchrun.sh: every rank saves), SIGKILL 30 s later
    to all it started (torchrun's ranks have groups of their own; psutil refuses reused pids)."""
    import psutil

    started = psutil.Process(proc.pid).children(recursive=True)
    os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(30)
    for process in [proc, *started]:  # (Popen.kill skips a process already reaped)
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    proc.wait()


def failure_line(text: str) -> str:
    """The line that says why a command failed: the last naming an error, else the last."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    named = [line for line in lines if re.search(r"error|exception", line, re.I)]
    return (named or lines or ["no output"])[-1][:300]


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(1.0, abs(b))


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def visible(path: list[str]) -> dict:
    """The distributions a process with this sys.path imports (the first of each name)."""
    return {canonical(d.metadata["Name"]): d for d in [*metadata.distributions(path=path)][::-1]}


def carried_requirements(pyproject: Path) -> list[str]:
    """pyproject.toml's requirements of the carried packages (one source of the versions)."""
    import tomllib

    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return [d for d in deps if canonical(re.match(r"[\w.-]+", d)[0]) in CARRIED]


def check_install(c: Check) -> str:
    """.whl/'s wheels where the interpreter lacks the distribution or has an older one (pip
    picks the file for this Python); then what they and pyproject.toml require must be met."""
    try:  # pip's copy where the image lacks packaging
        from packaging.requirements import Requirement
        from packaging.version import Version
    except ImportError:
        from pip._vendor.packaging.requirements import Requirement
        from pip._vendor.packaging.version import Version

    site, python = c.env["DEL_SITE"], f"Python {sys.version.split()[0]}"
    if sys.version_info < (3, 11):  # noqa: UP036 (older NGC images: a row, not a traceback)
        raise Failed(f"{python}: the project needs >= 3.11 (pyproject.toml); set DEL_PYTHON")
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
        # the base release counts: NGC's torch 2.6.0a0+nv meets >=2.6
        if dist is None or not any(requirement.specifier.contains(v, prereleases=True) for v in
                                   (dist.version, Version(dist.version).base_version)):
            unmet.append(f"{who} needs {requirement}" + (f", has {dist.version}" if dist else ""))
    if unmet:
        raise Failed(f"{python}: {'; '.join(unmet)[:300]} (wheels: {WHEELS}, "
                     "bash bench/fetch_gpu_wheels.sh)")
    return f"{python}: " + (", ".join(todo) or "nothing missing")


def check_env(c: Check) -> str:
    facts = json.loads(c.run(sys.executable, __file__, "--probe-env", c.mode.device)
                       .splitlines()[-1])
    c.figures.update(facts)
    if c.mode.device == "cuda":
        c.within("gpus", facts["gpus"], lo=1)
        if facts["deepspeed_accelerator"] != "cuda":
            raise Failed(f"DeepSpeed picked accelerator {facts['deepspeed_accelerator']}")
    return f"fused weight gradient: {facts['fused_weight_grad']}"


def probe_env(device: str) -> dict:
    """(In a child.) Versions, and what decides the GPU paths (issue 25 item 10): the product
    that forms the fused op's weight gradient, Transformer Engine, flash SDPA."""
    import importlib

    import torch

    from del_megatron.losses.fused import addmm_out_dtype_supported
    from del_megatron.models.device import select_accelerator, transformer_engine_available

    dev = torch.device(device)
    select_accelerator(dev)  # before DeepSpeed is imported
    product = ("addmm(out_dtype=float32)" if addmm_out_dtype_supported(dev, torch.bfloat16)
               else "float32 product of upcast chunks (slower)")
    facts = {"python": sys.version.split()[0], "torch": torch.__version__,
             "cuda": torch.version.cuda, "transformer_engine": None,
             "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
             "fused_weight_grad": f"{product} in bf16"}
    te = ["transformer_engine"] if transformer_engine_available() else []
    for module in ["megatron.core", "deepspeed", "transformers", "pydantic", "webdataset", *te]:
        facts[module.split(".")[0]] = importlib.import_module(module).__version__
    if dev.type == "cuda":
        from deepspeed.accelerator import get_accelerator
        from torch.nn.attention import SDPBackend, sdpa_kernel

        q = torch.randn(1, 2, 64, 64, device=dev, dtype=torch.bfloat16)
        try:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
            flash = True
        except RuntimeError:
            flash = False
        facts.update(gpu=torch.cuda.get_device_name(dev), flash_sdpa=flash,
                     nccl=".".join(map(str, torch.cuda.nccl.version())),
                     deepspeed_accelerator=get_accelerator()._name)
    return facts


def check_deepspeed_config(c: Check) -> str:
    """The bf16 config's gradients accumulate in fp32 (issue 25 item 4), not DeepSpeed's bf16."""
    out = c.run(sys.executable, "-m", "del_megatron.cli.train", "--config",
                "configs/qwen2.5_7b.yaml", "--deepspeed-json", "8")
    config = json.loads(out[out.index("{"):])
    bf16 = c.figures["bf16"] = config.get("bf16", {}).get("enabled")
    dtype = c.figures["grad_accum_dtype"] = config.get("data_types", {}).get("grad_accum_dtype")
    if not bf16 or dtype != "fp32":
        raise Failed(f"bf16 {bf16}, data_types.grad_accum_dtype {dtype!r}, expected 'fp32'")
    return "bf16, gradients accumulated in fp32"


def check_data(c: Check) -> str:
    c.run("bash", "launch/tiny_data.sh", str(c.work / "data"), "1500")
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


def judge_run(c: Check, records: dict[int, dict]) -> None:
    """Every step logged, loss in (0, 100) and gradient norm below 1e4 (NaN fails); loss fell."""
    last = c.mode.steps
    if sorted(records) != list(range(1, last + 1)):
        raise Failed(f"metrics.jsonl has steps {sorted(records)[:4]}..., expected 1..{last}")
    for r in records.values():
        if not (0 < r["loss"] < 100 and 0 <= r["grad_norm"] < 1e4):
            raise Failed(f"step {r['step']}: loss {r['loss']}, grad norm {r['grad_norm']}")
    c.figures["loss_step1"] = records[1]["loss"]
    c.within("loss_fall", records[1]["loss"] - records[last]["loss"], lo=1e-3)
    c.within("tokens_per_s", statistics.median(r["tokens_per_s"] for r in records.values()),
             lo=1)


# Bounds (GPU, CPU smoke). In bf16 fused and unfused sum in other orders, and a run is not
# bit-reproducible (atomic adds in backward): a resumed run drifts by bf16 ulps a step (0.02 in
# a weight after 7 Adam steps at lr 3e-3). In float32 on the CPU the two paths agree to
# rounding (.ci/run); resume and one-rank collectives are bit-exact (tests/training).
STEP1, LATER, RESUMED = (1e-2, 1e-5), (2e-2, 1e-4), (2e-2, 0.0)


def check_train(c: Check, tp: int, fused: bool) -> str:
    run = f"train-{'fused-' if fused else ''}tp{tp}"
    c.run(*tiny(c, run, tp, *(["loss.fused_output=true"] if fused else [])))  # default: false
    ours = metrics(c.work / run)
    judge_run(c, ours)
    if not (c.work / run / "checkpoints" / f"step-{c.mode.steps:07d}").is_dir():
        raise Failed(f"no checkpoint of step {c.mode.steps}")
    if fused:  # issue 25 item 7: step 1 (same weights and batch) forward and backward, then
        unfused = metrics(c.work / f"train-tp{tp}")  # the losses after the fused op's updates
        for key in ("loss", "grad_norm"):
            c.below(f"step1_{key}_rel_diff", relative(ours[1][key], unfused[1][key]), *STEP1)
        c.below("loss_max_rel_diff", loss_diff(ours, unfused), *LATER)
    return f"{c.mode.steps} steps at TP {tp}" + (", as the unfused run" if fused else "")


def check_one_rank_collectives(c: Check) -> str:
    """Our collectives issued on one-rank groups (issue 25 item 13): train-tp1's run again, the
    same length (the learning-rate schedule follows train.steps), every loss and the weights."""
    c.run(*tiny(c, "one-rank", 1), env={**c.env, ONE_RANK_SWITCH: "1"})
    as_straight_run(c, c.work / "one-rank", c.work / "train-tp1")
    return f"{ONE_RANK_SWITCH}=1: {c.mode.steps} steps as the run without it"


def check_stop_resume(c: Check, tp: int) -> str:
    run = c.work / f"stop-resume-tp{tp}"
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
    as_straight_run(c, run, c.work / f"train-tp{tp}")
    return f"SIGUSR1, exit 75 at step {stopped_at}, resumed to {c.mode.steps}"


def as_straight_run(c: Check, run: Path, straight: Path) -> None:
    """run, judged, against the straight run of the same command: every loss, and the largest
    |difference| of the final weights (tp*.safetensors)."""
    from safetensors.torch import load_file

    judge_run(c, metrics(run))
    c.below("loss_max_rel_diff", loss_diff(metrics(run), metrics(straight)), *RESUMED)
    final = f"checkpoints/step-{c.mode.steps:07d}/model"
    x, y = ({f"{p.name}:{k}": t for p in sorted((d / final).glob("tp*.safetensors"))
             for k, t in load_file(p).items()} for d in (run, straight))
    if not x or x.keys() != y.keys() or any(x[k].shape != y[k].shape for k in x):
        raise Failed(f"the weights of {run / final} and {straight / final} differ in files, "
                     "names or shapes")
    difference = max((x[k].double() - y[k].double()).abs().max().item() for k in x)
    c.below("weights_max_abs_diff", difference, *RESUMED)


def check_init_hf(c: Check) -> str:
    """A tied Qwen-2 -> init.hf -> 2 steps -> del-convert: a tied export, evaluated as ours."""
    from safetensors.torch import load_file

    hf, run = c.work / "qwen2", c.work / "init-hf"
    c.run(sys.executable, "-c", "from tests.models.tiny_hf import tiny_hf_model; tiny_hf_model("
          f"'qwen2-tied', {str(hf)!r}, vocab_size=1024, hidden_size=128, intermediate_size=352, "
          "num_hidden_layers=4, max_position_embeddings=256, rope_theta=1e4, rms_norm_eps=1e-5)")
    shutil.copy(c.work / "data/tokenizer.model", hf)
    c.run(*tiny(c, run.name, 1, "train.steps=2", "data.tokenizer=null", f"init.hf={hf}",
                "model.family=qwen2", "model.qkv_bias=true", "model.tie_word_embeddings=true",
                "eval.sources=[]", data=False))
    evaluate_with_export(c, run / "checkpoints/step-0000002", "init-hf")
    export = c.work / "init-hf-export"
    stored = [name for file in export.glob("*.safetensors") for name in load_file(file)]
    tied = json.loads((export / "config.json").read_text()).get("tie_word_embeddings")
    if not tied or "lm_head.weight" in stored:
        raise Failed(f"export: tie_word_embeddings {tied}, lm_head.weight stored")
    return "tied export; its del-eval metrics equal the checkpoint's"


def evaluate_with_export(c: Check, checkpoint: Path, name: str) -> str:
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
        c.below(f"{key}_rel_diff", relative(ours[key], theirs[key]), *LATER)
    c.figures.update({k: ours.get(k) for k in ("loss", "digit_acc", "number_abs_error")})
    return "a checkpoint and its export: the same loss and digit entropy"


# The benchmarks (GPU, CPU smoke): on the GPU, docs/benchmarks.md's goals; on the CPU only a
# broken wiring fails (toy timings on shared cores are noise, the RSS meter coarse).
def check_bench_hook(c: Check) -> None:
    (time_ratio, peak), = c.run(sys.executable, *c.pick(
        "bench/loss_tp.py --device cuda --dtype bf16 --vocab 152064 --tokens 16384 --repeats 10",
        "bench/loss_tp.py --device cpu --dtype bf16 --vocab 8192 --tokens 2048 --repeats 1",
    ).split(), pattern=rf"^hook / .*?: time {NUMBER}x, peak {NUMBER}x")
    c.below("hook_over_megatron_time", float(time_ratio), 1.05, 3)  # megatron's fused CE
    c.below("hook_over_megatron_peak", float(peak), 1.02, 3)  # logits handed over: +2%


def check_bench_fused(c: Check) -> None:
    """"fused / megatron: time Tx, peak memory Mx"; "chunk   4096: fused time Tx, ... (Mx)"."""
    rows = c.run(sys.executable, *c.pick(
        "bench/loss_fused.py --device cuda --dtype bf16 --tp 1 --tokens 16384 --chunk 1024 "
        "--chunks 4096 --paths megatron,fused --memory fresh --repeats 3",
        "bench/loss_fused.py --device cpu --dtype fp32 --tp 1 --vocab 16384 --hidden 256 "
        "--tokens 1024 --chunk 256 --chunks 512 --paths megatron,fused --memory fresh --repeats 1",
    ).split(), pattern=rf"^(fused / megatron|chunk +\d+): (?:fused )?time {NUMBER}x, "
                       rf"peak.*?{NUMBER}x")
    if {what[:5] for what, *_ in rows} != {"fused", "chunk"}:
        raise Failed("bench/loss_fused.py printed no 'fused / megatron' and 'chunk' lines")
    for what, time_ratio, peak in rows:
        chunk = what.startswith("chunk")
        name = what.replace(" ", "") if chunk else "fused_over_megatron"
        c.below(f"{name}_time", float(time_ratio), 1.00, 3)  # megatron's time at most
        # peak with .grad fresh (ZeRO 2/3): the goal, 0.10; a 4096-token chunk: a quarter
        # of the 16384 tokens' logits, twice over
        c.below(f"{name}_peak", float(peak), 0.50 if chunk else 0.10, 1)


def check_bench_train_step(c: Check) -> None:
    """A training step of a 4-layer model at 7B widths: DEL over MLE, tokens/s, MFU."""
    rows = c.run(sys.executable, *c.pick(
        "bench/train_step.py --gpu-7b --steps 6",
        "-m torch.distributed.run --standalone --nproc-per-node=2 bench/train_step.py --steps 1",
    ).split(), pattern=rf"^(mle|del) +{NUMBER} +{NUMBER}x +{NUMBER} +{NUMBER} +{NUMBER} +"
                       rf"{NUMBER}\s*$")  # step ms, ratio, tokens/s, TFLOP/s, MFU, numeric
    rows = {kind: [float(v) for v in values] for kind, *values in rows}
    if set(rows) != {"mle", "del"}:
        raise Failed("bench/train_step.py printed no 'mle' and 'del' rows")
    if not (math.isnan(rows["mle"][5]) and rows["del"][5] > 0):  # MLE has no numeric term
        raise Failed(f"bench/train_step.py: numeric term {rows['mle'][5]} (mle), "
                     f"{rows['del'][5]} (del): the two variants ran the same loss")
    c.below("del_over_mle", rows["del"][0] / rows["mle"][0], 1.03, 3)
    c.within("tokens_per_s_del", rows["del"][2], lo=1)
    if c.mode.device == "cuda":  # a floor (host syncs, fp32 math); no CPU peak to judge
        c.within("mfu_del", rows["del"][4], 0.20, 1)


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
    ("del-eval", lambda c: evaluate_with_export(c, c.work / "train-tp1/checkpoints" /
                                                 f"step-{c.mode.steps:07d}", "eval"), 40, 240),
    ("bench-hook-ce", check_bench_hook, 20, 120),
    ("bench-fused", check_bench_fused, 55, 240),  # five processes
    ("bench-train-step", check_bench_train_step, 50, 240),
]
BLOCKING = ("install", "env")  # when one fails, the later checks are skipped


def plan_for(gpus: int) -> list[tuple]:
    return [check for check in PLAN if gpus >= 2 or not check[0].endswith("-tp2")]


def run_plan(plan: list[tuple], mode: Mode, work: Path, env: dict, record=print) -> list[dict]:
    """The checks in order; record(rows) after each (a run cut short keeps its rows)."""
    rows, blocked = [], None
    for i, (name, function, estimate, limit) in enumerate(plan, 1):
        print(f"[{i:2d}/{len(plan)}] {name:21s} ~{estimate:3d} s  ", end="", flush=True)
        c = Check(name, mode, work, env, time.monotonic() + limit * mode.slowdown)
        start = time.monotonic()
        try:
            status, note = ("skipped", f"the {blocked} check failed") if blocked else (
                "pass", function(c) or "")
        except Failed as err:
            status, note = "fail", str(err)
        except Exception as err:  # our bug: the row names it, the log has the traceback
            with (work / "logs" / f"{name}.log").open("a") as f:
                f.write(traceback.format_exc())
            status, note = "fail", f"{type(err).__name__}: {err}"
        blocked = blocked or (name if status == "fail" and name in BLOCKING else None)
        seconds = round(time.monotonic() - start, 1)
        print(f"{status} ({seconds} s)" + (f": {note}" if status != "pass" else ""))
        rows.append({"name": name, "status": status, "seconds": seconds,
                     "estimate_s": estimate, "note": note, "figures": c.figures})
        record(rows)
    return rows


def table(rows: list[dict]) -> str:
    """A line a check: name, status, seconds, estimate, its note and figures."""
    lines = [f"{'check':21s} {'status':7s} {'s':>6s} {'est':>4s}  note; figures"]
    for r in rows:
        figures = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                            for k, v in r["figures"].items())
        lines.append(f"{r['name']:21s} {r['status']:7s} {r['seconds']:6.1f} {r['estimate_s']:4d}"
                     "  " + "; ".join(filter(None, [r["note"], figures])))
    counts = {s: sum(r["status"] == s for r in rows) for s in ("pass", "fail", "skipped")}
    return "\n".join([*lines, "{pass} passed, {fail} failed, {skipped} skipped".format(**counts)])


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


def usable_gpus() -> int:
    """What nvidia-smi lists and this interpreter's torch sees (in a child, whose warnings and
    CUDA state stay there)."""
    try:
        smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
        listed = sum(line.startswith("GPU") for line in smi.stdout.splitlines())
    except (OSError, subprocess.TimeoutExpired):
        listed = 0
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__, "
                            "torch.cuda.device_count() if torch.cuda.is_available() else 0)"],
                           capture_output=True, text=True, timeout=300, check=False)
    if probe.returncode:
        raise SystemExit(f"gpu_acceptance: {sys.executable} cannot import torch: "
                         f"{failure_line(probe.stderr)}")
    version, seen = probe.stdout.split()[-2:]
    return gpus_to_use(listed, int(seen), version)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="the wiring, on the CPU")
    parser.add_argument("--plan", action="store_true", help="print the checks and estimates")
    parser.add_argument("--probe-env", metavar="DEVICE", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe_env:  # check_env's input, in a child
        print(json.dumps(probe_env(args.probe_env)))
        return 0
    mode = CPU if args.cpu_smoke else GPU
    gpus = 1 if args.cpu_smoke or args.plan else usable_gpus()
    plan = plan_for(gpus)
    estimate = sum(check[2] for check in plan)
    print(f"gpu_acceptance: {'CPU smoke' if args.cpu_smoke else f'{gpus} GPU(s)'}, "
          f"{len(plan)} checks, estimate {estimate} s on H200s (budget {BUDGET_S} s on one)")
    if args.plan:  # PLAN's every check, those of two or more GPUs marked
        for check in PLAN:
            print(f"  {check[0]:21s} ~{check[2]:3d} s, limit {check[3] * mode.slowdown} s"
                  + ("" if check in plan else " (2+ GPUs)"))
        return 0
    work = Path(tempfile.mkdtemp(prefix="gpu-acceptance."))
    out = Path(os.environ.get("OUT") or work)
    (work / "logs").mkdir()
    out.mkdir(parents=True, exist_ok=True)
    site = os.environ.get("DEL_SITE", "/tmp/del-site-py{}.{}".format(*sys.version_info[:2]))
    path = os.pathsep.join(filter(None, [str(ROOT), site, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "DEL_SITE": site, "DEL_PYTHON": sys.executable, "PYTHONPATH": path,
           "PATH": f"{site}/bin{os.pathsep}{os.environ['PATH']}", "PYTHONUNBUFFERED": "1",
           "PYTHONWARNINGS": "ignore::UserWarning,ignore::FutureWarning,ignore::DeprecationWarning"}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # Check.spawn stops its command
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
