"""The package's import arrows, read from the source with `ast` (nothing is imported): no
circle among the modules of a package that must have none, and none of the forbidden arrows
(the command lines sit on top of the library; the library never leans on them)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("del_megatron", "data_tools")  # the packages whose imports are read

# (importer prefix, imported prefix): no module under the first imports one under the second.
# A prefix is a dotted module name and covers its submodules ("del_megatron.cli" covers
# del_megatron.cli.train, not del_megatron.client). A module under the imported prefix may
# import its own package: ("del_megatron", "del_megatron.cli") leaves cli's own arrows alone.
FORBIDDEN = [
    ("del_megatron", "del_megatron.cli"),
    ("data_tools", "del_megatron.cli"),
    # the checkpoint package takes data, not a trainer, nor megatron's global parallel state
    # (its generators' tracker, megatron.core.tensor_parallel, is state it saves)
    ("del_megatron.checkpoint", "del_megatron.training"),
    ("del_megatron.checkpoint", "megatron.core.parallel_state"),
]

# Packages whose modules import one another without a circle (a circle works only by
# importing late, and hides which module is the lower layer).
CIRCLE_FREE = ["del_megatron.losses"]


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    """Dotted name -> source file of every module of the scanned packages."""
    return {
        _module_name(path): path
        for package in SCANNED
        for path in sorted((ROOT / package).rglob("*.py"))
    }


def _imported(
    node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str]
) -> Iterator[str]:
    """The modules one import statement names, relative imports resolved. `from X import Y`
    names X.Y when that is a module (scanned, or outside the scanned packages, where it
    cannot be told from an attribute: both are named), else X."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    base = node.module or ""
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        anchor = package[: len(package) - (node.level - 1)]
        base = ".".join([*anchor, *([base] if base else [])])
    scanned = base.split(".")[0] in SCANNED
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        if sub in known:
            yield sub
        elif scanned:
            yield base
        else:
            yield from (base, sub)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement of a module, function-local ones too (an import made late is
    still an arrow), each with whether it sits under `if TYPE_CHECKING:` (annotations only)."""
    pending: list[tuple[ast.AST, bool]] = [(tree, False)]
    while pending:
        node, type_only = pending.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, type_only
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            pending.extend((child, True) for child in node.body)
            pending.extend((child, type_only) for child in node.orelse)
        else:
            pending.extend((child, type_only) for child in ast.iter_child_nodes(node))


def import_graph(*, type_only: bool) -> dict[str, set[str]]:
    """Module -> the modules it imports. type_only: whether imports under `if TYPE_CHECKING:`
    count. They never run, so they close no circle (the package puts a type-only reference
    there to keep the lower layer free of the upper one at run time: losses/kinds.py names
    NumericLossConfig so); but a forbidden arrow is forbidden even when it only names a type."""
    modules = _modules()
    known = set(modules)
    graph = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        graph[module] = {
            name
            for node, annotation in _import_nodes(tree)
            if type_only or not annotation
            for name in _imported(node, module, is_package, known)
        }
    return graph


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def forbidden_arrows(
    graph: dict[str, set[str]], rules: list[tuple[str, str]]
) -> list[tuple[str, str]]:
    """(importer, imported) of every arrow a rule forbids."""
    return sorted(
        (importer, name)
        for importer, names in graph.items()
        for name in names
        for source, target in rules
        if _under(importer, source) and not _under(importer, target) and _under(name, target)
    )


def circles(graph: dict[str, set[str]], package: str) -> list[list[str]]:
    """The strongly connected groups of more than one module (or a module importing itself)
    among the modules under `package` (Tarjan's algorithm)."""
    nodes = sorted(m for m in graph if _under(m, package))
    inside = {m: sorted(n for n in graph[m] if n in graph and _under(n, package)) for m in nodes}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in inside[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1 or node in inside[node]:
                found.append(sorted(group))

    for node in nodes:
        if node not in index:
            visit(node)
    return found


def test_no_import_circle_inside_the_packages_that_must_have_none():
    graph = import_graph(type_only=False)
    found = [(package, group) for package in CIRCLE_FREE for group in circles(graph, package)]
    assert not found, "import circles:\n" + "\n".join(
        f"  in {package}: {' <-> '.join(group)}" for package, group in found
    )


def test_no_forbidden_arrow():
    arrows = forbidden_arrows(import_graph(type_only=True), FORBIDDEN)
    assert not arrows, "forbidden imports (importer -> imported):\n" + "\n".join(
        f"  {importer} -> {name}" for importer, name in arrows
    )


def test_the_graph_sees_relative_late_and_absolute_imports():
    """The reader itself, on arrows known to be there: a relative import of a module
    (`from .. import collectives`), a function-local one (megatron's parallel_state in
    `_default_group`), a module importing its package's sibling by name, and a type-only
    one (losses/kinds.py's NumericLossConfig)."""
    graph = import_graph(type_only=False)
    assert "del_megatron.collectives" in graph["del_megatron.losses.vocab_parallel"]
    assert "megatron.core.parallel_state" in graph["del_megatron.losses.vocab_parallel"]
    assert "del_megatron.losses.assemble" in graph["del_megatron.losses.reference"]
    rules = [("del_megatron.losses", "del_megatron.losses.assemble")]
    assert ("del_megatron.losses.reference", "del_megatron.losses.assemble") in (
        forbidden_arrows(graph, rules)
    )
    assert "del_megatron.losses.config" not in graph["del_megatron.losses.kinds"]
    assert "del_megatron.losses.config" in import_graph(type_only=True)["del_megatron.losses.kinds"]
    assert circles({"p.a": {"p.b"}, "p.b": {"p.a"}, "p.c": {"p.a"}}, "p") == [["p.a", "p.b"]]
