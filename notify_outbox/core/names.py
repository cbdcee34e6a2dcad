"""Validated, quoted database names for one outbox (schema, table, channel).

Every name that comes from settings passes through here before it reaches SQL: it must be a
plain lower-case identifier, and it is rendered double-quoted anyway. Values never take this
path; they always travel as query parameters.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass

from .errors import ConfigurationError

__all__ = ["OutboxNames", "validate_identifier"]

_IDENTIFIER = re.compile(r"[a-z_][a-z0-9_]*")
# PostgreSQL truncates identifiers longer than 63 bytes, silently. The table name is shorter
# still because derived names (the dead-letter table, indexes, the sequence) append suffixes.
_MAX_NAME = 63
_MAX_TABLE = 40


def validate_identifier(value: str, what: str, *, max_length: int = _MAX_NAME) -> str:
    """Return ``value`` if it is a safe lower-case identifier, else raise ConfigurationError."""
    if not isinstance(value, str) or not _IDENTIFIER.fullmatch(value):
        raise ConfigurationError(
            f"{what} must be a lower-case identifier: letters a-z, digits and underscores, "
            f"not starting with a digit (got {value!r})"
        )
    if len(value.encode()) > max_length:
        raise ConfigurationError(
            f"{what} is {len(value.encode())} bytes long; the limit is {max_length} bytes"
        )
    return value


def _quote(name: str) -> str:
    # Names are validated to [a-z0-9_], so quoting cannot be escaped; it is still done so that
    # reserved words such as "order" work as table names.
    return f'"{name}"'


@dataclass(frozen=True)
class OutboxNames:
    """The names of one outbox: schema, table and NOTIFY channel, validated on construction."""

    schema: str = "public"
    table: str = "outbox"
    channel: str = "notify_outbox"

    def __post_init__(self) -> None:
        validate_identifier(self.schema, "schema")
        validate_identifier(self.table, "table", max_length=_MAX_TABLE)
        validate_identifier(self.channel, "channel")

    @property
    def qualified_table(self) -> str:
        """The outbox table, schema-qualified and quoted."""
        return f"{_quote(self.schema)}.{_quote(self.table)}"

    @property
    def target(self) -> str:
        """A stable label for this outbox, used as the migration tracking key."""
        return f"{self.schema}.{self.table}"

    @property
    def lock_namespace(self) -> int:
        """First key of this outbox's advisory locks: a stable signed 32-bit number.

        Used as the first key of the two-key per-key ordering locks, and as the single bigint
        key of the migration lock. The two forms are separate key spaces in PostgreSQL.
        """
        n = zlib.crc32(f"notify_outbox:{self.target}".encode())
        return n - (1 << 32) if n >= (1 << 31) else n

    @property
    def claim_namespace(self) -> int:
        """First key of the two-key advisory locks a claim takes on keys (and on keyless rows):
        a number of its own, so that claims never wait on producers' per-key ordering locks."""
        n = zlib.crc32(f"notify_outbox_claim:{self.target}".encode())
        return n - (1 << 32) if n >= (1 << 31) else n

    @property
    def awake_namespace(self) -> int:
        """First key of the two-key advisory locks of the awake marker (migration 0006): the
        second key is an epoch number, so a relay that stops renewing the marker loses it."""
        n = zlib.crc32(f"notify_outbox_awake:{self.target}".encode())
        return n - (1 << 32) if n >= (1 << 31) else n

    @property
    def gate_key(self) -> int:
        """Bigint advisory key G of the gated notify: producers hold it shared until commit."""
        return (1 << 33) + self.lock_namespace

    @property
    def awake_key(self) -> int:
        """Bigint advisory key A of the gated notify of migrations 0002-0005 (held by an awake
        relay of that time; since 0006 the marker is ``awake_namespace`` with an epoch)."""
        return (2 << 33) + self.lock_namespace

    @property
    def eos_key(self) -> int:
        """Bigint advisory key that serializes exactly-once claims (migration 0007)."""
        return (3 << 33) + self.lock_namespace

    def substitutions(self) -> dict[str, str]:
        """Tokens that the SQL files use, mapped to their rendered text."""
        s, t = _quote(self.schema), self.table
        return {
            "@schema@": s,
            "@table@": self.qualified_table,
            "@dead_letter@": f"{s}.{_quote(t + '_dead_letter')}",
            "@migrations@": f"{s}.{_quote('notify_outbox_migrations')}",
            "@id_seq@": f"{s}.{_quote(t + '_id_seq')}",
            # Literal strings below are built from validated names only: no quote can occur.
            "@id_seq_literal@": f"'{s}.{_quote(t + '_id_seq')}'",
            "@channel_literal@": f"'{self.channel}'",
            # The notification's payload (migration 0008): which outbox has news.
            "@target_literal@": f"'{self.target}'",
            "@prefix@": t,
            "@config@": f"{s}.{_quote(t + '_config')}",
            "@eos_slot@": f"{s}.{_quote(t + '_eos_slot')}",
            "@eos_stamp@": f"{s}.{_quote(t + '_eos_stamp')}",
            "@lock_ns@": str(self.lock_namespace),
            "@claim_ns@": str(self.claim_namespace),
            "@gate_key@": str(self.gate_key),
            "@awake_key@": str(self.awake_key),
            "@awake_ns@": str(self.awake_namespace),
            "@eos_key@": str(self.eos_key),
        }

    # Tokens whose values do not depend on the schema's name (see migrations.verify).
    SCHEMA_INDEPENDENT = (
        "@lock_ns@",
        "@claim_ns@",
        "@gate_key@",
        "@awake_key@",
        "@awake_ns@",
        "@eos_key@",
        "@channel_literal@",
        # Names the real outbox in the scratch copy too: the payload is data, not a reference.
        "@target_literal@",
    )
