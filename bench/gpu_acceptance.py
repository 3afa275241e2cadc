"""The logic of bench/gpu_acceptance.sh that is more than a few lines of shell.

    python bench/gpu_acceptance.py SUBCOMMAND ...   (see --help of each)

Checks write a notes file (JSON: status, note, figures) that `record` folds into a row of
results.jsonl; `table` prints the rows and writes them as one JSON document. The rest reads
what the project's own commands wrote (metrics.jsonl, checkpoints, del-eval results, a
benchmark's console output) or builds an input (a tiny random Qwen-2). Nothing here trains,
converts or evaluates: del-train, del-convert, del-eval and the bench/ scripts do that.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path
from typing import Any

STATUSES = ("pass", "fail", "skipped")


# ---- rows, the table, the JSON ------------------------------------------------------------


def write_notes(path: Path | None, status: str, note: str, figures: dict | None = None) -> int:
    """A check's verdict for `record`; prints it too. Returns the exit status (1: fail)."""
    notes = {"status": status, "note": note, "figures": figures or {}}
    if path is not None:
        path.write_text(json.dumps(notes) + "\n")
    print(f"{status}: {note}")
    return 1 if status == "fail" else 0


def failure_line(log: str) -> str:
    """The line that says why a command failed: the last naming an error, else the last."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for line in reversed(lines):
        if re.search(r"error|Error|ERROR|exception|Exception", line):
            return line
    return lines[-1] if lines else "no output"


def make_row(
    name: str,
    *,
    rc: int | None,
    seconds: float | None,
    notes: dict | None,
    log: str = "",
    skipped: str | None = None,
) -> dict[str, Any]:
    """One check's row. A non-zero exit status fails it whatever its notes say; 124/137 is
    `timeout`'s (the check ran past its limit)."""
    if skipped is not None:
        return {"name": name, "status": "skipped", "seconds": None, "note": skipped, "figures": {}}
    notes = notes or {}
    figures = notes.get("figures", {})
    if rc in (124, 137):
        status, note = "fail", f"ran past its time limit ({failure_line(log)})"
    elif rc:
        status = "fail"
        note = notes.get("note") if notes.get("status") == "fail" else None
        note = note or f"exit {rc}: {failure_line(log)}"
    else:
        status = notes.get("status", "pass")
        note = notes.get("note", "")
    if status not in STATUSES:
        status, note = "fail", f"unknown status {status!r}: {note}"
    return {
        "name": name,
        "status": status,
        "seconds": None if seconds is None else round(seconds, 1),
        "note": note,
        "figures": figures,
    }


def format_figure(value: Any) -> str:
    if isinstance(value, float):
        if value != value or value in (math.inf, -math.inf):
            return str(value)
        return f"{value:.4g}"
    return str(value)


def render_table(rows: list[dict], width: int = 110) -> str:
    """check | status | seconds | note and figures, one row a check (the note wraps)."""
    name_w = max([len("check"), *(len(r["name"]) for r in rows)])
    head = f"{'check':{name_w}s}  {'status':7s}  {'s':>6s}  note / figures"
    lines = [head, "-" * len(head)]
    for row in rows:
        seconds = "" if row["seconds"] is None else f"{row['seconds']:.1f}"
        text = row["note"]
        if row["figures"]:
            figures = ", ".join(f"{k}={format_figure(v)}" for k, v in row["figures"].items())
            text = f"{text}; {figures}" if text else figures
        indent = name_w + 2 + 7 + 2 + 6 + 2
        chunks = _wrap(text, max(30, width - indent))
        lines.append(f"{row['name']:{name_w}s}  {row['status']:7s}  {seconds:>6s}  {chunks[0]}")
        lines.extend(" " * indent + chunk for chunk in chunks[1:])
    counts = {s: sum(r["status"] == s for r in rows) for s in STATUSES}
    lines.append("-" * len(head))
    lines.append(f"{counts['pass']} passed, {counts['fail']} failed, {counts['skipped']} skipped")
    return "\n".join(lines)


def _wrap(text: str, width: int) -> list[str]:
    words, chunks, current = text.split(" "), [], ""
    for word in words:
        if current and len(current) + 1 + len(word) > width:
            chunks.append(current)
            current = word
        else:
            current = f"{current} {word}" if current else word
    chunks.append(current)
    return chunks


def summary(rows: list[dict], meta: dict) -> dict:
    counts = {s: sum(r["status"] == s for r in rows) for s in STATUSES}
    return {
        **meta,
        "passed": counts["pass"],
        "failed": counts["fail"],
        "skipped": counts["skipped"],
        "checks": rows,
    }


# ---- weights and losses of two runs ---------------------------------------------------------


def compare_weights(a: Path, b: Path) -> dict[str, Any]:
    """Every tensor of a's model/tp*.safetensors against b's: the same files, names and
    shapes, and the largest absolute difference (float32). `bit_equal`: every byte equal."""
    import torch
    from safetensors.torch import load_file

    files_a = sorted(p.name for p in (a / "model").glob("tp*.safetensors"))
    files_b = sorted(p.name for p in (b / "model").glob("tp*.safetensors"))
    if not files_a or files_a != files_b:
        raise ValueError(f"weight files differ: {a}/model {files_a} vs {b}/model {files_b}")
    max_diff, bit_equal, tensors = 0.0, True, 0
    for name in files_a:
        ta, tb = load_file(a / "model" / name), load_file(b / "model" / name)
        if ta.keys() != tb.keys():
            raise ValueError(f"{name}: tensor names differ: {sorted(ta.keys() ^ tb.keys())}")
        for key, x in ta.items():
            y = tb[key]
            if x.shape != y.shape or x.dtype != y.dtype:
                raise ValueError(
                    f"{name}:{key}: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}"
                )
            tensors += 1
            if not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
                bit_equal = False
                max_diff = max(max_diff, (x.float() - y.float()).abs().max().item())
    return {"bit_equal": bit_equal, "max_abs_diff": max_diff, "tensors": tensors}


def read_losses(run: Path) -> dict[int, float]:
    """step -> loss from a run's metrics.jsonl (the trainer writes one line a step)."""
    losses = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            losses[int(record["step"])] = float(record["loss"])
    return losses


def compare_losses(a: dict[int, float], b: dict[int, float], steps) -> float:
    """Largest |a - b| over `steps` (every one must be in both)."""
    missing = [s for s in steps if s not in a or s not in b]
    if missing:
        raise ValueError(f"steps missing from metrics.jsonl: {missing[:5]}")
    return max((abs(a[s] - b[s]) for s in steps), default=0.0)


def checkpoint_dir(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step-{step:07d}"


def cmd_compare_runs(args) -> int:
    """The stopped-and-resumed run against the straight one."""
    straight, resumed = Path(args.straight), Path(args.resumed)
    try:
        weights = compare_weights(
            checkpoint_dir(straight, args.steps), checkpoint_dir(resumed, args.steps)
        )
        a, b = read_losses(straight), read_losses(resumed)
        after = range(args.stopped_at + 1, args.steps + 1)
        loss_after = compare_losses(a, b, after)
        loss_all = compare_losses(a, b, range(1, args.steps + 1))
    except (OSError, ValueError, KeyError) as err:
        return write_notes(args.notes, "fail", str(err))
    figures = {
        "stopped_at": args.stopped_at,
        "weights_max_abs_diff": weights["max_abs_diff"],
        "loss_max_abs_diff_after_resume": loss_after,
    }
    where = f"stopped at step {args.stopped_at}, resumed to {args.steps}"
    if weights["bit_equal"] and loss_all == 0.0:
        return write_notes(
            args.notes,
            "pass",
            f"{where}: weights and every step's loss bit-equal to the straight run",
            figures,
        )
    within = weights["max_abs_diff"] <= args.weights_tol and loss_all <= args.loss_tol
    status = "pass" if within else "fail"
    note = (
        f"{where}: not bit-equal: max diff {weights['max_abs_diff']:.3g} (weights), "
        f"{loss_all:.3g} (loss); tolerance {args.weights_tol:g} / {args.loss_tol:g}"
    )
    return write_notes(args.notes, status, note, figures)


def cmd_train_figures(args) -> int:
    """A training run: every step logged, finite, the loss fell, the final checkpoint there;
    with --reference, step 1 (before any update: the same weights and batch) against it."""
    run = Path(args.run)
    try:
        losses = read_losses(run)
        records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
    except (OSError, ValueError, KeyError) as err:
        return write_notes(args.notes, "fail", f"metrics.jsonl: {err}")
    steps = list(range(1, args.steps + 1))
    if sorted(losses) != steps:
        return write_notes(
            args.notes,
            "fail",
            f"metrics.jsonl has steps {sorted(losses)[:3]}..., expected 1..{args.steps}",
        )
    if not checkpoint_dir(run, args.steps).is_dir():
        return write_notes(args.notes, "fail", f"no checkpoint {checkpoint_dir(run, args.steps)}")
    if not all(math.isfinite(v) for v in losses.values()):
        return write_notes(args.notes, "fail", "non-finite loss")
    first, last = losses[1], losses[args.steps]
    figures: dict[str, Any] = {"loss_step1": first, f"loss_step{args.steps}": last}
    timed = records[2:] or records  # the first steps include compilation and warm-up
    for key, name in (("tokens_per_s", "tokens_per_s"), ("tflops", "tflops"), ("mfu", "mfu")):
        values = [float(r[key]) for r in timed if key in r]
        if values:
            figures[name] = statistics.median(values)
    if not last < first:
        return write_notes(
            args.notes, "fail", f"the loss did not fall ({first:.4f} -> {last:.4f})", figures
        )
    note = f"{args.steps} steps, loss {first:.3f} -> {last:.3f}"
    if args.reference:
        try:
            ref = read_losses(Path(args.reference))[1]
        except (OSError, ValueError, KeyError) as err:
            return write_notes(args.notes, "fail", f"reference {args.reference}: {err}", figures)
        rel = abs(first - ref) / max(1.0, abs(ref))
        figures["step1_rel_diff_vs_reference"] = rel
        if rel > args.tol:
            return write_notes(
                args.notes,
                "fail",
                f"{note}; step-1 loss {first:.6f} vs "
                f"{ref:.6f} of {args.reference} (beyond {args.tol:g})",
                figures,
            )
        note += f"; step-1 loss within {args.tol:g} of the unfused run's"
    return write_notes(args.notes, "pass", note, figures)


# ---- the Hugging Face round trip ------------------------------------------------------------


def cmd_tiny_qwen2(args) -> int:
    """A random Qwen2ForCausalLM with tied embeddings in the tiny config's shape (so the run
    config's model section matches it with family/qkv_bias/tie overrides), saved by the
    installed transformers with the run's sentencepiece tokenizer beside it."""
    import shutil

    import torch
    import transformers

    out = Path(args.out)
    config = transformers.Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).float().eval()
    with torch.no_grad():  # non-trivial norms and biases, so a dropped one shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(out)
    shutil.copy(args.tokenizer, out / "tokenizer.model")
    print(f"tiny Qwen-2 (tied embeddings, V={args.vocab}) -> {out}")
    return 0


def tied_export(directory: Path) -> tuple[bool, str]:
    """Whether a Hugging Face export declares tied embeddings and stores no separate head."""
    from safetensors import safe_open

    config = json.loads((directory / "config.json").read_text())
    names = set()
    for file in directory.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            names.update(f.keys())
    if not config.get("tie_word_embeddings"):
        return False, "config.json: tie_word_embeddings is not true"
    if "lm_head.weight" in names:
        return False, "lm_head.weight stored beside tied embeddings"
    return True, "tied"


def logits_difference(a, b) -> dict[str, float]:
    """Largest and mean |a - b| of two logits tensors, the largest |a| and the share of
    positions whose top token agrees."""
    diff = (a.float() - b.float()).abs()
    return {
        "max_abs_diff": diff.max().item(),
        "mean_abs_diff": diff.mean().item(),
        "max_abs_logit": a.float().abs().max().item(),
        "argmax_agree": (a.argmax(-1) == b.argmax(-1)).float().mean().item(),
    }


def cmd_logits(args) -> int:
    """Logits of the del-convert export (transformers) against the checkpoint (megatron-core),
    both loaded by del-eval's loader, on the same random token windows."""
    import torch

    from del_megatron.evaluation.backends import load_model
    from del_megatron.models.device import resolve_device

    export = Path(args.hf)
    tied, why = tied_export(export)
    if not tied:
        return write_notes(args.notes, "fail", f"{export}: {why}")
    device = resolve_device(args.device)
    checkpoint = load_model(Path(args.checkpoint), device)
    hf = load_model(export, device)
    if (checkpoint.kind, hf.kind) != ("checkpoint", "hf"):  # megatron-core vs transformers
        return write_notes(args.notes, "fail", f"loaded as {checkpoint.kind} and {hf.kind}")
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, checkpoint.tokenizer.vocab_size, (2, args.seq_len), generator=gen)
    with torch.no_grad():
        ours, theirs = checkpoint.forward(tokens).cpu(), hf.forward(tokens).cpu()
    if ours.shape != theirs.shape:
        return write_notes(args.notes, "fail", f"logits {list(ours.shape)} vs {list(theirs.shape)}")
    figures = logits_difference(ours, theirs)
    bound = args.tol * max(1.0, figures["max_abs_logit"])
    status = "pass" if figures["max_abs_diff"] <= bound else "fail"
    note = (
        f"tied export; transformers vs checkpoint logits: max |diff| "
        f"{figures['max_abs_diff']:.3g} (bound {args.tol:g} x max(1, max|logit|) = {bound:.3g})"
    )
    return write_notes(args.notes, status, note, figures)


SMOOTH_METRICS = ("loss", "digit_entropy")


def eval_agreement(ours: dict, theirs: dict, tol: float) -> tuple[list[str], dict[str, float]]:
    """del-eval's teacher-forced metrics of a checkpoint and of its export: the smooth ones
    (mean loss, mean digit entropy) must agree within `tol` relative to max(1, |value|), as
    del-eval compare --agree-within measures. Counts of argmax hits and the number errors
    built from them are reported, not judged: in bf16 a near-tie flips between two
    implementations, and one flipped leading digit moves a mean absolute error a lot."""
    beyond, figures = [], {}
    for key in (*SMOOTH_METRICS, "digit_acc", "number_abs_error"):
        a, b = ours.get(key), theirs.get(key)
        if not isinstance(a, int | float) or not isinstance(b, int | float):
            beyond.append(f"{key} missing")
            continue
        figures[key] = a
        figures[f"{key}_diff"] = abs(a - b)
        if key in SMOOTH_METRICS and abs(a - b) > tol * max(1.0, abs(a)):
            beyond.append(f"{key} {a:.6g} vs {b:.6g}")
    return beyond, figures


def cmd_eval_figures(args) -> int:
    """del-eval's results of the checkpoint against those of its export."""
    try:
        ours, theirs = (
            json.loads((Path(d) / "results.json").read_text())["numeric"]
            for d in (args.checkpoint, args.hf)
        )
    except (OSError, ValueError, KeyError) as err:
        return write_notes(args.notes, "fail", f"del-eval results: {err}")
    beyond, figures = eval_agreement(ours, theirs, args.tol)
    if beyond:
        note = f"checkpoint and export differ beyond {args.tol:g}: " + "; ".join(beyond)
        return write_notes(args.notes, "fail", note, figures)
    note = f"checkpoint and export: loss and digit entropy agree within {args.tol:g}"
    return write_notes(args.notes, "pass", note, figures)


# ---- environment and benchmark output -------------------------------------------------------


def cmd_env(args) -> int:
    """Versions, the GPUs, DeepSpeed's accelerator, Transformer Engine and where CUDA's
    compiler is (recorded; del-train compiles nothing: its optimizer is torch's AdamW)."""
    import importlib

    figures: dict[str, Any] = {}
    problems = []
    for module in ("torch", "transformers", "megatron.core", "deepspeed", "pydantic", "webdataset"):
        try:
            figures[module.split(".")[0]] = importlib.import_module(module).__version__
        except Exception as err:  # any import failure is this check's finding
            problems.append(f"{module}: {type(err).__name__}: {err}")
    if problems:
        return write_notes(args.notes, "fail", "; ".join(problems), figures)
    import torch

    if args.mode == "gpu":
        figures["gpus"] = torch.cuda.device_count()
        figures["gpu"] = torch.cuda.get_device_name(0)
        figures["cuda"] = torch.version.cuda
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()._name
        figures["deepspeed_accelerator"] = accelerator
        if accelerator != "cuda":
            return write_notes(
                args.notes, "fail", f"DeepSpeed picked {accelerator}, not cuda", figures
            )
        from torch.utils.cpp_extension import CUDA_HOME

        # for the record only: del-train steps with torch's AdamW, so nothing is compiled
        figures["nvcc"] = CUDA_HOME or "missing"
    return write_notes(args.notes, "pass", "imports and devices as listed", figures)


def cmd_transformer_engine(args) -> int:
    try:
        import transformer_engine
    except Exception:  # not installed, or installed without its CUDA libraries
        return write_notes(
            args.notes,
            "skipped",
            "Transformer Engine not installed: "
            "megatron-core's local layers run instead (fused softmax/rope off)",
        )
    version = getattr(transformer_engine, "__version__", "?")
    return write_notes(args.notes, "pass", f"installed {version}: its layer spec is used")


_NUMBER = r"([-+0-9.eE]+|nan|inf)"


def bench_figures(kind: str, text: str) -> dict[str, float]:
    """The figures of a benchmark's console output ({} when its format is not recognised)."""
    figures: dict[str, float] = {}
    if kind == "hook-ce":
        m = re.search(rf"^hook / .*?: time {_NUMBER}x, peak {_NUMBER}x .*?, {_NUMBER}x", text, re.M)
        if m:
            figures.update(
                hook_over_megatron_time=float(m[1]),
                hook_over_megatron_peak=float(m[2]),
                hook_over_megatron_peak_logits_kept=float(m[3]),
            )
        for m in re.finditer(
            rf"^(megatron fused CE|megatron CE|hook \(kind=del\))\s+{_NUMBER}", text, re.M
        ):
            figures["hook_ms" if m[1].startswith("hook") else "megatron_ms"] = float(m[2])
    elif kind == "fused":
        m = re.search(rf"^fused / megatron: time {_NUMBER}x, peak memory {_NUMBER}x", text, re.M)
        if m:
            figures.update(
                fused_over_megatron_time=float(m[1]), fused_over_megatron_peak=float(m[2])
            )
        for m in re.finditer(
            rf"^chunk\s+(\d+): time {_NUMBER}x, peak .*?\({_NUMBER}x\)", text, re.M
        ):
            figures[f"chunk{m[1]}_time"] = float(m[2])
            figures[f"chunk{m[1]}_peak"] = float(m[3])
    elif kind == "train-step":
        rows = {}
        pattern = rf"^(mle|del)\s+{_NUMBER}\s+{_NUMBER}x\s+{_NUMBER}\s+{_NUMBER}\s+{_NUMBER}\s*$"
        for m in re.finditer(pattern, text, re.M):
            rows[m[1]] = [float(m[i]) for i in range(2, 7)]
        if "del" in rows and "mle" in rows:
            figures.update(
                del_over_mle=rows["del"][0] / rows["mle"][0],
                step_ms_del=rows["del"][0],
                step_ms_mle=rows["mle"][0],
                tokens_per_s_del=rows["del"][2],
                tokens_per_s_mle=rows["mle"][2],
                tflops_del=rows["del"][3],
                mfu_del=rows["del"][4],
            )
    else:
        raise ValueError(f"unknown benchmark kind {kind}")
    return figures


def cmd_bench_figures(args) -> int:
    text = Path(args.log).read_text(errors="replace")
    figures = bench_figures(args.kind, text)
    if figures:
        return write_notes(args.notes, "pass", "", figures)
    last = [line for line in text.splitlines() if line.strip()]
    note = "ran; figures not recognised (see the log): " + (last[-1] if last else "no output")
    return write_notes(args.notes, "pass", note)


# ---- record and table -----------------------------------------------------------------------


def cmd_record(args) -> int:
    notes = None
    if args.notes and Path(args.notes).is_file():
        try:
            notes = json.loads(Path(args.notes).read_text())
        except ValueError:
            notes = None
    log = (
        Path(args.log).read_text(errors="replace") if args.log and Path(args.log).is_file() else ""
    )
    row = make_row(
        args.name, rc=args.rc, seconds=args.seconds, notes=notes, log=log, skipped=args.skipped
    )
    with open(args.results, "a") as f:
        f.write(json.dumps(row) + "\n")
    return 0


def cmd_table(args) -> int:
    path = Path(args.results)
    rows = (
        [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        if path.is_file()
        else []
    )
    meta = json.loads(args.meta) if args.meta else {}
    print(render_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(summary(rows, meta), indent=1) + "\n")
    return 1 if any(r["status"] == "fail" for r in rows) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name, func, help_text):
        p = sub.add_parser(name, help=help_text)
        p.set_defaults(func=func)
        return p

    p = command("record", cmd_record, "append one check's row to results.jsonl")
    p.add_argument("results")
    p.add_argument("--name", required=True)
    p.add_argument("--rc", type=int)
    p.add_argument("--seconds", type=float)
    p.add_argument("--notes")
    p.add_argument("--log")
    p.add_argument("--skipped", metavar="REASON")
    p = command("table", cmd_table, "print the table; write the JSON; exit 1 if a check failed")
    p.add_argument("results")
    p.add_argument("--json")
    p.add_argument("--meta", help="JSON object of run-wide fields")
    p = command("env", cmd_env, "versions, GPUs, DeepSpeed's accelerator")
    p.add_argument("--mode", choices=["gpu", "cpu-smoke"], required=True)
    p = command("transformer-engine", cmd_transformer_engine, "is Transformer Engine there")
    p = command("train-figures", cmd_train_figures, "check a training run's metrics")
    p.add_argument("run")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--reference", help="a run whose step-1 loss this one's must match")
    p.add_argument("--tol", type=float, default=0.0)
    p = command("compare-runs", cmd_compare_runs, "a stopped+resumed run against a straight one")
    p.add_argument("straight")
    p.add_argument("resumed")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--stopped-at", type=int, required=True)
    p.add_argument("--weights-tol", type=float, default=0.0)
    p.add_argument("--loss-tol", type=float, default=0.0)
    p = command("tiny-qwen2", cmd_tiny_qwen2, "save a tiny random tied Qwen-2 model")
    p.add_argument("out")
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--vocab", type=int, default=1024)
    p = command("logits", cmd_logits, "export's transformers logits against the checkpoint's")
    p.add_argument("checkpoint")
    p.add_argument("hf")
    p.add_argument("--device", default="auto")
    p.add_argument("--tol", type=float, required=True)
    p.add_argument("--seq-len", type=int, default=64)
    p = command("eval-figures", cmd_eval_figures, "del-eval results: checkpoint vs export")
    p.add_argument("checkpoint", help="del-eval --out of the checkpoint")
    p.add_argument("hf", help="del-eval --out of its export")
    p.add_argument("--tol", type=float, required=True)
    p = command("bench-figures", cmd_bench_figures, "figures of a benchmark's output")
    p.add_argument("kind", choices=["hook-ce", "fused", "train-step"])
    p.add_argument("log")
    for p in sub.choices.values():
        if p.prog.split()[-1] not in ("record", "table"):
            p.add_argument("--notes", type=Path, help="write the verdict here (JSON)")
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
