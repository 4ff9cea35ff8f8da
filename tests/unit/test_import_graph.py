"""The house's import rules, read from the source (every import: module level,
inside functions, under TYPE_CHECKING): the server never imports the client, the
client never imports the server, what both need lives at the top of ``kvsvc``,
and no module imports itself back through a cycle (a cycle is a seam in the
wrong place: metrics once imported the server to reach into it)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kvsvc

PACKAGE = Path(kvsvc.__file__).resolve().parent
#: Top-level modules both sides share; they import neither side.
SHARED = {"kvsvc", "kvsvc.errors", "kvsvc.framing", "kvsvc.ids", "kvsvc.layout", "kvsvc.limits"}
SHARED |= {"kvsvc.logs", "kvsvc.pidfds"}
SHARED |= {f"kvsvc.errors.{m}" for m in ("classes", "envelope", "parsing", "reasons")}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def hand_written() -> dict[str, Path]:
    return {
        module_name(p): p
        for p in PACKAGE.rglob("*.py")
        if "_pb2" not in p.name and "v1" not in p.relative_to(PACKAGE).parts
    }


def import_graph() -> dict[str, set[str]]:
    """kvsvc module -> the kvsvc modules it imports anywhere in its source."""
    modules = hand_written()
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
                # `from kvsvc.server.ops import failpoints` imports kvsvc.server.ops.failpoints.
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                    for a in node.names
                ]
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def side(module: str) -> str:
    """Which room of the house a module is in (``python -m kvsvc`` is the command)."""
    if module == "kvsvc.__main__":
        return "cli"
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in ("client", "server", "cli", "integrations"):
        return parts[1]
    return "shared"


#: room -> the rooms it may import. cli sits above both sides; an engine plug-in
#: is an engine's client, so it never reaches into the server either.
ALLOWED = {
    "shared": {"shared"},
    "client": {"shared", "client"},
    "server": {"shared", "server"},
    "integrations": {"shared", "client", "integrations"},
    "cli": {"shared", "client", "server", "cli"},
}


def forbidden_edges(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{a} -> {b}"
        for a, targets in graph.items()
        for b in targets
        if side(b) not in ALLOWED[side(a)]
    )


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
    assert "kvsvc.server.ops.lifecycle" in graph["kvsvc.cli.main"]  # imported inside _serve
    # `from kvsvc.server.ops import failpoints` is an edge to the module, not the package
    assert "kvsvc.server.ops.failpoints" in graph["kvsvc.server.data.engine"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_rule_catches_an_edge_across_the_house() -> None:
    graph = {"kvsvc.server.x": {"kvsvc.client.calls"}, "kvsvc.errors": {"kvsvc.server.x"}}
    assert forbidden_edges(graph) == [
        "kvsvc.errors -> kvsvc.server.x",
        "kvsvc.server.x -> kvsvc.client.calls",
    ]


def test_every_module_is_in_a_known_room() -> None:
    strays = [m for m in hand_written() if side(m) == "shared" and m not in SHARED]
    assert strays == [], f"top-level modules beyond the shared set: {strays}"


def test_the_server_and_the_client_never_import_each_other() -> None:
    assert forbidden_edges(import_graph()) == []


def test_kvsvc_modules_import_each_other_without_a_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_metrics_and_failpoints_import_no_other_kvsvc_module() -> None:
    """Leaves: they read the server through narrow views and are read by it."""
    graph = import_graph()
    assert graph["kvsvc.server.ops.metrics"] == set()
    assert graph["kvsvc.server.ops.tier_metrics"] == {"kvsvc.server.ops.metrics"}
    assert graph["kvsvc.server.ops.failpoints"] == set()


@pytest.mark.parametrize("limit", [700])
def test_no_hand_written_module_is_longer_than_one_sitting(limit: int) -> None:
    long = {
        m: n for m, p in hand_written().items() if (n := len(p.read_text().splitlines())) > limit
    }
    assert long == {}, f"modules over {limit} lines: {long}"


def test_tests_share_helpers_one_way() -> None:
    """Shared helpers come from tests/support.py by name: `tests.X` works only under
    `python -m pytest`, and `conftest` is ambiguous once a layer has its own."""
    tests = PACKAGE.parent / "tests"
    wrong = [
        f"{p.relative_to(tests)}:{n}"
        for p in tests.rglob("*.py")
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if line.strip().startswith(
            ("from tests", "import tests", "from conftest", "import conftest")
        )
    ]
    assert wrong == []
