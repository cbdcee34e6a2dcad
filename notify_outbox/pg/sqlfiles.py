"""Loads the SQL files (migrations and named queries) and renders their name tokens.

The files live in the top-level ``sql/`` folder of the source tree and inside the package in a
built wheel; both places are looked up so that a source checkout and an installed wheel behave
the same.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Protocol

from notify_outbox.core.names import OutboxNames

__all__ = ["Migration", "Queries", "SqlNames", "load_migrations", "render_queries", "sql_dir"]

_MIGRATION_FILE = re.compile(r"(\d{4})_([a-z0-9_]+)\.sql")
_QUERY_NAME = re.compile(r"^-- name: ([a-z_]+)\s*$", re.MULTILINE)


@cache
def sql_dir() -> Path:
    """The folder holding ``migrations/`` and ``queries.sql``."""
    packaged = resources.files("notify_outbox") / "sql"
    if packaged.is_dir():
        return Path(str(packaged))
    source = Path(__file__).resolve().parents[2] / "sql"
    if source.is_dir():
        return source
    raise FileNotFoundError(  # pragma: no cover - a broken install
        "notify-outbox SQL files not found: the package is incomplete; reinstall it"
    )


class SqlNames(Protocol):
    """Names that SQL files are rendered with (``OutboxNames``, ``InboxNames``)."""

    def substitutions(self) -> dict[str, str]:
        """Tokens mapped to their rendered text."""
        ...


def render(text: str, names: SqlNames) -> str:
    """Replace the name tokens of ``text`` by the quoted names of one outbox (or inbox)."""
    for token, value in names.substitutions().items():
        text = text.replace(token, value)
    leftover = re.search(r"@[a-z_]+@", text)
    if leftover:  # pragma: no cover - a typo in a shipped SQL file
        raise ValueError(f"unknown token {leftover.group(0)} in SQL")
    return text


@dataclass(frozen=True)
class Migration:
    """One numbered migration file."""

    version: int
    name: str
    template: str

    def render(self, names: SqlNames) -> str:
        """The migration's SQL for one outbox (or inbox)."""
        return render(self.template, names)


@cache
def load_migrations(folder: str = "migrations") -> tuple[Migration, ...]:
    """Every shipped migration of one track (a folder of ``sql/``), in version order."""
    found = []
    for path in sorted((sql_dir() / folder).glob("*.sql")):
        m = _MIGRATION_FILE.fullmatch(path.name)
        if not m:
            raise ValueError(f"migration file {path.name} is not named NNNN_name.sql")
        found.append(Migration(int(m.group(1)), m.group(2), path.read_text(encoding="utf-8")))
    versions = [m.version for m in found]
    if versions != list(range(1, len(found) + 1)):
        raise ValueError(f"migration versions must be 1..n without gaps, found {versions}")
    return tuple(found)


@cache
def _query_templates(file: str = "queries.sql") -> dict[str, str]:
    text = (sql_dir() / file).read_text(encoding="utf-8")
    parts = _QUERY_NAME.split(text)
    # parts = [preamble, name1, body1, name2, body2, ...]
    return {name: body.strip() for name, body in zip(parts[1::2], parts[2::2], strict=True)}


def render_queries(file: str, names: SqlNames) -> dict[str, str]:
    """The named queries of one file of ``sql/`` (such as ``inbox_queries.sql``), rendered."""
    return {k: render(v, names) for k, v in _query_templates(file).items()}


class Queries:
    """The named runtime queries, rendered for one outbox."""

    def __init__(self, names: OutboxNames) -> None:
        self.names = names
        self._rendered = render_queries("queries.sql", names)

    def __getitem__(self, name: str) -> str:
        return self._rendered[name]
