"""The package's own modules import each other without a cycle at module level.

A cycle makes the import order decide which names exist when a module runs, and hides which module depends on
which; a module that needs another only at call time imports it inside the function (ignored here), and one
that needs it only for annotations under ``if TYPE_CHECKING`` (ignored too).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "sglang_kdtree"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__``)."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _module_level_imports(body: list[ast.stmt]):
    """The import statements that run when the module is imported: the top level and the bodies of top-level
    ``if`` / ``try`` / ``with`` / ``class`` blocks, not functions, not ``if TYPE_CHECKING``."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _module_level_imports(node.body)
            yield from _module_level_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _module_level_imports(block)
        elif isinstance(node, (ast.With, ast.ClassDef)):
            yield from _module_level_imports(node.body)


def _targets(node: ast.stmt, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The package modules an import statement of ``module`` loads by name (``from pkg import sub`` names the
    submodule ``pkg.sub`` when there is one, else ``pkg``)."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in known}
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    out = set()
    for alias in node.names:
        sub = f"{source}.{alias.name}"
        if sub in known:
            out.add(sub)
        elif source in known:
            out.add(source)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges = set()
        for node in _module_level_imports(tree.body):
            edges |= _targets(node, name, path.name == "__init__.py", known)
        graph[name] = edges - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    for start in sorted(graph):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_find_cycle_names_the_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_graph_sees_relative_and_from_imports():
    graph = import_graph()
    assert f"{PACKAGE}.contract" in graph[f"{PACKAGE}.gpu.backend"]
    assert f"{PACKAGE}.gpu.runtime" in graph[f"{PACKAGE}.gpu.topk"]  # ``from sglang_kdtree.gpu import runtime``


def test_package_modules_import_without_a_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "module-level import cycle: " + " -> ".join(cycle)


def test_round_graphs_reach_the_backend_only_through_the_object_they_are_given():
    """``gpu.round_graphs`` captures ``GpuBackend``'s steps and the backend builds its graphs: the graphs module
    must not import the backend at all (not even inside a function), or the two would load each other."""
    path = ROOT / "gpu" / "round_graphs.py"
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imported |= _targets(node, f"{PACKAGE}.gpu.round_graphs", False, set(_modules()))
    assert f"{PACKAGE}.gpu.backend" not in imported
