"""Generation accuracy on GSM8K-format problems: few-shot prompts, batched greedy decoding,
the final answer extracted and compared with Hugging Face's math-verify.

Problems are jsonl records with `question` and `answer`; the gold answer is what follows
`####` in `answer` (GSM8K), else what follows its last "The answer is", else the whole
`answer` when it is one word (the synthetic corpus's held-out problems: "42"); any other
answer is refused naming its line, rather than a whole worked solution taken as the gold.
A completion's answer is what follows its last `####`, else the completion up to the first
blank line; math-verify parses both (it reads "1,000", "$5",
"5.00", fractions, LaTeX) and decides equality.
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import UserError

if TYPE_CHECKING:
    import torch

DEFAULT_TEMPLATE = "Question: {question}\nAnswer:"
STOPS = ("\n\n", "\nQuestion:")


@dataclass(frozen=True, kw_only=True)
class GenerationSettings:
    problems: Path
    """GSM8K-format jsonl (question, answer ending in '#### N')."""
    shots: int = 4
    """Few-shot examples."""
    shots_file: Path | None = None
    """Take the shots from here (None: the first problems, then left out)."""
    template: str = DEFAULT_TEMPLATE
    """Prompt of one problem, with {question}."""
    limit: int | None = None
    """At most this many problems."""
    max_new_tokens: int = 256
    backend: str = "transformers"
    """transformers or vllm."""
    batch_size: int = 8


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str  # the full reference answer (worked solution for GSM8K)
    gold: str  # the final answer


_THE_ANSWER_IS = re.compile(r"the answer is:?\s*(\S+?)\.?\s*$", re.IGNORECASE)


def gold_of(answer: str) -> str | None:
    """The final answer of a reference answer (None: it states none)."""
    if "####" in answer:
        return answer.rsplit("####", 1)[1].strip() or None
    last = answer.strip().splitlines()[-1] if answer.strip() else ""
    found = _THE_ANSWER_IS.search(last)
    if found:
        return found.group(1)
    return answer.strip() if answer.strip() and len(answer.split()) == 1 else None


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
            gold = gold_of(record["answer"])
            problems.append(Problem(record["question"], record["answer"], gold))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
            raise UserError(
                f"{path} line {number}: not a problem with 'question' and 'answer' ({err})"
            ) from None
        if gold is None:
            raise UserError(
                f"{path} line {number}: the answer states no final answer: end it with "
                "'#### N' (GSM8K's format) or 'The answer is N', or give the bare answer"
            )
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
    import torch
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


def problems_and_shots(settings: GenerationSettings) -> tuple[list[Problem], list[Problem]]:
    """The problems to answer and the few-shot examples (read before any model loads, so
    that a wrong file costs nothing)."""
    problems = load_problems(settings.problems, None)
    if settings.shots_file:
        shots = load_problems(settings.shots_file, settings.shots)
    else:
        shots, problems = problems[: settings.shots], problems[settings.shots :]
    if settings.limit is not None:
        problems = problems[: settings.limit]
    if not problems:
        raise UserError(f"{settings.problems}: no problems left after {settings.shots} shots")
    return problems, shots


def fitting_prompts(
    lengths: list[int], max_new_tokens: int, shots: int, positions: int
) -> list[int]:
    """Which prompts leave room for --max-new-tokens within the model's positions (past them
    a model's outputs are meaningless; transformers only warns). None fitting is refused."""
    keep = [i for i, n in enumerate(lengths) if n + max_new_tokens <= positions]
    if not keep:
        raise UserError(
            f"--gsm8k: no prompt ({min(lengths)} tokens or more with {shots} shots) leaves "
            f"room for --max-new-tokens {max_new_tokens} within the model's "
            f"max_position_embeddings={positions}: use fewer --shots or a smaller "
            "--max-new-tokens"
        )
    return keep


def generation_accuracy(
    loaded,
    settings: GenerationSettings,
    problems: list[Problem],
    shots: list[Problem],
    *,
    positions: int,
    scratch: Path,
    progress: bool,
) -> dict:
    """Greedy answers of `loaded` (backends.Loaded; a checkpoint runs as its export, written
    once into `scratch`) scored against the gold answers; prompts that leave no room for the
    answer within the model's `positions` are left out, and counted."""
    from .backends import hf_directory, load_model

    prompts = [prompt_of(p, shots, settings.template) for p in problems]
    keep = fitting_prompts(
        [len(loaded.tokenizer.encode(p)) for p in prompts],
        settings.max_new_tokens,
        len(shots),
        positions,
    )
    left_out = len(prompts) - len(keep)
    if left_out:
        print(
            f"del-eval: left out {left_out} of {len(prompts)} problems whose prompt plus "
            f"--max-new-tokens {settings.max_new_tokens} exceeds the model's "
            f"{positions} positions",
            file=sys.stderr,
            flush=True,
        )
        problems, prompts = [problems[i] for i in keep], [prompts[i] for i in keep]
    if settings.backend == "vllm":
        completions = generate_vllm(
            hf_directory(loaded, scratch),
            loaded.tokenizer,
            prompts,
            max_new_tokens=settings.max_new_tokens,
        )
    else:
        model = loaded.hf_model
        if model is None:  # a checkpoint: transformers runs its export
            model = load_model(hf_directory(loaded, scratch), loaded.device).hf_model
        completions = generate_transformers(
            model,
            loaded.tokenizer,
            prompts,
            max_new_tokens=settings.max_new_tokens,
            batch_size=settings.batch_size,
            progress=progress,
        )
    result = score(problems, completions)
    result.update(
        file=str(settings.problems),
        shots=len(shots),
        template=settings.template,
        backend=settings.backend,
        left_out_too_long=left_out,
    )
    return result
