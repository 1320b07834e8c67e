"""The write-back package's own import graph has no cycle (issue #20).

Every ``import`` statement of ``core/writeback/`` counts, also under ``TYPE_CHECKING`` and
inside functions. The target (table and key, pure data) is imported by the backends and never
imports them; ``connect.py`` pairs the two for the helpers.
"""

from __future__ import annotations

import ast
from pathlib import Path

import airflow_keyset_provider.core.writeback as writeback

ROOT = Path(writeback.__file__).resolve().parent
PACKAGE = writeback.__name__


def _name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PACKAGE, *parts])


MODULES = {_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imports_between_modules() -> dict[str, set[str]]:
    """``{module: writeback modules it imports}``, from every import statement of its source."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                if node.level:
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join([*base, node.module] if node.module else base)
                else:
                    target = node.module or ""
                for a in node.names:
                    sub = f"{target}.{a.name}"
                    found.add(sub if sub in MODULES else target)
        graph[name] = {m for m in found if m in MODULES and m != name}
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path ``[a, b, ..., a]``, or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return [*path[path.index(w) :], w]
            if w not in state and (found := visit(w)):
                return found
        state[v] = 2
        path.pop()
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


def test_writeback_modules_import_each_other_without_a_cycle() -> None:
    graph = imports_between_modules()
    edges = sorted(f"{a} -> {b}" for a, bs in graph.items() for b in bs)
    print("\n".join(e.replace(PACKAGE + ".", "") for e in edges))
    assert len(edges) > 20  # the graph really was read
    assert cycle(graph) is None


def test_the_target_imports_no_backend() -> None:
    graph = imports_between_modules()
    assert not {m for m in graph[f"{PACKAGE}.target"] if ".backends" in m}


def test_the_check_finds_the_cycle_of_issue_20() -> None:
    graph = imports_between_modules()
    graph[f"{PACKAGE}.backends.base"].add(f"{PACKAGE}.connect")  # connect -> backends -> base
    found = cycle(graph)
    assert found is not None and f"{PACKAGE}.backends" in found
