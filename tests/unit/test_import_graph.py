"""The package's modules import each other without a cycle, counting imports made
only for type checking and imports inside functions: a cycle there is a seam in the
wrong place (metrics once imported the server to reach into it)."""

from __future__ import annotations

import ast
from pathlib import Path

import kvsvc

PACKAGE = Path(kvsvc.__file__).resolve().parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """kvsvc module -> the kvsvc modules it imports anywhere in its source."""
    modules = {module_name(p): p for p in PACKAGE.glob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                # `from kvsvc import failpoints` imports the module kvsvc.failpoints.
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                    for a in node.names
                ]
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_sees_type_checking_and_function_level_imports() -> None:
    graph = import_graph()
    assert "kvsvc.lifecycle" in graph["kvsvc.cli"]  # imported inside _serve
    assert "kvsvc.failpoints" in graph["kvsvc.transfer"]  # `from kvsvc import failpoints`
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_kvsvc_modules_import_each_other_without_a_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_metrics_and_failpoints_import_no_other_kvsvc_module() -> None:
    """Leaves: they read the server through narrow views and are read by it."""
    graph = import_graph()
    assert graph["kvsvc.metrics"] == set()
    assert graph["kvsvc.failpoints"] == set()
