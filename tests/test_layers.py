"""The package's import graph: no circle (function-local and TYPE_CHECKING imports included), and
the core never imports the layers above it."""

from __future__ import annotations

import ast
from pathlib import Path

import triedec

PACKAGE = Path(triedec.__file__).parent
CORE = ("tree", "trace", "sampling", "accept", "kvcache", "costmodel", "errors", "adapter", "engine", "drafters")
SHELLS = ("lm", "cli", "bench", "calibration", "methods", "server", "dropin")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every triedec module ``path`` imports, anywhere in the file (``from triedec.x import y``
    counts as ``triedec.x`` and, if it is a module, ``triedec.x.y``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("triedec")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("triedec"):
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges = {}
    for name, path in modules.items():
        targets = {t for t in imports_of(path) if t in modules and t != name}
        # importing a submodule runs its package's __init__ first (unless the importer is inside that
        # package: then the package is already being imported)
        parents = {t.rsplit(".", 1)[0] for t in targets if t.count(".") > 1}
        edges[name] = targets | {p for p in parents if not name.startswith(p + ".")} - {name}
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def layer(module: str) -> str:
    return module.split(".")[1] if module.count(".") else module


def test_the_import_graph_has_no_circle():
    assert find_cycle(graph()) is None, f"import circle: {' -> '.join(find_cycle(graph()) or [])}"


def test_the_core_never_imports_the_layers_above_it():
    bad = [(src, dst) for src, targets in graph().items() for dst in targets
           if layer(src) in CORE and layer(dst) in SHELLS]
    assert bad == []


def test_the_checker_sees_function_local_imports_and_circles(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from triedec.lm import LM\n    import triedec.cli\n")
    assert {"triedec.lm", "triedec.cli"} <= imports_of(path)
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
