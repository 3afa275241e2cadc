"""The README's promises: its Quick start is what CI runs; its Python examples run."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def test_quick_start_has_one_bash_block_whose_test_line_ci_runs():
    section = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1
    lines = [line for line in blocks[0].splitlines() if line.strip()]
    assert 1 <= len(lines) <= 2
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert lines[-1].strip() in ci_lines


def test_python_examples_run():
    examples = _blocks("python")
    assert examples
    for code in examples:
        exec(compile(code, "README.md", "exec"), {})
