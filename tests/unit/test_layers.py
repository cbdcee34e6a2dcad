"""The package's sub-packages import one way, down the layers, and never in a circle.

cli -> ops -> relay / inbox / producer / debezium -> pg / kafka -> core: a sub-package may
import its own modules and those of a lower layer, nothing beside or above it. Every import
counts, also those under ``TYPE_CHECKING`` and inside functions. The top-level modules are the
public faces (``notify_outbox`` and the re-exports kept at old module paths); no sub-package
imports them, except the CLI, which reads ``__version__``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "notify_outbox"

LAYERS = {
    "core": 0,
    "pg": 1,
    "kafka": 1,
    "relay": 2,
    "inbox": 2,
    "producer": 2,
    "debezium": 2,
    "ops": 3,
    "cli": 4,
}
#: Sub-packages allowed to import the top-level package itself (for ``__version__``).
MAY_IMPORT_ROOT = {"cli"}


def _modules() -> Iterator[tuple[str, Path]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        yield ".".join(parts), path


def _imports(module: str, path: Path) -> Iterator[tuple[str, int]]:
    """Absolute names of the notify_outbox modules (or packages) ``module`` imports."""
    is_package = path.name == "__init__.py"
    here = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            if node.module is None or target == "notify_outbox":
                # ``from . import x``: x may be a submodule (or a name of the package).
                for alias in node.names:
                    yield f"{target}.{alias.name}", node.lineno
            else:
                yield target, node.lineno


def _part(name: str) -> str | None:
    """The sub-package a module name belongs to; None for the top-level modules."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[1] in LAYERS:
        return parts[1]
    return None


def _edges() -> tuple[set[tuple[str, str]], list[str]]:
    edges: set[tuple[str, str]] = set()
    problems: list[str] = []
    for module, path in _modules():
        source = _part(module)
        if source is None:
            continue
        for target, line in _imports(module, path):
            if target != "notify_outbox" and not target.startswith("notify_outbox."):
                continue
            where = f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}"
            dest = _part(target)
            if dest is None:
                is_version = target in ("notify_outbox", "notify_outbox.__version__")
                if not (is_version and source in MAY_IMPORT_ROOT):
                    problems.append(f"{where}: a top-level module, not its home in a sub-package")
                continue
            if dest == source:
                continue
            edges.add((source, dest))
            if LAYERS[dest] >= LAYERS[source]:
                problems.append(
                    f"{where}: {source} (layer {LAYERS[source]}) may not import "
                    f"{dest} (layer {LAYERS[dest]})"
                )
    return edges, problems


def test_every_sub_package_has_a_layer() -> None:
    found = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert found == set(LAYERS)


def test_imports_go_down_the_layers() -> None:
    _, problems = _edges()
    assert problems == []


def test_no_circle_between_sub_packages() -> None:
    edges, _ = _edges()
    graph: dict[str, set[str]] = {p: set() for p in LAYERS}
    for a, b in edges:
        graph[a].add(b)
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        for nxt in sorted(graph[node]):
            if (circle := visit(nxt, [*path, node])) is not None:
                return circle
        done.add(node)
        return None

    circles = [c for p in sorted(graph) if (c := visit(p, [])) is not None]
    assert circles == []


def test_the_checker_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The parser resolves relative imports, ``from . import x`` and nested imports."""
    src = tmp_path / "notify_outbox" / "relay" / "x.py"
    src.parent.mkdir(parents=True)
    src.write_text(
        "from . import gate\n"
        "from .. import __version__\n"
        "from ..pg.store import A\n"
        "import notify_outbox.kafka.publisher\n"
        "if TYPE_CHECKING:\n"
        "    from notify_outbox.ops.metrics import B\n"
        "def f():\n"
        "    from notify_outbox.cli import app\n"
    )
    got = [name for name, _ in _imports("notify_outbox.relay.x", src)]
    assert got == [
        "notify_outbox.relay.gate",
        "notify_outbox.__version__",
        "notify_outbox.pg.store",
        "notify_outbox.kafka.publisher",
        "notify_outbox.ops.metrics",
        "notify_outbox.cli",
    ]
