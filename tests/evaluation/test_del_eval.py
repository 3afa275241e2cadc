"""del-eval end to end on a tiny trained checkpoint and on its Hugging Face export: the same
teacher-forced metrics within 1e-4 (megatron-core and transformers computing them), greedy
generation scored with math-verify, lm-evaluation-harness on a local-file task, and
`compare` drawing its plots."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from del_megatron.cli.convert import main as convert

from ..distributed.launcher import ROOT, run_python, run_torchrun

pytestmark = pytest.mark.slow

SCALARS = [
    "loss",
    "perplexity",
    "digit_acc",
    "digit_cond_acc",
    "number_exact_match",
    "number_abs_error",
    "number_rel_error",
    "digit_entropy",
    "digit_calibration_error",
    # the digit logits' level and the DEL term's share (the checkpoint: its run's del at 0.1,
    # from run_config.yaml; the export: DEL at the default 0.1, the same loss)
    "digit_logit",
    "digit_logsumexp",
    "numeric",
    "numeric_share",
]


def del_eval(*argv) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    proc = run_python("-m del_megatron.cli.eval", *map(str, argv), env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def trained(tmp_path_factory, synth_tokenizer, synth_shards, synth_corpus):
    from data_tools.build import build_shards

    root = tmp_path_factory.mktemp("eval")
    build_shards(
        [synth_corpus / "heldout.jsonl"], root / "heldout", synth_tokenizer, progress=False
    )
    run_torchrun(
        "-m del_megatron.cli.train",
        2,
        "--config",
        str(ROOT / "configs" / "tiny_cpu.yaml"),
        f"data.tokenizer={synth_tokenizer}",
        f"data.sources=[{{manifest: {synth_shards}}}]",
        "eval.sources=[]",
        "train.steps=6",
        "logging.wandb=disabled",
        f"output_dir={root / 'run'}",
    )
    checkpoint = root / "run" / "checkpoints" / "step-0000006"
    assert (
        convert(["megatron-to-hf", "--checkpoint", str(checkpoint), "--out", str(root / "hf")]) == 0
    )
    return root, checkpoint


def test_checkpoint_and_export_give_the_same_teacher_forced_metrics(trained):
    root, checkpoint = trained
    args = [  # no --seq-len: the default windows are the same for both (the model's length)
        "--heldout",
        root / "heldout" / "manifest.json",
        "--max-batches",
        "4",
        "--batch-size",
        "4",
        "--quiet",
    ]
    del_eval(checkpoint, *args, "--out", root / "a")
    del_eval(root / "hf", *args, "--out", root / "b")
    a = json.loads((root / "a" / "results.json").read_text())["numeric"]
    b = json.loads((root / "b" / "results.json").read_text())["numeric"]
    assert a["seq_len"] == b["seq_len"] == 256  # tiny_cpu.yaml's max_position_embeddings
    assert a["digits"] == b["digits"] > 50 and a["numbers"] == b["numbers"] > 10
    for key in SCALARS:
        assert abs(a[key] - b[key]) <= 1e-4 * max(1.0, abs(b[key])), (key, a[key], b[key])
    for place, value in b["digit_acc_by_place"].items():
        assert abs(a["digit_acc_by_place"][place] - value) <= 1e-4, place
    assert a["digit_entropy_histogram"]["counts"] == b["digit_entropy_histogram"]["counts"]
    assert "| digit acc |" in (root / "a" / "results.md").read_text()
    assert a["numeric_term"] == "del at alpha 0.1 (the run's, run_config.yaml)"
    assert (
        b["numeric_term"] == "del at the default alpha 0.1 (the model's training loss is unknown)"
    )
    assert 0 < a["numeric_share"] < 1
    table = (root / "a" / "results.md").read_text()
    assert "| digit logsumexp |" in table and "| numeric term share |" in table, table


def test_generation_lm_eval_and_compare(trained, synth_corpus, tmp_path):
    root, checkpoint = trained
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "del_local.yaml").write_text(
        "task: del_local_arith\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {synth_corpus / 'heldout.jsonl'}\n"
        "test_split: test\n"
        "output_type: loglikelihood\n"
        'doc_to_text: "{{question}}\\nAnswer:"\n'
        'doc_to_target: " {{answer}}"\n'
        "metric_list:\n  - metric: perplexity\n  - metric: acc\n"
    )
    gen = [
        "--gsm8k",
        synth_corpus / "heldout.jsonl",
        "--shots",
        "0",
        "--template",
        "{question}\nAnswer:",
        "--limit",
        "3",
        "--max-new-tokens",
        "6",
        "--quiet",
    ]
    # with the numeric task suite, as launch/experiments/compare_losses_gpu.sh evaluates it
    from data_tools.tasks import MAKERS, write_tasks
    from experiments.numeric_tasks.report import main as task_report

    write_tasks(tmp_path / "suite", documents=1, heldout=3, seed=0)
    suite = ["--tasks", tmp_path / "suite", "--task-shots", "1", "--task-limit", "1"]
    del_eval(checkpoint, *gen, *suite, "--out", tmp_path / "mle-1", "--device", "cpu")
    results = json.loads((tmp_path / "mle-1" / "results.json").read_text())
    result = results["generation"]
    assert result["problems"] == 3 and 0 <= result["accuracy"] <= 1 and len(result["examples"]) == 3
    assert sorted(results["tasks"]) == sorted(MAKERS)  # results.json keys sorted
    for task, metrics in results["tasks"].items():
        assert metrics["greedy_problems"] == 1 and 0 <= metrics["exact_greedy"] <= 1, task
        assert 0 <= metrics["digit_acc"] <= 1 and metrics["digits"] > 0, task
    assert "| task noisy | digit acc" in (tmp_path / "mle-1" / "results.md").read_text()
    assert task_report(["--evaluated", str(tmp_path / "mle-1"), "--out", str(tmp_path / "r")]) == 0
    assert "**noisy** (easy; true digit entropy" in (tmp_path / "r" / "report.md").read_text()
    del_eval(
        root / "hf",
        "--lm-eval",
        "del_local_arith",
        "--lm-eval-include",
        tasks,
        "--lm-eval-limit",
        "5",
        "--out",
        tmp_path / "lm",
    )
    lm = json.loads((tmp_path / "lm" / "results.json").read_text())["lm_eval"]
    assert "del_local_arith" in lm and any(k.startswith("acc") for k in lm["del_local_arith"])
    out = tmp_path / "compare"
    proc = del_eval("compare", root / "a", root / "b", "--out", out)
    for png in ("digit_entropy.png", "place_accuracy.png"):
        assert (out / png).stat().st_size > 1000, png
    assert not (out / "loss_curves.png").exists()  # no metrics.jsonl: no empty plot
    assert "no loss curves: no metrics.jsonl" in proc.stdout and "Warning" not in proc.stderr
    assert "| a | 1 |" in proc.stdout and "| b | 1 |" in proc.stdout
