"""`notify-outbox dead-letters list|show|requeue|purge`, the dead-letter retention of the relay,
and a bounded `status`, against a real PostgreSQL (and Kafka where events travel)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Coroutine
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import anyio
import asyncpg
import pytest

from notify_outbox import OutboxNames, OutboxSettings, Relay
from notify_outbox.cli.app import main
from notify_outbox.pg.deadletters import DeadLetterFilter, requeue
from tests.conftest import Services
from tests.support import ROOT, consume, create_topics, dsn_with_user, header, topic_total

T = TypeVar("T")
NOW = datetime.now(UTC)


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


async def _fetch(dsn: str, sql: str, *args: Any) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(dsn)
    try:
        return list(await conn.fetch(sql, *args))
    finally:
        await conn.close()


def fetch(dsn: str, sql: str, *args: Any) -> list[asyncpg.Record]:
    return run(_fetch(dsn, sql, *args))


def seed(dsn: str, *letters: dict[str, Any]) -> None:
    """Dead letters as the relay writes them; each dict overrides the defaults."""
    rows = []
    for n, given in enumerate(letters):
        row: dict[str, Any] = {
            "id": 100 + n,
            "event_id": uuid.uuid4(),
            "topic": "orders",
            "key": None,
            "payload": json.dumps({"n": n}),
            "headers": None,
            "idempotency_key": None,
            "attempts": 10,
            "error": "topic 'orders' does not exist in Kafka (after 10 attempts)",
            "dead_lettered_at": NOW - timedelta(minutes=5),
        } | given
        rows.append(row)
    fetch(
        dsn,
        "INSERT INTO outbox_dead_letter (id, event_id, topic, key, payload, headers, "
        "idempotency_key, created_at, attempts, error, dead_lettered_at) "
        "SELECT r.id, r.event_id, r.topic, r.key, r.payload::jsonb, r.headers::jsonb, "
        "r.idempotency_key, r.dead_lettered_at - interval '1 hour', r.attempts, r.error, "
        "r.dead_lettered_at "
        "FROM unnest($1::bigint[], $2::uuid[], $3::text[], $4::text[], $5::text[], $6::text[], "
        "$7::text[], $8::int[], $9::text[], $10::timestamptz[]) "
        "AS r(id, event_id, topic, key, payload, headers, idempotency_key, attempts, error, "
        "dead_lettered_at)",
        *([r[c] for r in rows] for c in rows[0]),
    )


def cli(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, dsn: str, *args: str
) -> tuple[int, str, str]:
    """The command in-process (fast); returns exit code, stdout, stderr."""
    monkeypatch.setenv("NOTIFY_OUTBOX_DSN", dsn)
    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def cli_process(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The command as users run it, for what only a process shows (argparse's exits)."""
    return subprocess.run(
        [sys.executable, "-m", "notify_outbox", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("NOTIFY_OUTBOX_")},
            "PYTHONPATH": str(ROOT),
            **env,
        },
        timeout=60,
    )


# --- list and show ----------------------------------------------------------------------------


def test_list_filters_by_topic_key_error_and_time_as_table_or_json(
    db_dsn: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    seed(
        db_dsn,
        {"id": 1, "key": "k1", "dead_lettered_at": NOW - timedelta(days=9)},
        {"id": 2, "key": "k2", "error": "malformed event: header 'n' must have a string value"},
        {"id": 3, "topic": "payments", "key": "k1", "error": "MessageSizeTooLargeError: big"},
        {"id": 4, "topic": "payments", "dead_lettered_at": NOW - timedelta(hours=3)},
    )

    def ids(*flags: str) -> list[int]:
        code, out, err = cli(capsys, monkeypatch, db_dsn, "dead-letters", "list", *flags)
        assert code == 0, err
        return [int(line.split()[0]) for line in out.splitlines()[1:-1]]

    assert ids() == [1, 2, 3, 4]
    assert ids("--topic", "payments") == [3, 4]
    assert ids("--key", "k1") == [1, 3]
    assert ids("--key", "k1", "--topic", "orders") == [1]
    assert ids("--error", "HEADER 'N'") == [2]  # any case
    assert ids("--error", "%") == []  # text, not a LIKE pattern
    assert ids("--since", "1d") == [2, 3, 4]
    assert ids("--until", "2h") == [1, 4]
    assert ids("--since", (NOW - timedelta(hours=4)).isoformat(), "--until", "2h") == [4]
    assert ids("--topic", "orders' OR '1'='1") == []  # a value, never SQL

    code, out, _ = cli(capsys, monkeypatch, db_dsn, "dead-letters", "list", "--limit", "2")
    lines = out.splitlines()
    assert lines[0].split() == ["ID", "DEAD-LETTERED", "(UTC)", "TOPIC", "KEY", "ATTEMPTS", "ERROR"]
    assert lines[-1] == "2 shown of 4 matching; next page: --after-id 2"
    code, out, _ = cli(capsys, monkeypatch, db_dsn, "dead-letters", "list", "--after-id", "2")
    assert [int(line.split()[0]) for line in out.splitlines()[1:-1]] == [3, 4]

    code, out, _ = cli(
        capsys, monkeypatch, db_dsn, "dead-letters", "list", "--format", "json", "--key", "k1"
    )
    assert code == 0
    docs = [json.loads(line) for line in out.splitlines()]
    assert [d["id"] for d in docs] == [1, 3]
    assert docs[0]["payload"] == {"n": 0}
    assert docs[1]["error"] == "MessageSizeTooLargeError: big"
    assert datetime.fromisoformat(docs[0]["dead_lettered_at"]) < NOW - timedelta(days=8)

    code, out, _ = cli(capsys, monkeypatch, db_dsn, "dead-letters", "list", "--topic", "none")
    assert (code, out) == (0, "no dead letters match\n")


def test_show_prints_one_dead_letter_in_full(
    db_dsn: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    event_id = uuid.uuid4()
    seed(
        db_dsn,
        {"id": 7, "event_id": event_id, "key": "order-42", "headers": '{"trace": "abc"}'},
    )
    code, out, _ = cli(capsys, monkeypatch, db_dsn, "dead-letters", "show", "7")
    assert code == 0
    assert out.startswith("dead letter 7\n")
    assert f"event id:         {event_id}" in out
    assert "key:              order-42" in out
    assert '{"trace": "abc"}' in out
    assert "after 10 attempts" in out
    code, out, _ = cli(capsys, monkeypatch, db_dsn, "dead-letters", "show", "7", "--format", "json")
    doc = json.loads(out)
    assert (doc["event_id"], doc["headers"], doc["payload"]) == (
        str(event_id),
        {"trace": "abc"},
        {"n": 0},
    )
    code, _, err = cli(capsys, monkeypatch, db_dsn, "dead-letters", "show", "8")
    assert code == 1
    assert err == "notify-outbox: no dead letter with id 8\n"


# --- requeue ----------------------------------------------------------------------------------


def test_requeue_puts_dead_letters_at_the_end_of_their_key_in_their_own_order(
    db_dsn: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three dead letters of key k (and one of key j) go back behind k's pending row, in
    their dead-letter order, with their event ids, payloads and headers, attempts reset."""
    seed(
        db_dsn,
        {"id": 30, "key": "k", "headers": '{"h": "1"}'},
        {"id": 10, "key": "k"},
        {"id": 20, "key": "k"},
        {"id": 15, "key": "j"},
    )
    pending = fetch(
        db_dsn, "INSERT INTO outbox (topic, key, payload) VALUES ('orders', 'k', '1') RETURNING id"
    )[0]["id"]
    dead = {
        r["id"]: r
        for r in fetch(db_dsn, "SELECT id, event_id, payload, headers FROM outbox_dead_letter")
    }

    code, out, _ = cli(
        capsys, monkeypatch, db_dsn, "dead-letters", "requeue", "--key", "k", "--dry-run"
    )
    assert code == 0
    assert out.splitlines()[-1] == "dry run: 3 dead letters would be requeued; nothing changed"
    assert [line.split()[4] for line in out.splitlines()[:-1]] == ["10", "20", "30"]
    assert len(fetch(db_dsn, "SELECT 1 FROM outbox_dead_letter")) == 4

    code, out, _ = cli(capsys, monkeypatch, db_dsn, "dead-letters", "requeue", "--key", "k")
    assert code == 0, out
    assert out.splitlines()[-1] == "requeued 3 dead letters"
    moved = fetch(
        db_dsn,
        "SELECT id, event_id, payload, headers, attempts, next_attempt_at, last_error "
        "FROM outbox WHERE key = 'k' AND id <> $1 ORDER BY id",
        pending,
    )
    assert [r["event_id"] for r in moved] == [dead[i]["event_id"] for i in (10, 20, 30)]
    assert all(r["id"] > pending for r in moved), "a requeued row must go behind pending ones"
    assert [r["payload"] for r in moved] == [dead[i]["payload"] for i in (10, 20, 30)]
    assert moved[2]["headers"] == '{"h": "1"}'
    assert {(r["attempts"], r["next_attempt_at"], r["last_error"]) for r in moved} == {
        (0, None, None)
    }
    for line, row in zip(out.splitlines()[:-1], moved, strict=True):
        assert f"as outbox row {row['id']} " in line
        assert str(row["event_id"]) in line
    assert [r["id"] for r in fetch(db_dsn, "SELECT id FROM outbox_dead_letter")] == [15]

    # The old command is the same thing by id.
    code, out, _ = cli(capsys, monkeypatch, db_dsn, "requeue", "15")
    assert (code, out.splitlines()[-1]) == (0, "requeued 1 dead letter")
    assert not fetch(db_dsn, "SELECT 1 FROM outbox_dead_letter")


def test_requeue_by_id_reports_what_it_could_not_move(
    db_dsn: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dead letter whose idempotency key a new outbox row holds stays a dead letter (its
    event would otherwise be sent twice under two ids, or the move would fail); an unknown id
    is named. Both make the exit code 1."""
    seed(db_dsn, {"id": 1, "idempotency_key": "pay-1"}, {"id": 2})
    fetch(db_dsn, "INSERT INTO outbox (topic, idempotency_key) VALUES ('orders', 'pay-1')")
    code, out, _ = cli(capsys, monkeypatch, db_dsn, "dead-letters", "requeue", "1", "2", "3")
    assert code == 1
    lines = out.splitlines()
    assert "skipped dead letter 1: idempotency key 'pay-1' is held by a row in the outbox" in lines
    assert "skipped dead letter 3: not found" in lines
    assert lines[-1] == "requeued 1 dead letter; 2 skipped"
    assert [r["id"] for r in fetch(db_dsn, "SELECT id FROM outbox_dead_letter")] == [1]


def test_requeue_needs_ids_a_filter_or_all(
    db_dsn: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    seed(db_dsn, {"id": 1}, {"id": 2, "topic": "payments"})
    code, _, err = cli(capsys, monkeypatch, db_dsn, "dead-letters", "requeue")
    assert code == 2
    assert err.count("\n") == 1
    assert "--all" in err
    code, _, err = cli(capsys, monkeypatch, db_dsn, "dead-letters", "requeue", "--all", "1")
    assert code == 2
    assert len(fetch(db_dsn, "SELECT 1 FROM outbox_dead_letter")) == 2
    code, out, _ = cli(capsys, monkeypatch, db_dsn, "dead-letters", "requeue", "--all")
    assert (code, out.splitlines()[-1]) == (0, "requeued 2 dead letters")
    code, out, _ = cli(capsys, monkeypatch, db_dsn, "dead-letters", "requeue", "--all")
    assert (code, out) == (0, "no dead letters match: nothing to requeue\n")


@pytest.mark.anyio
async def test_concurrent_requeues_move_every_dead_letter_exactly_once(db_dsn: str) -> None:
    """Two operators requeue the same 300 dead letters at once: each row moves once (one
    statement deletes and inserts), none is lost, none is doubled."""
    conn = await asyncpg.connect(db_dsn)
    try:
        await conn.execute(
            "INSERT INTO outbox_dead_letter (id, event_id, topic, key, created_at, attempts, "
            "error) SELECT i, gen_random_uuid(), 'orders', 'k' || (i % 7), now(), 1, 'e' "
            "FROM generate_series(1, 300) AS i"
        )
        events = {r[0] for r in await conn.fetch("SELECT event_id FROM outbox_dead_letter")}
    finally:
        await conn.close()
    names = OutboxNames()

    async def operator() -> int:
        c = await asyncpg.connect(db_dsn)
        try:
            results = await requeue(c, names, DeadLetterFilter(topic="orders"))
            return sum(r.outbox_id is not None for r in results)
        finally:
            await c.close()

    with anyio.fail_after(60):
        moved = await asyncio.gather(operator(), operator())
    assert sum(moved) == 300
    conn = await asyncpg.connect(db_dsn)
    try:
        rows = await conn.fetch("SELECT event_id FROM outbox")
        assert await conn.fetchval("SELECT count(*) FROM outbox_dead_letter") == 0
        # Per key, ids follow the dead letters' order.
        keys = await conn.fetch(
            "SELECT key, array_agg(event_id ORDER BY id) AS e FROM outbox GROUP BY key"
        )
    finally:
        await conn.close()
    assert len(rows) == 300
    assert {r[0] for r in rows} == events
    assert len(keys) == 7


@pytest.mark.anyio
async def test_a_dead_letter_requeued_once_its_topic_exists_reaches_kafka_with_its_event_id(
    db_dsn: str, services: Services, topic: str
) -> None:
    """The whole story: a row for a topic that does not exist yet dies (max_attempts) while
    its key's later row and other keys go on; the topic is created; `dead-letters requeue
    --error` sends it, with its event id, after the key's later row."""
    missing = f"late-{uuid.uuid4().hex[:8]}"
    settings = OutboxSettings(
        dsn=db_dsn,
        kafka_bootstrap_servers=services.bootstrap,
        workers=2,
        poll_interval=0.5,
        # Not 1: a topic created a moment ago can still be unknown to the broker's metadata
        # for an instant, and must not be dead-lettered for that.
        max_attempts=3,
        retry_base_delay=0.2,
    )
    conn = await asyncpg.connect(db_dsn)
    try:
        async with Relay(settings) as relay:
            dead_event = await conn.fetchval(
                "INSERT INTO outbox (topic, key, payload) VALUES ($1, 'k', '1') RETURNING event_id",
                missing,
            )
            await conn.execute(
                "INSERT INTO outbox (topic, key, payload) VALUES ($1, 'k', '2'), ($1, 'j', '3')",
                topic,
            )
            with anyio.fail_after(60):
                await relay.events.wait_for("dead_lettered", 1)
            await consume(services.bootstrap, topic, expect=2, within=60)
            await create_topics(services.bootstrap, [missing], partitions=1)
            result = await anyio.to_thread.run_sync(
                lambda: cli_process(
                    "dead-letters",
                    "requeue",
                    "--error",
                    "does not exist",
                    env={"NOTIFY_OUTBOX_DSN": db_dsn},
                )
            )
            assert result.returncode == 0, result.stdout + result.stderr
            assert result.stdout.splitlines()[-1] == "requeued 1 dead letter"
            records, _ = await consume(services.bootstrap, missing, expect=1, within=60)
        total = await topic_total(services.bootstrap, missing)  # the relay stopped
    finally:
        await conn.close()
    assert total == 1
    assert header(records[0], "outbox-event-id") == str(dead_event)
    assert records[0].key == b"k"
    assert records[0].value == b"1"


# --- purge and retention ----------------------------------------------------------------------


def test_purge_older_than_with_filters_and_dry_run(
    db_dsn: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    seed(
        db_dsn,
        {"id": 1, "dead_lettered_at": NOW - timedelta(days=10)},
        {"id": 2, "dead_lettered_at": NOW - timedelta(days=8), "topic": "payments"},
        {"id": 3, "dead_lettered_at": NOW - timedelta(days=1)},
    )
    code, out, _ = cli(
        capsys, monkeypatch, db_dsn, "dead-letters", "purge", "--older-than", "7d", "--dry-run"
    )
    assert (code, out) == (
        0,
        "dry run: 2 dead letters dead-lettered more than 7d ago would be purged; nothing changed\n",
    )
    code, out, _ = cli(
        capsys,
        monkeypatch,
        db_dsn,
        "dead-letters",
        "purge",
        "--older-than",
        "P7D",
        "--topic",
        "payments",
    )
    assert (code, out) == (0, "purged 1 dead letter dead-lettered more than 7d ago\n")
    code, out, _ = cli(capsys, monkeypatch, db_dsn, "dead-letters", "purge", "--older-than", "7d")
    assert (code, out) == (0, "purged 1 dead letter dead-lettered more than 7d ago\n")
    assert [r["id"] for r in fetch(db_dsn, "SELECT id FROM outbox_dead_letter")] == [3]


@pytest.mark.anyio
async def test_the_relay_expires_dead_letters_after_dead_letter_retention(
    db_dsn: str, services: Services, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTIFY_OUTBOX_DEAD_LETTER_RETENTION=1h (a duration) and published rows deleted on
    publish: the relay's cleanup still runs, for the dead letters, in batches."""
    conn = await asyncpg.connect(db_dsn)
    try:
        await conn.execute(
            "INSERT INTO outbox_dead_letter (id, event_id, topic, created_at, attempts, error, "
            "dead_lettered_at) SELECT i, gen_random_uuid(), 'orders', now(), 1, 'e', "
            "now() - CASE WHEN i <= 25 THEN interval '2 hours' ELSE interval '10 minutes' END "
            "FROM generate_series(1, 30) AS i"
        )
        monkeypatch.setenv("NOTIFY_OUTBOX_DEAD_LETTER_RETENTION", "1h")
        settings = OutboxSettings(
            dsn=db_dsn,
            kafka_bootstrap_servers=services.bootstrap,
            workers=1,
            cleanup_interval=0.1,
            cleanup_batch=10,
        )
        assert settings.dead_letter_retention == 3600
        async with Relay(settings) as relay:
            with anyio.fail_after(30):
                await relay.events.wait_for("cleanup_dead_letters", 25)
        left = await conn.fetch("SELECT id FROM outbox_dead_letter ORDER BY id")
    finally:
        await conn.close()
    assert relay.events.counts["cleanup_dead_letters"] == 25
    assert [r["id"] for r in left] == list(range(26, 31))


def test_a_bad_retention_setting_is_one_line_exit_2(services: Services) -> None:
    result = cli_process(
        "run",
        env={
            "NOTIFY_OUTBOX_DSN": "postgresql://u:pw@127.0.0.1:1/db",
            "NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS": services.bootstrap,
            "NOTIFY_OUTBOX_DEAD_LETTER_RETENTION": "a week",
        },
    )
    assert result.returncode == 2, result.stderr
    assert "NOTIFY_OUTBOX_DEAD_LETTER_RETENTION: invalid duration" in result.stderr
    assert "Traceback" not in result.stderr


# --- bad input, status ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["dead-letters", "list", "--colour", "red"], "unrecognized arguments: --colour red"),
        (["dead-letters", "list", "--since", "yesterday"], "--since: invalid time 'yesterday'"),
        (["dead-letters", "list", "--until", "2026-13-40"], "--until: invalid time"),
        (["dead-letters", "list", "--format", "yaml"], "invalid choice: 'yaml'"),
        (["dead-letters", "show", "seven"], "invalid int value: 'seven'"),
        (["dead-letters", "purge"], "the following arguments are required: --older-than"),
        (["dead-letters", "purge", "--older-than", "soon"], "--older-than: invalid duration"),
        (["dead-letters", "frobnicate"], "invalid choice: 'frobnicate'"),
        (["dead-letters", "requeue", "--key", "k", "--all"], "--all cannot be combined"),
    ],
)
def test_bad_input_is_one_clear_line_and_exit_2(args: list[str], says: str) -> None:
    result = cli_process(*args, env={"NOTIFY_OUTBOX_DSN": "postgresql://u:pw@127.0.0.1:1/db"})
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert says in result.stderr
    assert result.stdout == ""


def test_status_counts_are_bounded_and_say_so(
    db_dsn: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    fetch(
        db_dsn,
        "INSERT INTO outbox (topic, payload, published_at, next_attempt_at, attempts, "
        "created_at) "
        "SELECT 'orders', '{}', CASE WHEN i <= 30 THEN now() END, "
        "CASE WHEN i > 45 THEN now() + interval '1 hour' END, CASE WHEN i > 45 THEN 1 ELSE 0 END, "
        # The oldest pending row (the first after the published ones) is an hour old.
        "CASE WHEN i = 31 THEN now() - interval '1 hour' ELSE now() END "
        "FROM generate_series(1, 50) AS i",
    )
    seed(db_dsn, {"id": 1}, {"id": 2})
    code, out, _ = cli(capsys, monkeypatch, db_dsn, "status")
    doc = json.loads(out)
    assert code == 0
    assert {k: doc[k] for k in ("pending", "retrying", "published_kept", "dead_lettered")} == {
        "pending": 20,
        "retrying": 5,
        "published_kept": 30,
        "dead_lettered": 2,
    }
    assert 3600 <= doc["oldest_pending_seconds"] < 3600 + 300, doc
    assert (doc["count_limit"], doc["capped"]) == (100_000, [])
    code, out, _ = cli(capsys, monkeypatch, db_dsn, "status", "--count-limit", "10")
    doc = json.loads(out)
    assert (doc["pending"], doc["published_kept"], doc["retrying"]) == (10, 10, 5)
    assert doc["capped"] == ["pending", "published_kept"]


@pytest.mark.parametrize(
    "command",
    [
        ["dead-letters"],
        ["dead-letters", "list"],
        ["dead-letters", "show"],
        ["dead-letters", "requeue"],
        ["dead-letters", "purge"],
        ["replay"],
    ],
)
def test_every_new_command_has_help(command: list[str]) -> None:
    result = cli_process(*command, "--help", env={})
    assert result.returncode == 0
    assert result.stdout.startswith("usage: notify-outbox " + " ".join(command))


def test_the_relay_roles_grants_are_enough_for_every_dead_letter_command(
    db_dsn: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`sql --grants` gives the relay role what list, show, requeue, purge and status need
    (requeue draws ids from the sequence and reads the outbox for idempotency keys)."""
    role = f"relay_{uuid.uuid4().hex[:8]}"
    app = f"app_{uuid.uuid4().hex[:8]}"
    code, grants, _ = cli(
        capsys, monkeypatch, db_dsn, "sql", "--grants", "--relay-role", role, "--app-role", app
    )
    assert code == 0
    fetch(db_dsn, f"CREATE ROLE {role} LOGIN PASSWORD 'relay-pw'")
    fetch(db_dsn, f"CREATE ROLE {app}")
    try:
        run(_execute(db_dsn, grants))
        relay_dsn = dsn_with_user(db_dsn, role, "relay-pw")
        seed(db_dsn, {"id": 1, "key": "k"}, {"id": 2, "dead_lettered_at": NOW - timedelta(days=9)})
        for args, expected in [
            (["dead-letters", "list"], "2 shown of 2 matching"),
            (["dead-letters", "show", "1"], "dead letter 1"),
            (["dead-letters", "requeue", "--key", "k"], "requeued 1 dead letter"),
            (["dead-letters", "purge", "--older-than", "7d"], "purged 1 dead letter"),
            (["status"], '"dead_lettered": 0'),
        ]:
            code, out, err = cli(capsys, monkeypatch, relay_dsn, *args)
            assert code == 0, f"{args}: {err}"
            assert expected in out, out
    finally:
        for name in (role, app):
            fetch(db_dsn, f"DROP OWNED BY {name}")
            fetch(db_dsn, f"DROP ROLE {name}")


async def _execute(dsn: str, sql: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()
