"""Generation accuracy on GSM8K-format problems: few-shot prompts, batched greedy decoding,
the final answer extracted and compared with Hugging Face's math-verify.

Problems are jsonl records with `question` and `answer`; the gold answer is what follows
`####` in `answer` (GSM8K), or the whole `answer` when there is none (the synthetic
corpus's held-out problems). A completion's answer is what follows its last `####`, else
the completion up to the first blank line; math-verify parses both (it reads "1,000", "$5",
"5.00", fractions, LaTeX) and decides equality.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import UserError

DEFAULT_TEMPLATE = "Question: {question}\nAnswer:"
STOPS = ("\n\n", "\nQuestion:")


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str  # the full reference answer (worked solution for GSM8K)
    gold: str  # the final answer


def gold_of(answer: str) -> str:
    return answer.rsplit("####", 1)[1].strip() if "####" in answer else answer.strip()


def load_problems(path: Path, limit: int | None = None) -> list[Problem]:
    problems = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"{path}: cannot read ({err})") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            problems.append(
                Problem(record["question"], record["answer"], gold_of(record["answer"]))
            )
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
            raise UserError(
                f"{path} line {number}: not a problem with 'question' and 'answer' ({err})"
            ) from None
        if limit is not None and len(problems) >= limit:
            break
    if not problems:
        raise UserError(f"{path}: no problems")
    return problems


def prompt_of(problem: Problem, shots: list[Problem], template: str) -> str:
    """`template` (with {question}) after each shot followed by its answer, then the problem."""
    examples = "".join(
        template.format(question=s.question) + " " + s.answer.strip() + "\n\n" for s in shots
    )
    return examples + template.format(question=problem.question)


def answer_of(completion: str) -> str:
    if "####" in completion:
        tail = completion.rsplit("####", 1)[1].strip()
        return tail.splitlines()[0] if tail else ""
    return completion.strip().split("\n\n", 1)[0].strip()


def check(gold: str, completion: str) -> tuple[bool, float | None]:
    """(whether the completion's answer equals the gold one, |answer - gold| when both are
    numbers)."""
    from math_verify import parse, verify

    extracted = answer_of(completion)
    gold_parsed, answer_parsed = parse(gold), parse(extracted)
    correct = bool(gold_parsed and answer_parsed and verify(gold_parsed, answer_parsed))
    error = None
    gold_value, value = _number(gold_parsed), _number(answer_parsed)
    if gold_value is not None and value is not None:
        error = abs(value - gold_value)
    return correct, error


def _number(parsed: list[Any]) -> float | None:
    for item in parsed:
        try:
            value = float(item)
        except (TypeError, ValueError):
            continue
        if math.isfinite(value):
            return value
    return None


def cut_at_stops(text: str) -> str:
    ends = [text.find(stop) for stop in STOPS if stop in text]
    return text[: min(ends)] if ends else text


class _TokenizerVocabulary:
    """Greedy decoding among the tokenizer's ids: a model's vocabulary can be padded past
    them (rows that training never targets), and those ids decode to nothing."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores[:, self.size :] = float("-inf")
        return scores


def generate_transformers(
    model, tokenizer, prompts: list[str], *, max_new_tokens: int, batch_size: int, progress: bool
) -> list[str]:
    """Greedy continuations, batched with left padding (the pad positions masked)."""
    from tqdm import tqdm

    device = next(model.parameters()).device
    eos = tokenizer.eos_id
    out = []
    for start in tqdm(range(0, len(prompts), batch_size), desc="generating", disable=not progress):
        batch = [tokenizer.encode(p) for p in prompts[start : start + batch_size]]
        width = max(len(ids) for ids in batch)
        input_ids = torch.tensor([[eos] * (width - len(ids)) + ids for ids in batch], device=device)
        attention = torch.tensor(
            [[0] * (width - len(ids)) + [1] * len(ids) for ids in batch], device=device
        )
        with torch.no_grad():
            generated = model.generate(
                input_ids=input_ids,
                attention_mask=attention,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=eos,
                eos_token_id=eos,
                logits_processor=[_TokenizerVocabulary(tokenizer.vocab_size)],
            )
        for row in generated[:, width:].tolist():
            if eos in row:
                row = row[: row.index(eos)]
            out.append(cut_at_stops(tokenizer.decode(row)))
    return out


def generate_vllm(hf_dir: Path, tokenizer, prompts: list[str], *, max_new_tokens: int) -> list[str]:
    """The same on vLLM (GPU, when installed): prompts given as token ids, so tokenization is
    the run's."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(hf_dir), skip_tokenizer_init=False)
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, stop=list(STOPS))
    requests = [{"prompt_token_ids": tokenizer.encode(p)} for p in prompts]
    return [cut_at_stops(o.outputs[0].text) for o in llm.generate(requests, params)]


def score(problems: list[Problem], completions: list[str]) -> dict:
    correct, errors, records = 0, [], []
    for problem, completion in zip(problems, completions, strict=True):
        ok, error = check(problem.gold, completion)
        correct += ok
        if error is not None:
            errors.append(error)
        records.append({"gold": problem.gold, "answer": answer_of(completion), "correct": ok})
    return {
        "problems": len(problems),
        "accuracy": correct / len(problems),
        "answered_with_a_number": len(errors),
        "mean_abs_error": sum(errors) / len(errors) if errors else float("nan"),
        "examples": records[:20],
    }
