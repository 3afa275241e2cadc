"""Per-task evaluation on the numeric task suite (`data-tools tasks`, data_tools/tasks.py):
each task's held-out problems scored on their answer only, teacher-forced (the numeric
metrics of `numeric.py` through the one teacher-forced loop) and greedy (`generation.py`,
math-verify).

Per task: digit accuracy, exact match of the answer teacher-forced (every answer digit the
greedy digit given the true ones before it) and greedy (the generated answer equals the
gold one), digit entropy against the task's true digit entropy (0 for exact tasks; the
noisy task's known distribution otherwise), the digit calibration error (ECE) and the best
digit accuracy any model can reach (1 for exact tasks).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import UserError
from .generation import GenerationSettings, Problem, gold_of, prompt_of

TEMPLATE = "{question}\nAnswer:"  # the training text's form (data_tools/tasks.py, text_of)


@dataclass(frozen=True, kw_only=True)
class TaskSuiteSettings:
    directory: Path
    """What `data-tools tasks` wrote (tasks.json, heldout/)."""
    shots: int = 0
    """Solved problems of the same task before each prompt (the first held-out ones)."""
    limit: int | None = None
    """Greedy answers to at most this many problems a task (teacher-forced: every one)."""
    backend: str = "transformers"
    batch_size: int = 8


@dataclass(frozen=True)
class TaskSet:
    name: str
    level: str  # easy or hard
    path: Path  # the held-out jsonl
    records: list[dict]  # {question, answer, gold, digit_entropy, digit_top}


def load_suite(directory: Path, names: list[str] | None = None) -> list[TaskSet]:
    """The suite `data-tools tasks` wrote into `directory` (tasks.json and heldout/), every
    file read to its end; `names`: only these tasks, in this order."""
    meta_path = directory / "tasks.json"
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        entries = {t["name"]: t for t in meta["tasks"]}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as err:
        raise UserError(f"{meta_path}: not a task suite of data-tools tasks ({err})") from None
    unknown = [n for n in names or [] if n not in entries]
    if unknown:
        raise UserError(f"{meta_path}: no task {unknown[0]!r} (tasks: {', '.join(entries)})")
    suite = []
    for name in names or list(entries):
        path = directory / entries[name]["heldout"]
        records = []
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as err:
            raise UserError(f"{path}: cannot read ({err})") from None
        for number, line in enumerate(lines, start=1):
            try:
                record = json.loads(line)
                if not (record["text"].endswith(record["gold"]) and record["digit_entropy"]):
                    raise ValueError("the text does not end with the gold answer")
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
                raise UserError(
                    f"{path} line {number}: not a held-out task problem ({err})"
                ) from None
            records.append(record)
        if not records:
            raise UserError(f"{path}: no problems")
        suite.append(TaskSet(name, entries[name].get("level", ""), path, records))
    return suite


def _problem(record: dict) -> Problem:
    return Problem(record["question"], record["answer"], gold_of(record["answer"]))


def answer_example(
    tokenizer, record: dict, shots: list[Problem], template: str
) -> tuple[list[int], int]:
    """(ids of the prompt and answer, index of the answer's first token): the prompt as the
    generation sees it (`generation.prompt_of`), " " and the worked answer; the gold answer
    is what the ids past their longest common prefix with the text before the gold encode."""
    text = prompt_of(_problem(record), shots, template) + " " + record["answer"]
    ids = tokenizer.encode(text)
    before = tokenizer.encode(text[: len(text) - len(record["gold"])])
    start = 0
    while start < min(len(ids), len(before)) and ids[start] == before[start]:
        start += 1
    if not 0 < start < len(ids):
        raise UserError(f"{record['question']!r}: the tokenizer leaves no answer tokens")
    return ids, start


def answer_batches(
    tokenizer, records: list[dict], shots: list[Problem], template: str, batch_size: int
) -> list[dict[str, torch.Tensor]]:
    """Batches of {tokens, labels, loss_mask} [b, s] (right-padded with EOS, masked): labels
    [:, t] is the target of tokens [:, t]; the mask is 1 exactly at the gold answer's tokens."""
    examples = [answer_example(tokenizer, r, shots, template) for r in records]
    batches = []
    for begin in range(0, len(examples), batch_size):
        chunk = examples[begin : begin + batch_size]
        width = max(len(ids) for ids, _ in chunk) - 1
        tokens = torch.full((len(chunk), width), tokenizer.eos_id, dtype=torch.long)
        labels = torch.full_like(tokens, tokenizer.eos_id)
        mask = torch.zeros_like(tokens, dtype=torch.float32)
        for row, (ids, start) in enumerate(chunk):
            n = len(ids) - 1
            tokens[row, :n] = torch.tensor(ids[:-1])
            labels[row, :n] = torch.tensor(ids[1:])
            mask[row, start - 1 : n] = 1.0  # label t is token t + 1
        batches.append({"tokens": tokens, "labels": labels, "loss_mask": mask})
    return batches


def truth(records: list[dict]) -> dict[str, float]:
    """The true mean digit entropy (nats) and the best digit accuracy over the answer digits
    of `records`, from the distribution each problem was drawn from."""
    entropies = [e for r in records for e in r["digit_entropy"]]
    tops = [t for r in records for t in r["digit_top"]]
    return {
        "true_digit_entropy": sum(entropies) / len(entropies),
        "best_digit_acc": sum(tops) / len(tops),
    }


def answer_metrics(loaded, task: TaskSet, *, shots: int, batch_size: int) -> dict:
    """Teacher-forced numeric metrics of `loaded` (backends.Loaded) on the answers of every
    held-out problem of `task` past its first `shots` (the shots)."""
    from .numeric import batch_statistics, numeric_metrics
    from .pipeline import teacher_forced

    shot_problems = [_problem(r) for r in task.records[:shots]]
    records = task.records[shots:]
    vocab = loaded.tokenizer.digit_vocab

    def score(batch):
        logits = loaded.forward(batch["tokens"])  # [b, s, V]
        return batch_statistics(logits, batch["labels"], batch["loss_mask"], vocab)

    batches = answer_batches(loaded.tokenizer, records, shot_problems, TEMPLATE, batch_size)
    metrics = teacher_forced(batches, score, numeric_metrics, device=loaded.device).metrics
    return {**metrics, **truth(records)}


def max_answer_tokens(tokenizer, task: TaskSet) -> int:
    """Room for the longest worked answer of `task`, and two tokens to spare."""
    return max(len(tokenizer.encode(" " + r["answer"])) for r in task.records) + 2


def _greedy(
    loaded,
    task: TaskSet,
    shots: int,
    limit: int | None,
    positions: int,
    scratch: Path,
    backend: str,
    batch_size: int,
) -> dict:
    """Greedy answers to the first `limit` held-out problems of `task` past the shots."""
    from .generation import generation_accuracy

    settings = GenerationSettings(
        problems=task.path,
        shots=shots,
        template=TEMPLATE,
        limit=limit,
        max_new_tokens=max_answer_tokens(loaded.tokenizer, task),
        backend=backend,
        batch_size=batch_size,
    )
    problems = [_problem(r) for r in task.records]
    return generation_accuracy(
        loaded,
        settings,
        problems[shots:][:limit],
        problems[:shots],
        positions=positions,
        scratch=scratch,
        progress=False,
    )


def evaluate_suite(
    loaded,
    suite: list[TaskSet],
    *,
    positions: int,
    scratch: Path,
    shots: int = 0,
    greedy_limit: int | None = None,
    batch_size: int = 32,
    backend: str = "transformers",
) -> dict[str, dict]:
    """{task: metrics} of `loaded`: the teacher-forced answer metrics of every held-out
    problem, and greedy exact match (`exact_greedy`) of the first `greedy_limit` of them
    (None: all; 0: none, exact_greedy NaN)."""
    generator = loaded
    if greedy_limit != 0 and backend == "transformers" and loaded.hf_model is None:
        from .backends import hf_directory, load_model

        # a checkpoint generates as its export: loaded once for every task, not once a task
        generator = load_model(hf_directory(loaded, scratch), loaded.device)
    results = {}
    for task in suite:
        metrics = answer_metrics(loaded, task, shots=shots, batch_size=batch_size)
        greedy = {"accuracy": math.nan, "problems": 0, "examples": []}
        if greedy_limit != 0:
            greedy = _greedy(
                generator, task, shots, greedy_limit, positions, scratch, backend, batch_size
            )
        results[task.name] = {
            "level": task.level,
            "digit_acc": metrics["digit_acc"],
            "digit_cond_acc": metrics["digit_cond_acc"],
            "exact_teacher_forced": metrics["number_exact_match"],
            "exact_greedy": greedy["accuracy"],
            "greedy_problems": greedy["problems"],
            # the paper's number MAE: |greedy answer - gold| over the answers that are a number
            "number_mae": greedy.get("mean_abs_error", math.nan),
            "answered_with_a_number": greedy.get("answered_with_a_number", 0),
            "digit_entropy": metrics["digit_entropy"],
            "true_digit_entropy": metrics["true_digit_entropy"],
            "entropy_gap": metrics["digit_entropy"] - metrics["true_digit_entropy"],
            "digit_ece": metrics["digit_calibration_error"],
            "best_digit_acc": metrics["best_digit_acc"],
            # what a model reaches of what any can (the noisy task's best is below 1)
            "relative_digit_acc": metrics["digit_acc"] / metrics["best_digit_acc"],
            "answer_loss": metrics["loss"],
            "digits": metrics["digits"],
            "greedy_examples": greedy["examples"][:3],
        }
    return results
