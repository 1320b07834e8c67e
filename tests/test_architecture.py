"""The package's shape, as docs/concepts.md and the README's layout describe it.

- The engine (``core/``) imports nothing from Airflow.
- One direction of travel: nothing below the facade (``core/traversal.py``) imports it; what a
  range's run needs travels in ``RunContext`` (``core/run/context.py``), built by the facade.
- No import cycle anywhere in the package, counting imports under ``TYPE_CHECKING`` and inside
  functions: every ``import`` statement in the source is an edge.
- The rooms of ``core/`` each say what they own in their ``__init__`` docstring.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "airflow_keyset_provider"
NAME = PACKAGE.name
ROOMS = ("pace", "preview", "rounds", "run", "sql", "store", "writeback")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(importer: str, is_package: bool, level: int, module: str | None) -> str:
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    if level:
        base = base[: len(base) - (level - 1)]
        return ".".join([*base, module] if module else base)
    return module or ""


def imports_of(name: str) -> set[str]:
    """Every module of the package that ``name`` imports, wherever the statement stands."""
    path = MODULES[name]
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(name, path.name == "__init__.py", node.level, node.module)
            for a in node.names:  # ``from pkg import mod`` imports the module (pkg is its parent)
                sub = f"{target}.{a.name}"
                found.add(sub if sub in MODULES else target)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: imports_of(name) for name in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_package_has_no_import_cycle() -> None:
    assert _cycles(GRAPH) == []


def test_the_cycle_check_finds_a_planted_cycle() -> None:
    planted = {k: set(v) for k, v in GRAPH.items()}
    planted[f"{NAME}.core.keys"].add(f"{NAME}.core.traversal")  # the facade imports keys
    assert any(f"{NAME}.core.keys" in c for c in _cycles(planted))


def test_nothing_below_the_facade_imports_it() -> None:
    facade = f"{NAME}.core.traversal"
    core = f"{NAME}.core"
    below = [m for m in MODULES if m.startswith(core + ".") and m != facade]
    assert [m for m in below if facade in GRAPH[m]] == []
    assert [m for m in below if core in GRAPH[m]] == []  # nor the package that re-exports it


def test_the_engine_imports_nothing_from_airflow() -> None:
    offenders = []
    for name, path in MODULES.items():
        if not name.startswith(f"{NAME}.core"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            offenders += [f"{name}: {n}" for n in names if n.split(".")[0] == "airflow"]
    assert offenders == []


def test_operator_helpers_do_not_import_the_operator() -> None:
    operator = f"{NAME}.operators.traverse"
    helpers = [m for m in MODULES if m.startswith(f"{NAME}.operators.traverse_")]
    assert helpers and [m for m in helpers if operator in GRAPH[m]] == []


def test_each_room_says_what_it_owns() -> None:
    for room in ROOMS:
        doc = ast.get_docstring(ast.parse((PACKAGE / "core" / room / "__init__.py").read_text()))
        assert doc and len(doc.split()) >= 25, room
