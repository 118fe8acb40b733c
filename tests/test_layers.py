"""The package's import graph against the floors docs/ARCHITECTURE.md draws: every module on
exactly one floor, no import of a higher floor, no circle (function-local and TYPE_CHECKING imports
included)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import triedec

PACKAGE = Path(triedec.__file__).parent
ARCHITECTURE = Path(__file__).parents[1] / "docs" / "ARCHITECTURE.md"


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


def drawn_floors(text: str) -> dict[str, list[str]]:
    """The picture in ARCHITECTURE.md's first code block, as floor name -> the module patterns on
    that floor's line, top floor first: ``x.py`` is the module ``triedec.x``; ``d/ (a, b)`` is
    ``triedec.d.a`` and ``triedec.d.b`` (``__init__`` is the package itself); a bare ``d/`` is the
    package ``d`` and everything in it."""
    block = text.split("```", 2)[1]
    floors: dict[str, list[str]] = {}
    for line in block.splitlines():
        words = line.split()
        if not words or words[0] == "|":
            continue
        found: list[str] = []
        for package, members in re.findall(r"(\w+)/ \(([^)]*)\)", line):
            for m in members.split(","):
                m = m.strip()
                found.append(f"triedec.{package}" if m == "__init__" else f"triedec.{package}.{m}")
        line = re.sub(r"\w+/ \([^)]*\)", " ", line)
        for name in re.findall(r"(?<![\w/])(\w+)\.py\b", line):
            found.append("triedec" if name == "__init__" else f"triedec.{name}")
        found += [f"triedec.{d}.*" for d in re.findall(r"(?<![\w/])(\w+)/(?!\S)", line)]
        floors[words[0]] = found
    return floors


def floor_table() -> dict[str, int]:
    """Each module's floor (0 = the bottom) as ARCHITECTURE.md draws it."""
    floors = list(drawn_floors(ARCHITECTURE.read_text()).values())[::-1]
    table: dict[str, int] = {}
    for module in graph():
        places = [i for i, patterns in enumerate(floors) for p in patterns
                  if p == module or (p.endswith(".*") and (module + ".").startswith(p[:-1]))]
        assert len(places) == 1, f"{module} is drawn on {len(places)} floors of ARCHITECTURE.md, not one"
        table[module] = places[0]
    return table


def test_architecture_draws_seven_floors_and_places_every_module_once():
    floors = drawn_floors(ARCHITECTURE.read_text())
    assert list(floors) == ["front", "shells", "API", "engine", "drafters", "model", "core"]
    assert "seven floors" in ARCHITECTURE.read_text()
    drawn = [p for patterns in floors.values() for p in patterns if not p.endswith(".*")]
    assert sorted(set(drawn)) == sorted(drawn), "a module is drawn twice"
    assert set(drawn) <= set(graph()), f"drawn but not in the package: {set(drawn) - set(graph())}"
    assert set(floor_table()) == set(graph())


def test_no_module_imports_a_higher_floor():
    table = floor_table()
    bad = [f"{src} (floor {table[src]}) imports {dst} (floor {table[dst]})"
           for src, targets in graph().items() for dst in targets if table[dst] > table[src]]
    assert bad == []


def test_the_import_graph_has_no_circle():
    assert find_cycle(graph()) is None, f"import circle: {' -> '.join(find_cycle(graph()) or [])}"


def test_the_checker_sees_function_local_imports_and_circles(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from triedec.api.lm import LM\n    import triedec.cli.main\n")
    assert {"triedec.api.lm", "triedec.cli.main"} <= imports_of(path)
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_picture_parser_reads_files_lists_and_packages():
    text = "```\n top   a.py (says b.py)  pkg/ (__init__, x, y)  __init__.py\n   |\n low   whole/\n```"
    assert drawn_floors(text) == {"top": ["triedec.pkg", "triedec.pkg.x", "triedec.pkg.y", "triedec.a", "triedec.b",
                                          "triedec"],
                                  "low": ["triedec.whole.*"]}


def test_the_folders_are_the_layers():
    """Only the front door sits directly in the package: every other module lives in its layer's
    folder (core, model, drafters, engine, api, and the shells)."""
    assert sorted(p.name for p in PACKAGE.glob("*.py")) == ["__init__.py"]
    floors = drawn_floors(ARCHITECTURE.read_text())
    for floor, folder in [("core", "core"), ("model", "model"), ("drafters", "drafters"), ("engine", "engine"),
                          ("API", "api")]:
        assert floors[floor] == [f"triedec.{folder}.*"]
