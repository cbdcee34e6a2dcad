"""The bench's modules import each other without a circle, and define each helper once.

Every import counts, also those inside functions (the bench imports matplotlib-backed and
regime modules lazily) and under ``TYPE_CHECKING``: a lazy import that closes a circle is
still a circle to a reader following the code.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _modules() -> dict[str, ast.Module]:
    return {
        path.stem: ast.parse(path.read_text(), str(path))
        for path in sorted(BENCH.glob("*.py"))
        if path.stem not in ("__init__", "__main__")
    }


def _imports(tree: ast.Module, names: set[str]) -> Iterator[str]:
    """The bench modules one module imports (``bench.x``, ``from bench import x``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "bench" and len(parts) > 1 and parts[1] in names:
                    yield parts[1]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            parts = node.module.split(".")
            if parts[0] != "bench":
                continue
            if len(parts) > 1:
                if parts[1] in names:
                    yield parts[1]
            else:
                yield from (a.name for a in node.names if a.name in names)


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    names = set(modules)
    return {m: set(_imports(tree, names)) - {m} for m, tree in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return [*path[path.index(n) :], n]
            if n not in state and (found := visit(n)) is not None:
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)) is not None:
            return found
    return None


def test_the_bench_has_no_import_circle() -> None:
    graph = _graph()
    assert len(graph) > 10, "bench/ modules not found"
    cycle = _cycle(graph)
    assert cycle is None, "import circle in bench/: " + " -> ".join(cycle or [])


def test_the_cycle_check_finds_a_circle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def _helpers(tree: ast.Module) -> Iterator[str]:
    """The names of a module's module-level functions."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node.name


# A child process's entry point (``main``, ``run``), and the parts of a regime that its module
# fills in (``bench.regimes.Regime``): one per module by design.
_ONE_PER_MODULE = {
    *("main", "run", "analyse_cell"),
    *("arguments", "configure", "summarize", "problems", "markdown", "plot"),
}


def test_no_module_level_function_is_defined_twice_in_the_bench() -> None:
    seen: dict[str, list[str]] = {}
    for module, tree in _modules().items():
        for name in _helpers(tree):
            seen.setdefault(name, []).append(module)
    twice = {
        name: where
        for name, where in seen.items()
        if len(where) > 1 and name not in _ONE_PER_MODULE
    }
    assert not twice, f"defined in more than one bench module: {twice}"
