"""The Avro schema of the drain's payloads (``{"g": row, "s": seq, "p": "xxx…"}``, see
``bench.drain.fill_backlog``): the drain registers it for its ``-avro`` modes, whose relay
encodes with it, and the tally consumer decodes their records with it. One definition for
both sides, in a module light enough for the consumer process to import."""

from __future__ import annotations

from typing import Any

# long, not int: g and s are PostgreSQL integers, the relay maps JSON numbers to either.
DRAIN_AVRO_SCHEMA: dict[str, Any] = {
    "type": "record",
    "name": "DrainEvent",
    "namespace": "notify_outbox.bench",
    "fields": [
        {"name": "g", "type": "long"},
        {"name": "s", "type": "long"},
        {"name": "p", "type": "string"},
    ],
}
