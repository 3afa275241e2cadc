"""experiments/ uses the library, never the reverse: no module under del_megatron/ imports
`experiments` (late imports and `python -m experiments...` commands included), the
evaluation package holds no experiment, and the wheel ships no experiment nor needs scipy."""

from __future__ import annotations

import ast
import tomllib

from setuptools import find_namespace_packages

from ..distributed.launcher import ROOT

MOVED = (
    "task_experiment",
    "task_report",
    "continuation_experiment",
    "continuation_report",
    "effects",
    "results_page",
)


def _names_experiments(node: ast.AST) -> bool:
    if isinstance(node, ast.Import):
        return any(a.name.split(".")[0] == "experiments" for a in node.names)
    if isinstance(node, ast.ImportFrom):
        return node.level == 0 and (node.module or "").split(".")[0] == "experiments"
    # a module named in a string: importlib.import_module("experiments..."), `-m experiments...`
    return (
        isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value.split(".")[0] == "experiments"
        and node.value != "experiments"
    )


def test_the_library_imports_no_experiment():
    found = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in sorted((ROOT / "del_megatron").rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
        if _names_experiments(node)
    ]
    assert not found, f"the library leans on experiments/: {found}"


def test_the_evaluation_package_holds_no_experiment():
    left = [m for m in MOVED if (ROOT / "del_megatron" / "evaluation" / f"{m}.py").exists()]
    assert not left, f"experiments back in del_megatron/evaluation/: {left} (see experiments/)"


def test_the_wheel_ships_no_experiment_and_needs_no_scipy():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = project["tool"]["setuptools"]["packages"]["find"]["include"]
    shipped = find_namespace_packages(str(ROOT), include=include)  # pyproject's `find`
    assert "del_megatron.evaluation" in shipped
    assert not [p for p in shipped if p.split(".")[0] in ("experiments", "tests")], shipped
    needs = project["project"]["dependencies"]
    extras = project["project"]["optional-dependencies"]
    assert not [d for d in needs if d.startswith("scipy")]
    assert any(d.startswith("scipy") for d in extras["experiments"])
    assert any(d.startswith("scipy") for d in extras["test"])  # CI's tests of experiments/
