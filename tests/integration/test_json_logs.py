"""`NOTIFY_OUTBOX_LOG_FORMAT=json` as users run it: every line of the relay's log is one JSON
object with time, level, logger, message and structured fields; secrets stay out."""

from __future__ import annotations

import json
import signal
from datetime import datetime

import asyncpg
import pytest

from tests.conftest import Services
from tests.support import RelayProcess

SECRET = "s3cr3t-Pa55-json"


def _objects(lines: list[str]) -> list[dict[str, object]]:
    docs = []
    for line in lines:
        doc = json.loads(line)  # every line, not only ours: aiokafka's and asyncpg's too
        assert isinstance(doc, dict), line
        for field in ("time", "level", "logger", "message"):
            assert field in doc, line
        assert (
            datetime.fromisoformat(str(doc["time"]).replace("Z", "+00:00")).utcoffset() is not None
        )
        docs.append(doc)
    return docs


def test_an_unreachable_database_is_logged_as_json_without_its_password(
    services: Services,
) -> None:
    dsn = f"postgresql://relay:{SECRET}@127.0.0.1:1/app"
    with RelayProcess(dsn, services.bootstrap, env={"NOTIFY_OUTBOX_LOG_FORMAT": "json"}) as relay:
        relay.wait_for_line("PostgreSQL not reachable")
        relay.signal(signal.SIGTERM)
        assert relay.wait(60) == 0, relay.output()
    assert relay.lines
    assert SECRET not in "\n".join(relay.lines)
    docs = _objects(relay.lines)
    unreachable = next(d for d in docs if "not reachable" in str(d["message"]))
    assert (unreachable["level"], unreachable["logger"]) == ("WARNING", "notify_outbox.relay")


@pytest.mark.anyio
async def test_a_dead_lettered_row_is_logged_with_its_fields(
    db_dsn: str, services: Services, topic: str
) -> None:
    env = {"NOTIFY_OUTBOX_LOG_FORMAT": "json"}
    with RelayProcess(db_dsn, services.bootstrap, env=env) as relay:
        relay.wait_ready()
        conn = await asyncpg.connect(db_dsn)
        try:
            row_id = await conn.fetchval(
                "INSERT INTO outbox (topic, key, headers) VALUES ($1, 'k', '{\"n\": 1}') "
                "RETURNING id",
                topic,
            )
        finally:
            await conn.close()
        line = relay.wait_for_line("dead-lettering row")
        relay.signal(signal.SIGTERM)
        assert relay.wait(60) == 0, relay.output()
    doc = json.loads(line)
    assert doc["level"] == "ERROR"
    assert (doc["row_id"], doc["topic"], doc["key"], doc["attempts"]) == (row_id, topic, "k", 1)
    assert "must have a string value" in str(doc["error"])
    _objects(relay.lines)
