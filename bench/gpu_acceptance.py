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
# The one-GPU plan on one H200, under the 10 minutes a lent machine runs one command: 8
# minutes before the megatron engine's own straight run and the engines' benchmark (issue
# 50, 75 s more). Rows of two ranks run on two GPUs only (gpus_needed), outside it.
BUDGET_S = 570
WHEELS = ROOT / ".whl"  # bench/fetch_gpu_wheels.sh; installed into $DEL_SITE
CARRIED = ("megatron-core", "deepspeed", "pydantic", "webdataset")  # what .whl/ brings
# pyproject.toml's requirements the install row judges: the carried ones, and the image's
# torch (not carried; its floor is the oldest API the code calls, tests/test_dependency_floors.py)
JUDGED = ("torch", *CARRIED)
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
    gpus: int = 1  # what main() found usable: nvidia-smi's GPUs, seen by this torch
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


def judged_requirements(pyproject: Path) -> list[str]:
    """pyproject.toml's requirements of JUDGED's packages (one source of the versions)."""
    import tomllib

    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return [d for d in deps if canonical(re.match(r"[\w.-]+", d)[0]) in JUDGED]


def check_install(c: Check) -> str:
    """.whl/'s wheels where the interpreter lacks the distribution or has an older one (pip
    picks the file for this Python); then what they require, and pyproject.toml of them and
    of the image's torch, must be met."""
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
    wanted = [("pyproject.toml", r) for r in judged_requirements(ROOT / "pyproject.toml")]
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
        where = "the image's torch: DEL_PYTHON picks the interpreter; " if any(
            re.match(r"pyproject.toml needs torch\b", u) for u in unmet) else ""
        raise Failed(f"{python}: {'; '.join(unmet)[:300]} ({where}wheels: {WHEELS}, "
                     "bash bench/fetch_gpu_wheels.sh)")
    return f"{python}: " + (", ".join(todo) or "nothing missing")


def check_env(c: Check) -> str:
    """The facts of a child started as every check's commands are (--probe-env): it must see
    the GPUs main() found (none would have exited before), and DeepSpeed's CUDA accelerator.
    Its DeepSpeed engines' read-back goes to work/env.json for deepspeed-config."""
    facts = json.loads(c.run(sys.executable, __file__, "--probe-env", c.mode.device)
                       .splitlines()[-1])
    (c.work / "env.json").write_text(json.dumps(facts))
    c.figures.update({k: v for k, v in facts.items() if k != "deepspeed_engines"})
    if c.mode.device == "cuda":
        c.within("gpus", facts["gpus"], c.gpus, c.gpus)
        if facts["deepspeed_accelerator"] != "cuda":
            raise Failed(f"DeepSpeed picked accelerator {facts['deepspeed_accelerator']}")
    return f"fused weight gradient: {facts['fused_weight_grad']}"


def probe_env(device: str) -> dict:
    """(In a child.) Versions, and what decides the GPU paths (issue 25 item 10): the product
    that forms the fused op's weight gradient, Transformer Engine, flash SDPA."""
    import importlib

    import torch

    from del_megatron.losses.fused import addmm_out_dtype_supported
    from del_megatron.models.spec import transformer_engine_available
    from del_megatron.runtime import select_accelerator

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
    try:  # deepspeed-config's figures; a failure there is that row's, not a blocking one
        from del_megatron.config import load_run_config
        from del_megatron.training.engines.deepspeed import deepspeed_config

        run = load_run_config(ROOT / "configs" / "qwen2.5_7b.yaml", [])
        facts["deepspeed_engines"] = probe_deepspeed(dev, deepspeed_config(run, 8, gpu=True))
    except Exception as err:  # whatever DeepSpeed raises: named in the row
        facts["deepspeed_engines"] = {"error": failure_line(f"{type(err).__name__}: {err}")}
    return facts


GRAD_SUM = 1 + 2**-9  # two micro-batches' gradients, 1 and 2^-9: float32's sum (bf16's: 1)


def probe_deepspeed(device, config: dict, stages=(1, 2, 3)) -> dict:
    """(In the env child.) DeepSpeed's engine under the generated `config` at ZeRO 1, 2 and 3
    on this process's device, read back: the dtypes it chose and the gradient it holds at
    the accumulation boundary of two micro-batches whose gradients are 1 and 2^-9 (a bf16
    sum rounds to 1: an engine that ignored data_types.grad_accum_dtype shows it)."""
    import deepspeed
    import torch
    from deepspeed.utils import safe_get_full_grad

    from del_megatron.parallel import init_distributed

    class Probe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(8))

        def forward(self, x):
            return (self.weight * x).sum()

    init_distributed(device, 10)
    found = {}
    for stage in stages:
        one_gpu = {**config, "train_batch_size": 2, "train_micro_batch_size_per_gpu": 1,
                   "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
                   "zero_optimization": {**config["zero_optimization"], "stage": stage}}
        model = Probe()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=one_gpu)
        for x in (2.0, 2**-8):  # engine.backward divides by the 2 micro-batches
            engine.backward(engine(torch.full((8,), x, device=device, dtype=torch.bfloat16)))
            if x < 1:  # the boundary: summed, not yet stepped
                grad = safe_get_full_grad(engine.module.weight).double().mean().item()
            engine.step()
        model_dtype, accumulation = engine.get_data_types()
        found[str(stage)] = {
            "optimizer": type(engine.optimizer).__name__, "model_dtype": str(model_dtype),
            "grad_accum_dtype": str(accumulation),
            "communication_data_type": str(engine.communication_data_type), "grad_sum": grad}
        engine.destroy()
    return found


def check_deepspeed_config(c: Check) -> str:
    """What DeepSpeed's engine did with the config generated for configs/qwen2.5_7b.yaml (the
    env child's engines at ZeRO 1, 2, 3, read back): bf16 weights, gradients summed in
    float32 (the sum of 1 and 2^-9 kept) and reduced in float32 (issue 25 item 4)."""
    engines = json.loads((c.work / "env.json").read_text())["deepspeed_engines"]
    if "error" in engines:
        raise Failed(f"DeepSpeed's engine: {engines['error']}")
    for stage, e in sorted(engines.items()):
        c.figures[f"zero{stage}_optimizer"] = e["optimizer"]
        dtypes = (e["model_dtype"], e["grad_accum_dtype"], e["communication_data_type"])
        if dtypes != ("torch.bfloat16", "torch.float32", "torch.float32"):
            raise Failed(f"ZeRO {stage}: weights, gradient sums, reduction in {dtypes}, "
                         "expected bf16, float32, float32")
        c.within(f"zero{stage}_grad_sum", e["grad_sum"], GRAD_SUM, GRAD_SUM)
    return "bf16; gradients summed and reduced in float32 at ZeRO " + ", ".join(sorted(engines))


def check_data(c: Check) -> str:
    c.run("bash", "launch/tiny_data.sh", str(c.work / "data"), "1500")
    return "launch/tiny_data.sh: corpus, tokenizer, shards"


def tiny(c: Check, run: str, tp: int, *overrides: str, data: bool = True,
         procs: int | None = None) -> list[str]:
    """launch/torchrun.sh of configs/tiny_cpu.yaml on this mode's device, output in work/run;
    `procs` processes (default: tp, data parallel 1)."""
    d = c.work / "data"
    own = [f"data.tokenizer={d}/tokenizer.model",
           f"eval.sources=[{{manifest: {d}/shards/heldout/manifest.json}}]"] if data else []
    return ["bash", "launch/torchrun.sh", "--nproc-per-node", str(procs or tp),
            "configs/tiny_cpu.yaml",
            f"train.device={c.mode.device}", f"train.steps={c.mode.steps}",
            f"train.log_interval={c.mode.stop_at}", "eval.max_batches=2",
            "train.deterministic=true", "logging.wandb=disabled", "logging.progress_bar=false",
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
    # recorded only: the trainer's throughput is judged against a synchronised timer in
    # bench-train-step (a bound here passed whatever the timing)
    c.figures["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in records.values())


# Bounds (GPU, CPU smoke). In bf16 fused and unfused sum in other orders: within bf16's
# rounding; in float32 on the CPU to rounding (.ci/run). The tiny runs are deterministic
# (train.deterministic: no atomic adds), so a resumed run and a run with our collectives on
# one-rank groups repeat the straight run bit for bit on both: any other bound passed a
# resume with a wrong optimizer state (the learning rates of the resumed steps sum to ~0.012,
# and Adam moves a weight at most ~lr a step).
STEP1, LATER, RESUMED = (1e-2, 1e-5), (2e-2, 1e-4), (0.0, 0.0)
# The two engines (GPU: bf16 reductions in other orders; CPU: float32, where they differ by
# megatron's optimizer decaying no bias or norm weight, tiny_cpu.yaml's weight decay 0.01)
ENGINES = (2e-2, 1e-3)


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
    same length (the learning-rate schedule follows train.steps), every loss and the weights
    bit for bit, and the torch.distributed calls del_megatron/collectives.py made on one-rank
    groups counted in every process (bench/acceptance_site/sitecustomize.py): the numbers are
    the same whether the switch is honoured or not, the count is not."""
    counts = c.work / "one-rank-collectives"
    counts.mkdir(exist_ok=True)
    path = os.pathsep.join(filter(None, [str(ROOT / "bench" / "acceptance_site"),
                                         c.env.get("PYTHONPATH")]))
    c.run(*tiny(c, "one-rank", 1), env={**c.env, ONE_RANK_SWITCH: "1", "PYTHONPATH": path,
                                        COUNT_COLLECTIVES: str(counts)})
    as_straight_run(c, c.work / "one-rank", c.work / "train-tp1")
    issued = collectives_counted(counts)
    # at least the step's agreement and token count a step, and the checkpoint's agreements
    c.within("one_rank_all_reduce", issued.get("all_reduce", 0), lo=2 * c.mode.steps)
    c.within("one_rank_all_gather_object", issued.get("all_gather_object", 0), lo=1)
    return f"{ONE_RANK_SWITCH}=1: {sum(issued.values())} collectives issued, the same run"


COUNT_COLLECTIVES = "DEL_COUNT_COLLECTIVES"  # bench/acceptance_site/sitecustomize.py's


def collectives_counted(directory: Path) -> dict[str, int]:
    """The counts every process of the command wrote at its exit, summed by collective."""
    total: dict[str, int] = {}
    for file in directory.glob("*.json"):
        for name, n in json.loads(file.read_text()).items():
            total[name] = total.get(name, 0) + n
    return total


def check_stop_resume(c: Check, tp: int) -> str:
    run = c.work / f"stop-resume-tp{tp}"
    stopped_at = stop_and_resume(c, run, tiny(c, run.name, tp))
    as_straight_run(c, run, c.work / f"train-tp{tp}")
    return f"SIGUSR1, exit 75 at step {stopped_at}, resumed to {c.mode.steps}"


def megatron(c: Check, run: str, procs: int = 1, *overrides: str) -> list[str]:
    """The tiny run on train.engine=megatron at TP 1 (on GPU megatron's distributed optimizer,
    bf16 with fp32 masters, overlapped reductions; on the CPU its FP32 optimizer); `procs`
    processes: data parallel, or pipeline stages with parallel.pipeline_parallel."""
    return tiny(c, run, 1, "train.engine=megatron", *overrides, procs=procs)


def against(c: Check, run: Path, reference: Path) -> None:
    """run, judged, against another layout's run of the same data from the same weights: step
    1's loss and gradient norm (the same weights and batch, forward and backward) within
    STEP1, every loss within LATER (the updates since), as the fused run's."""
    ours, theirs = metrics(run), metrics(reference)
    judge_run(c, ours)
    if sorted(theirs) != sorted(ours):
        raise Failed(f"{reference.name}'s metrics.jsonl has steps {sorted(theirs)[:4]}..., "
                     f"{run.name}'s {sorted(ours)[:4]}...")
    for key in ("loss", "grad_norm"):
        c.below(f"step1_{key}_rel_diff", relative(ours[1][key], theirs[1][key]), *STEP1)
    c.below("loss_max_rel_diff", loss_diff(ours, theirs), *LATER)


def check_megatron_engine(c: Check) -> str:
    """train.engine=megatron at TP 1 x PP 1 x DP 1, straight (the resume's and the pipeline
    rows' reference). Loose: every loss against the deepspeed engine's straight run
    (train-tp1) within ENGINES, the two engines rounding their reductions differently in bf16
    and megatron's optimizer decaying no bias or norm weight; what it catches is a wrong
    gradient scale or update, whose losses part by more."""
    run = c.work / "megatron-tp1"
    c.run(*megatron(c, run.name))
    judge_run(c, metrics(run))
    c.below("loss_max_rel_diff", loss_diff(metrics(run), metrics(c.work / "train-tp1")), *ENGINES)
    return "megatron's engine, as deepspeed's run"


def check_megatron_resume(c: Check, straight: str, procs: int) -> str:
    """The megatron engine's stop and resume against its own straight run of the same command
    (`straight`), bit for bit (bit_for_bit): SIGUSR1 at stop_at (exit 75: a checkpoint of
    the optimizer's ranges through the engine's adapter), then the same command resumes it.
    At DP 2 each rank's distributed-optimizer range is part of a bucket; at DP 1 a whole
    one (issue 50 finding 12)."""
    run = c.work / straight.replace("megatron-", "megatron-resume-")
    stopped_at = stop_and_resume(c, run, megatron(c, run.name, procs))
    bit_for_bit(c, run, c.work / straight)
    return f"exit 75 at step {stopped_at}, resumed to {c.mode.steps}: {straight}'s bit for bit"


def check_megatron_layout(c: Check, run: str, procs: int, *overrides: str) -> str:
    """The megatron engine at a layout of two ranks against its one-GPU run (megatron-tp1):
    the same data (one data-parallel rank, one loader worker), the same initial weights
    (built by global layer number at any split); bounds as the fused run's: step 1 within
    STEP1, every loss within LATER (in bf16 the stages' and the fused op's sums round in
    other orders). A stage fed the wrong batch, a gradient lost between stages or chunks, or
    the fused head's output weight read stale moves step 1's loss or gradient norm; a stage
    updated wrongly, the later losses."""
    c.run(*megatron(c, run, procs, *overrides))
    against(c, c.work / run, c.work / "megatron-tp1")
    return f"{' '.join(overrides)}: as megatron-tp1's run"


def check_megatron_dp2(c: Check) -> str:
    """The megatron engine at DP 2 (two ranks of TP 1: the distributed optimizer's gradients
    reduce-scattered and weights all-gathered over two ranges of a bucket; the tiny model's
    ~1M parameters are one bucket of megatron's 40M default) against DP 1 on the same data:
    one process with two loader workers reads the two loader slots that the two ranks read,
    batch i of a step from slot i (docs/data.md, "As many slots"), so a step sums the same
    two micro-batches. Bounds as check_megatron_layout's."""
    c.run(*megatron(c, "megatron-2workers", 1, "data.num_workers=2"))
    c.run(*megatron(c, "megatron-dp2", 2))
    against(c, c.work / "megatron-dp2", c.work / "megatron-2workers")
    return "DP 2 (distributed optimizer over two ranks): as DP 1 with two loader workers"


def stop_and_resume(c: Check, run: Path, command: list[str]) -> int:
    """`command` stopped by SIGUSR1 once it logged stop_at (exit 75, the step it stopped after
    saved), then run again (launch/torchrun.sh: --resume same) to the end; returns the step
    it stopped at."""

    def reached() -> bool:
        try:
            return max(metrics(run), default=0) >= c.mode.stop_at
        except (OSError, ValueError):  # not written yet, or a line half written
            return False

    c.run(*command, ok=(75,), stop_when=reached)  # launch/torchrun.sh: 75, stopped
    stopped_at = max(int(p.name[5:]) for p in (run / "checkpoints").glob("step-*"))
    c.within("stopped_at", stopped_at, c.mode.stop_at, c.mode.steps - 1)
    trained = max(metrics(run))  # the stop saves the step it stopped after, logged
    if trained != stopped_at:
        raise Failed(f"stopped with a checkpoint of step {stopped_at} after training and "
                     f"logging step {trained}")
    c.run(*command)  # the same command resumes (torchrun.sh: --resume same)
    return stopped_at


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


def bit_for_bit(c: Check, run: Path, straight: Path) -> None:
    """run (stopped and resumed), judged, against the straight run of the same command, on
    the GPU as on the CPU (train.deterministic): every step's loss and gradient norm equal,
    and the final checkpoint's weight and optimizer-state files byte for byte
    (docs/checkpoints.md: model/tpNN[-ppKK].safetensors, optim/tpNN[-ppKK]-dpMM.safetensors).
    A restored Adam state that is off moves the losses after the resume by ~6e-4 (docs/log.md,
    2026-12-04), inside any bf16 bound between two engines (2e-2 before: passed)."""
    ours, theirs = metrics(run), metrics(straight)
    judge_run(c, ours)
    if sorted(theirs) != sorted(ours):
        raise Failed(f"{straight.name}'s metrics.jsonl has steps {sorted(theirs)[:4]}..., "
                     f"{run.name}'s {sorted(ours)[:4]}...")
    c.figures["loss_max_rel_diff"] = loss_diff(ours, theirs)
    for step in sorted(ours):
        for key in ("loss", "grad_norm"):
            if ours[step][key] != theirs[step][key]:  # exact floats (metrics.jsonl)
                raise Failed(f"step {step}: {key} {ours[step][key]!r} in {run.name}, "
                             f"{theirs[step][key]!r} in {straight.name}: not bit for bit")
    final = f"checkpoints/step-{c.mode.steps:07d}"
    x, y = ({str(p.relative_to(d / final)): p for part in ("model", "optim")
             for p in sorted((d / final / part).glob("*.safetensors"))} for d in (run, straight))
    if x.keys() != y.keys() or not all(any(n.startswith(part) for n in x)
                                       for part in ("model/", "optim/")):
        raise Failed(f"the final checkpoints' weight and optimizer files differ: {sorted(x)} "
                     f"in {run.name}, {sorted(y)} in {straight.name}")
    c.figures["files_equal"] = len(x)
    for name in sorted(x):
        a, b = x[name].read_bytes(), y[name].read_bytes()
        if a != b:
            at = next((i for i, (u, v) in enumerate(zip(a, b, strict=False)) if u != v),
                      min(len(a), len(b)))  # or the shorter one's end
            raise Failed(f"{final}/{name} differs from {straight.name}'s at byte {at} "
                         f"({len(a)} and {len(b)} bytes)")


# What an import's logits may differ from transformers' (GPU: bf16 rounding through 4 layers;
# CPU: float32, where the two agree exactly here). A mix-up of q/k/v, of gate/up or of RoPE's
# layout moves them by 0.76 of their largest and more at the model's std 0.1 (by 1-3% at
# 0.02, near-uniform attention and a near-linear SwiGLU, within any bf16 bound).
IMPORT = (0.1, 1e-4)
IMPORTED = dict(vocab_size=1024, hidden_size=128, intermediate_size=352, num_hidden_layers=4,
                max_position_embeddings=256, rope_theta=1e4, rms_norm_eps=1e-5,
                initializer_range=0.1)  # tests/models/tiny_hf.py's 'qwen2-tied' at these


def check_init_hf(c: Check) -> str:
    """A tied Qwen-2 (std 0.1) imported as init.hf imports it: its logits against transformers'
    forward of the same directory on the same tokens (--probe-import); then init.hf -> 2
    steps -> del-convert: a tied export (no lm_head.weight stored)."""
    from safetensors.torch import load_file

    hf, run = c.work / "qwen2", c.work / "init-hf"
    c.run(sys.executable, "-c", "from tests.models.tiny_hf import tiny_hf_model; tiny_hf_model("
          f"'qwen2-tied', {str(hf)!r}, **{IMPORTED!r})")
    shutil.copy(c.work / "data/tokenizer.model", hf)
    found = json.loads(c.run(sys.executable, __file__, "--probe-import", str(hf),
                             c.mode.device).splitlines()[-1])
    c.figures["logit_scale"] = found["logit_scale"]
    c.below("import_logits_rel_diff", found["logits_max_rel_diff"], *IMPORT)
    c.run(*tiny(c, run.name, 1, "train.steps=2", "data.tokenizer=null", f"init.hf={hf}",
                "model.family=qwen2", "model.qkv_bias=true", "model.tie_word_embeddings=true",
                "eval.sources=[]", data=False))
    export = c.work / "init-hf-export"
    c.run(sys.executable, "-m", "del_megatron.cli.convert", "megatron-to-hf", "--checkpoint",
          str(run / "checkpoints/step-0000002"), "--out", str(export))
    stored = [name for file in export.glob("*.safetensors") for name in load_file(file)]
    tied = json.loads((export / "config.json").read_text()).get("tie_word_embeddings")
    if not tied or "lm_head.weight" in stored:
        raise Failed(f"export: tie_word_embeddings {tied}, lm_head.weight stored")
    return "its import's logits are transformers'; a tied export"


def probe_import(hf: Path, device: str) -> dict:
    """(In a child.) The Hugging Face directory `hf` imported into our megatron model as init.hf
    imports it (open_hf, the build, load_hf), its logits on fixed tokens against
    transformers' forward of the same directory: the largest difference over the largest
    logit."""
    import torch
    import transformers

    from del_megatron import DigitVocab, NumericLossConfig
    from del_megatron.models.conversion import open_hf
    from del_megatron.models.spec import model_dtype
    from del_megatron.parallel import init_distributed, init_model_parallel
    from del_megatron.runtime import select_accelerator

    dev = torch.device(device)
    select_accelerator(dev)
    from del_megatron.models.llama import build_llama
    from del_megatron.models.weights import load_hf

    init_distributed(dev, 10)
    init_model_parallel(1, 10)
    checkpoint, arch = open_hf(hf, divisible_by=64)
    vocab = DigitVocab(digit_ids=list(range(10, 20)), point_ids=[5], vocab_size=arch.vocab_size)
    ours = build_llama(arch, vocab, NumericLossConfig(kind="mle"), dev, seed=0,
                       weights_follow=True)
    load_hf(ours, checkpoint, arch)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=model_dtype(dev))
    tokens = torch.randint(0, arch.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    tokens = tokens.to(dev)
    positions = torch.arange(tokens.shape[1], device=dev).expand_as(tokens)
    with torch.no_grad():
        a = ours.eval()(tokens, positions, None)[..., : arch.vocab_size].float()
        b = theirs.to(dev).eval()(tokens).logits.float()
    scale = b.abs().max().item()
    return {"logits_max_rel_diff": (a - b).abs().max().item() / scale, "logit_scale": scale}


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
    """A training step of a 4-layer model at 7B widths: DEL over MLE, tokens/s, MFU. The
    trainer's tokens/s (from its step time) must be the bench's (from a timer synchronised
    around each step): a step time that did not wait for the device inflates it, and MFU with
    it."""
    rows = c.run(sys.executable, *c.pick(
        "bench/train_step.py --gpu-7b --steps 6",
        "-m torch.distributed.run --standalone --nproc-per-node=2 bench/train_step.py --steps 1",
    ).split(), pattern=rf"^(mle|del) +{NUMBER} +{NUMBER}x +{NUMBER} +{NUMBER} +{NUMBER} +"
                       rf"{NUMBER} +{NUMBER}\s*$")  # ms, ratio, tokens/s x2, TFLOP/s, MFU, numeric
    rows = {kind: [float(v) for v in values] for kind, *values in rows}
    if set(rows) != {"mle", "del"}:
        raise Failed("bench/train_step.py printed no 'mle' and 'del' rows")
    if not (math.isnan(rows["mle"][6]) and rows["del"][6] > 0):  # MLE has no numeric term
        raise Failed(f"bench/train_step.py: numeric term {rows['mle'][6]} (mle), "
                     f"{rows['del'][6]} (del): the two variants ran the same loss")
    c.below("del_over_mle", rows["del"][0] / rows["mle"][0], 1.03, 3)
    c.within("tokens_per_s_del", rows["del"][2], lo=1)
    # the bench's time also holds making the step's batches on the host: the trainer's may be
    # a little faster, never several times (CPU: two shared cores, only a broken wiring)
    lo, hi = c.pick((0.9, 1.25), (0.3, 3.0))
    c.within("trainer_over_timed_tokens_per_s", rows["del"][3] / rows["del"][2], lo, hi)
    if c.mode.device == "cuda":  # a floor (host syncs, fp32 math); no CPU peak to judge
        if math.isnan(rows["del"][5]):
            raise Failed("no MFU: this GPU's name (the env row's gpu) is not in "
                         "del_megatron/runtime.py's PEAK_FLOPS")
        c.within("mfu_del", rows["del"][5], 0.20, 1)


def check_bench_engines(c: Check) -> None:
    """Both engines' training step on bench-train-step's model (kind del), one process from
    one seed on the same batches, ABBA (bench/train_step.py --engines): each engine's tokens/s
    (synchronised timer) and the trainer's, TFLOP/s and MFU (the trainer's: Megatron-LM's
    count over the GPU's bf16 peak, docs/benchmarks.md "MFU: the formula"). Bounds, GPU:
    each MFU in [0.20, 1], bench-train-step's floor for this model (below it the step spends
    its time outside the matmuls: host syncs, float32 math), above 1 a step time that did not
    wait for the device or a wrong peak; megatron's tokens/s at least 0.8 of deepspeed's (the
    same model's same step on one GPU: a fifth slower is the engine's own overhead, a host
    read or an unoverlapped reduction); each trainer's tokens/s within 0.9-1.25 of the
    timer's, as bench-train-step's; the two runs' last losses within ENGINES (they ran the
    same steps). CPU: only a broken wiring fails (no peak: no MFU)."""
    # a row: engine, step ms, ratio, tokens/s (timed), tokens/s (trainer), TFLOP/s, MFU, loss
    rows = c.run(sys.executable, *c.pick(
        "bench/train_step.py --gpu-7b --engines --steps 6",
        "-m torch.distributed.run --standalone --nproc-per-node=2 bench/train_step.py --engines "
        "--steps 1",
    ).split(), pattern=rf"^(deepspeed|megatron) +{NUMBER} +{NUMBER}x +{NUMBER} +{NUMBER} +"
                       rf"{NUMBER} +{NUMBER} +{NUMBER}\s*$")
    rows = {engine: [float(v) for v in values] for engine, *values in rows}
    if set(rows) != {"deepspeed", "megatron"}:
        raise Failed("bench/train_step.py --engines printed no 'deepspeed' and 'megatron' rows")
    lo, hi = c.pick((0.9, 1.25), (0.3, 3.0))
    for engine, (_, _, timed, trainer, tflops, _, _) in rows.items():
        c.within(f"tokens_per_s_{engine}", timed, lo=1)
        c.within(f"trainer_over_timed_tokens_per_s_{engine}", trainer / timed, lo, hi)
        c.figures[f"tflops_{engine}"] = tflops
    c.within("megatron_over_deepspeed_tokens_per_s", rows["megatron"][2] / rows["deepspeed"][2],
             *c.pick((0.8, math.inf), (0.3, 3.0)))
    c.below("loss_rel_diff", relative(rows["megatron"][6], rows["deepspeed"][6]), *ENGINES)
    if c.mode.device == "cuda":
        for engine in ("deepspeed", "megatron"):
            if math.isnan(rows[engine][5]):
                raise Failed(f"no MFU for the {engine} engine: " + (
                    "this GPU's name (the env row's gpu) is not in del_megatron/runtime.py's "
                    "PEAK_FLOPS" if all(math.isnan(r[5]) for r in rows.values()) else
                    "the trainer reported none for its steps"))
            c.within(f"mfu_{engine}", rows[engine][5], 0.20, 1)
        c.figures["megatron_over_deepspeed_mfu"] = rows["megatron"][5] / rows["deepspeed"][5]


# name, function, estimate on one H200 (s), time limit (s); a row of two ranks needs 2 GPUs
# (gpus_needed). Not measured yet: ~15 s to import megatron-core and DeepSpeed, ~1 min for
# the first compile.
PLAN = [
    ("install", check_install, 10, 120),
    ("env", check_env, 20, 180),  # and DeepSpeed's engines at ZeRO 1, 2, 3
    ("deepspeed-config", check_deepspeed_config, 1, 10),  # reads env's engines
    ("data", check_data, 15, 180),
    ("train-tp1", lambda c: check_train(c, 1, False), 90, 300),  # the first step compiles
    ("train-fused-tp1", lambda c: check_train(c, 1, True), 35, 180),
    ("one-rank-collectives", check_one_rank_collectives, 30, 180),
    # the megatron engine straight, then its stop and resume against that bit for bit (the
    # deepspeed engine's stop and resume: at TP 2, on two GPUs; the CPU suite checks both)
    ("megatron-tp1", check_megatron_engine, 30, 180),
    ("megatron-resume-tp1", lambda c: check_megatron_resume(c, "megatron-tp1", 1), 60, 300),
    ("train-tp2", lambda c: check_train(c, 2, False), 40, 240),
    ("train-fused-tp2", lambda c: check_train(c, 2, True), 40, 240),
    ("stop-resume-tp2", lambda c: check_stop_resume(c, 2), 70, 300),
    # the megatron engine at two ranks (issue 50 finding 12): two pipeline stages (1F1B);
    # two stages of two virtual chunks each (interleaved) with the fused head on the last;
    # two data-parallel ranks (and its DP 1 reference), then their stop and resume
    ("megatron-pp2", lambda c: check_megatron_layout(
        c, "megatron-pp2", 2, "parallel.pipeline_parallel=2"), 40, 240),
    ("megatron-fused-vpp2", lambda c: check_megatron_layout(
        c, "megatron-fused-vpp2", 2, "parallel.pipeline_parallel=2",
        "parallel.virtual_pipeline_parallel=2", "loss.fused_output=true"), 40, 240),
    ("megatron-dp2", check_megatron_dp2, 70, 420),  # two runs
    ("megatron-resume-dp2", lambda c: check_megatron_resume(c, "megatron-dp2", 2), 70, 300),
    ("init-hf", check_init_hf, 50, 240),
    ("del-eval", lambda c: evaluate_with_export(c, c.work / "train-tp1/checkpoints" /
                                                 f"step-{c.mode.steps:07d}", "eval"), 40, 240),
    ("bench-hook-ce", check_bench_hook, 20, 120),
    ("bench-fused", check_bench_fused, 55, 240),  # five processes
    ("bench-train-step", check_bench_train_step, 50, 240),
    ("bench-engines", check_bench_engines, 45, 240),  # two setups in one process
]
BLOCKING = ("install", "env")  # when one fails, the later checks are skipped


def gpus_needed(name: str) -> int:
    """A row named for a layout of two ranks (-tp2, -pp2, -vpp2, -dp2) runs one per GPU."""
    return 2 if re.search(r"-(tp|pp|vpp|dp)2$", name) else 1


def plan_for(gpus: int) -> list[tuple]:
    """The rows that run with `gpus` GPUs (run_plan skips the others, saying why)."""
    return [check for check in PLAN if gpus_needed(check[0]) <= gpus]


def run_plan(plan: list[tuple], mode: Mode, work: Path, env: dict, record=print,
             gpus: int = 1) -> list[dict]:
    """The checks in order; record(rows) after each (a run cut short keeps its rows)."""
    rows, blocked = [], None
    for i, (name, function, estimate, limit) in enumerate(plan, 1):
        print(f"[{i:2d}/{len(plan)}] {name:21s} ~{estimate:3d} s  ", end="", flush=True)
        c = Check(name, mode, work, env, time.monotonic() + limit * mode.slowdown, gpus)
        start, needed = time.monotonic(), gpus_needed(name)
        try:
            if blocked:
                status, note = "skipped", f"the {blocked} check failed"
            elif needed > gpus:  # said in its row: not checked here, not passed
                status, note = "skipped", f"needs {needed} GPUs, {gpus} here"
            else:
                status, note = "pass", function(c) or ""
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
    parser.add_argument("--probe-import", nargs=2, metavar=("HF", "DEVICE"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe_env:  # check_env's input, in a child
        print(json.dumps(probe_env(args.probe_env)))
        return 0
    if args.probe_import:  # check_init_hf's, in a child
        print(json.dumps(probe_import(Path(args.probe_import[0]), args.probe_import[1])))
        return 0
    mode = CPU if args.cpu_smoke else GPU
    gpus = 1 if args.cpu_smoke or args.plan else usable_gpus()
    plan = plan_for(gpus)
    estimate = sum(check[2] for check in plan)
    skipped = f" ({len(PLAN) - len(plan)} of two ranks skipped)" if len(plan) < len(PLAN) else ""
    print(f"gpu_acceptance: {'CPU smoke' if args.cpu_smoke else f'{gpus} GPU(s)'}, "
          f"{len(plan)} checks{skipped}, estimate {estimate} s on H200s (budget {BUDGET_S} s "
          "on one)")
    if args.plan:  # PLAN's every check, those of two or more GPUs marked
        for check in PLAN:
            print(f"  {check[0]:21s} ~{check[2]:3d} s, limit {check[3] * mode.slowdown} s"
                  + ("" if check in plan else " (2+ GPUs)"))
        print(f"two or more GPUs: {len(plan_for(2))} checks, estimate "
              f"{sum(check[2] for check in plan_for(2))} s (the budget is the one-GPU plan's)")
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

    rows = run_plan(PLAN, mode, work, env, record, gpus)  # the 2-GPU rows skipped on one
    print(f"\n{table(rows)}\nwall {round(time.monotonic() - started)} s (estimate {estimate} "
          f"s); work directory {work}; results: {out / 'gpu_acceptance.json'}")
    return 1 if any(r["status"] == "fail" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
