"""No attribute carries loss state between calls (an AST scan of del_megatron/): no
`setattr` (statistics once rode on the per-token loss tensor as an attribute), no attribute
named `last_*` (the model kept `last_numeric_stats`), and no `nn.Module` of ours assigns an
attribute of itself outside `__init__` (the model stashed the loss mask on itself in
forward). What a call needs is an argument; what it produces is its return value."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "del_megatron"
# base classes whose subclasses are modules (ours derive from these)
MODULE_BASES = {"Module", "GPTModel", "MegatronModule", "RotaryEmbedding"}


def _sources() -> list[tuple[Path, ast.Module]]:
    return [(p, ast.parse(p.read_text(), str(p))) for p in sorted(PACKAGE.rglob("*.py"))]


def _where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(ROOT)}:{node.lineno}"


def _base_name(base: ast.expr) -> str:
    return base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")


def find_side_channels(sources) -> list[str]:
    found = []
    for path, tree in sources:
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr":
                found.append(f"{_where(path, node)} setattr")
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                targets = [node.target]
            for target in targets:
                if isinstance(target, ast.Attribute) and target.attr.startswith("last_"):
                    found.append(f"{_where(path, node)} attribute {target.attr}")
            if isinstance(node, ast.ClassDef) and any(
                _base_name(b) in MODULE_BASES for b in node.bases
            ):
                found += _self_assignments_outside_init(path, node)
    return found


def _self_assignments_outside_init(path: Path, cls: ast.ClassDef) -> list[str]:
    found = []
    for method in cls.body:
        if not isinstance(method, ast.FunctionDef) or method.name == "__init__":
            continue
        for node in ast.walk(method):
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if (
                        isinstance(target, ast.Attribute)
                        and isinstance(target.value, ast.Name)
                        and target.value.id == "self"
                    ):
                        found.append(
                            f"{_where(path, node)} {cls.name}.{method.name} sets self.{target.attr}"
                        )
    return found


def test_no_attribute_carries_state_between_calls():
    assert find_side_channels(_sources()) == []


def test_the_scan_sees_each_side_channel_the_model_had():
    """The three forms the old model adapter used, each found."""
    old = ast.parse(
        "class NumericLossGPTModel(GPTModel):\n"
        "    def forward(self, loss_mask=None):\n"
        "        self._loss_mask = loss_mask\n"
        "    def _per_token(self, out):\n"
        "        setattr(out.per_token, 'numeric_stats', out.stats)\n"
        "        self.last_numeric_stats = out.stats\n"
    )
    found = find_side_channels([(ROOT / "old.py", old)])
    assert len(found) == 4, found  # the stash, setattr, last_* (also a self-assignment)
    assert any("setattr" in f for f in found) and any("last_numeric_stats" in f for f in found)
    assert any("sets self._loss_mask" in f for f in found)


def test_loss_kinds_are_dispatched_in_one_table():
    """No comparison with a loss kind's name outside losses/kinds.py: code asks
    `cfg.kind_spec` (issue 18: five files compared `kind` strings)."""
    from del_megatron.losses import KINDS

    found = []
    for path, tree in _sources():
        if path.name == "kinds.py":
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Compare):
                continue
            operands = [node.left, *node.comparators]
            names = [
                c.value
                for operand in operands
                for c in ([operand] if isinstance(operand, ast.Constant) else _elements(operand))
                if isinstance(c, ast.Constant) and c.value in KINDS
            ]
            if names:
                found.append(f"{_where(path, node)} compares with {names}")
    assert found == []


def _elements(node: ast.expr) -> list[ast.expr]:
    return list(node.elts) if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else []
