"""The relay against a secured Kafka broker (issue #33, part 1): SASL_SSL with SCRAM-SHA-512,
PLAIN or OAUTHBEARER, mutual TLS, ACLs enforced by the standard authorizer, certificate
verification on. Only the documented settings (``NOTIFY_OUTBOX_KAFKA_*``) are used, and the
relay's own token provider hook for OAUTHBEARER.
"""

from __future__ import annotations

import collections
import json
import logging
from typing import Any

import anyio
import asyncpg
import pytest

from notify_outbox import OutboxSettings, Relay
from notify_outbox.core.errors import ConfigurationError
from notify_outbox.kafka.publisher import KafkaPublisher
from tests.secured_kafka import Client, SecuredKafka, unsecured_token
from tests.support import RelayProcess, logged

pytestmark = pytest.mark.anyio

ROWS = 200
KEYS = 5
ISSUE_33 = "issue #33: the relay does not do this yet"


def relay_settings(db_dsn: str, kafka: SecuredKafka, client: Client, **kw: Any) -> OutboxSettings:
    fields: dict[str, Any] = {
        "dsn": db_dsn,
        "workers": 2,
        "poll_interval": 30.0,  # long: delivery must come from the notifications
        **kafka.relay_settings(client),
    }
    fields.update(kw)
    return OutboxSettings(**fields)


async def insert_rows(conn: asyncpg.Connection, topic: str, count: int, *, key: str = "k") -> None:
    """``count`` rows in one statement (so in id order): keys ``<key>0..<key>4``, payload
    ``{"n": 1..count}``."""
    await conn.execute(
        "INSERT INTO outbox (topic, key, payload) "
        f"SELECT $1, $2 || (n % {KEYS}), jsonb_build_object('n', n) "
        "FROM generate_series(1, $3::int) AS n",
        topic,
        key,
        count,
    )


@pytest.mark.parametrize("client", ["scram", "plain", "oauth", "mtls"])
async def test_relay_publishes_to_the_secured_broker(
    db_dsn: str, secured_kafka: SecuredKafka, client: Client
) -> None:
    """SCRAM-SHA-512, PLAIN and OAUTHBEARER (tokens from the provider the settings name) over
    SASL_SSL, and a client certificate (its key encrypted,
    with kafka_ssl_password) over mutual TLS; the broker's certificate verified against the
    stack's CA each time. The relay's principal may write and describe the topic, nothing
    else. Every row arrives once, each key's rows in order, and the rows are marked
    published (deleted: keep_published is 0 by default)."""
    kafka = secured_kafka
    topic = await kafka.create_topic(client)
    await kafka.acl(kafka.principal(client), topic, "WRITE", "DESCRIBE")
    conn = await asyncpg.connect(db_dsn)
    try:
        # Bounded: a relay that cannot connect waits at the start forever.
        with anyio.fail_after(60):
            async with Relay(relay_settings(db_dsn, kafka, client)):
                await insert_rows(conn, topic, ROWS)
                records, total = await kafka.consume(topic, expect=ROWS)
        # A graceful stop leaves no published row unmarked.
        pending = await conn.fetchval("SELECT count(*) FROM outbox")
    finally:
        await conn.close()
    assert pending == 0
    assert total == ROWS
    per_key: dict[bytes | None, list[int]] = collections.defaultdict(list)
    for record in sorted(records, key=lambda r: (r.partition, r.offset)):
        per_key[record.key].append(json.loads(record.value or b"")["n"])
    assert len(per_key) == KEYS
    for key, numbers in per_key.items():
        assert numbers == sorted(numbers), f"key {key!r} out of order"
    assert sorted(n for numbers in per_key.values() for n in numbers) == list(range(1, ROWS + 1))


async def test_rows_for_a_topic_the_relay_may_not_write_are_dead_lettered_as_unauthorized(
    db_dsn: str, secured_kafka: SecuredKafka
) -> None:
    """The relay may describe the topic but not write to it (an ACL allows DESCRIBE only):
    its rows are retried, then dead-lettered with the broker's answer,
    TopicAuthorizationFailedError, while rows for a topic it may write arrive; a refusal
    neither replaces the producer nor pauses the other topics (issue #33)."""
    kafka = secured_kafka
    allowed = await kafka.create_topic("allowed")
    denied = await kafka.create_topic("denied")
    principal = kafka.principal("scram")
    await kafka.acl(principal, allowed, "WRITE", "DESCRIBE")
    await kafka.acl(principal, denied, "DESCRIBE")
    settings = relay_settings(
        db_dsn,
        kafka,
        "scram",
        max_attempts=3,
        retry_base_delay=0.05,
        retry_max_delay=0.1,
        poll_interval=0.2,  # retries become due between notifications
    )
    conn = await asyncpg.connect(db_dsn)
    try:
        with (
            logged("notify_outbox.publisher", "replacing the producer") as replaced,
            anyio.fail_after(60),
        ):
            async with Relay(settings) as relay:
                await insert_rows(conn, denied, 3, key="d")
                await insert_rows(conn, allowed, 20, key="a")
                await relay.events.wait_for("dead_lettered", 3)
                _, total = await kafka.consume(allowed, expect=20)
        dead = await conn.fetch("SELECT topic, key, error, attempts FROM outbox_dead_letter")
        pending = await conn.fetchval("SELECT count(*) FROM outbox")
    finally:
        await conn.close()
    assert not replaced.is_set()
    assert relay.events.counts["kafka_unavailable"] == 0
    assert total == 20
    assert pending == 0
    assert {r["key"] for r in dead} == {f"d{n % KEYS}" for n in (1, 2, 3)}
    for row in dead:
        assert row["topic"] == denied
        assert row["attempts"] == 3
        assert "TopicAuthorizationFailed" in row["error"], row["error"]


async def test_rows_for_a_topic_the_relay_may_not_describe_are_dead_lettered_as_unauthorized(
    db_dsn: str, secured_kafka: SecuredKafka
) -> None:
    """No ACL at all on the topic: the broker answers its metadata with
    TOPIC_AUTHORIZATION_FAILED. The issue asks for the true reason in the dead letter;
    today the relay writes "topic ... does not exist in Kafka"."""
    kafka = secured_kafka
    allowed = await kafka.create_topic("allowed")
    hidden = await kafka.create_topic("hidden")
    # WRITE on some topic is what lets the idempotent producer start at all (Kafka >= 3.0
    # grants IDEMPOTENT_WRITE with it): without, it fails with ClusterAuthorizationFailed.
    await kafka.acl(kafka.principal("scram"), allowed, "WRITE", "DESCRIBE")
    settings = relay_settings(
        db_dsn,
        kafka,
        "scram",
        max_attempts=2,
        retry_base_delay=0.05,
        retry_max_delay=0.1,
        poll_interval=0.2,
    )
    conn = await asyncpg.connect(db_dsn)
    try:
        with anyio.fail_after(60):
            async with Relay(settings) as relay:
                await insert_rows(conn, hidden, 1, key="h")
                await relay.events.wait_for("dead_lettered", 1)
        error = await conn.fetchval("SELECT error FROM outbox_dead_letter")
    finally:
        await conn.close()
    assert "authoriz" in error.lower(), error


BAD_CONNECTIONS = ["wrong_password", "unknown_ca", "hostname_mismatch"]
# What aiokafka's own log line says in each case.
CAUSES = {
    "wrong_password": "SaslAuthenticationFailed",
    "unknown_ca": "CERTIFICATE_VERIFY_FAILED",
    "hostname_mismatch": "IP address mismatch",
}


def bad_relay_env(kafka: SecuredKafka, case: str) -> tuple[dict[str, str], str]:
    """The environment of a relay that cannot connect, and the secret it must never log."""
    env = kafka.relay_env("scram")
    secret = env["NOTIFY_OUTBOX_KAFKA_SASL_PASSWORD"]
    if case == "wrong_password":
        secret = "not-the-password-0123456789"
        env["NOTIFY_OUTBOX_KAFKA_SASL_PASSWORD"] = secret
    elif case == "unknown_ca":
        env["NOTIFY_OUTBOX_KAFKA_SSL_CAFILE"] = str(kafka.broker.unknown_ca_file)
    else:  # a listener whose certificate (from the right CA) names another host
        env["NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS"] = kafka.broker.mismatch_bootstrap
    return env, secret


async def test_an_embedded_relay_takes_its_oauth_tokens_from_a_function(
    db_dsn: str, secured_kafka: SecuredKafka
) -> None:
    """``Relay(kafka_token_provider=...)``: an async function in the application's code, no
    setting naming it; the broker authenticates its token's subject."""
    kafka = secured_kafka
    topic = await kafka.create_topic("oauth-fn")
    await kafka.acl(kafka.principal("oauth"), topic, "WRITE", "DESCRIBE")
    calls = 0

    async def token() -> str:
        nonlocal calls
        calls += 1
        return unsecured_token()

    settings = relay_settings(db_dsn, kafka, "oauth", kafka_sasl_oauth_token_provider=None)
    conn = await asyncpg.connect(db_dsn)
    try:
        with anyio.fail_after(60):
            async with Relay(settings, kafka_token_provider=token):
                await insert_rows(conn, topic, 20)
                records, _ = await kafka.consume(topic, expect=20)
    finally:
        await conn.close()
    assert len(records) == 20
    assert calls >= 1


async def test_an_oauth_relay_without_a_usable_token_provider_is_told_why(db_dsn: str) -> None:
    """No provider, one that does not import, or one that is not a function: a configuration
    error at start naming the setting."""
    base = {
        "dsn": db_dsn,
        "kafka_bootstrap_servers": "127.0.0.1:9",
        "kafka_security_protocol": "SASL_SSL",
        "kafka_sasl_mechanism": "OAUTHBEARER",
    }
    for path, words in (
        (None, "is required with"),
        ("tests.no_such_module:token", "cannot load"),
        ("tests.secured_kafka:OAUTH_USER", "is not callable"),
        ("no-colon", "package.module:function"),
    ):
        settings = OutboxSettings(**base, kafka_sasl_oauth_token_provider=path)
        with pytest.raises(ConfigurationError, match=words) as error:
            await Relay(settings).run()
        assert "KAFKA_SASL_OAUTH_TOKEN_PROVIDER" in str(error.value)


@pytest.mark.parametrize("case", BAD_CONNECTIONS)
async def test_a_relay_that_cannot_connect_names_the_cause_and_exits(
    db_dsn: str, secured_kafka: SecuredKafka, case: str
) -> None:
    """A wrong password, a CA that does not sign the broker, or a broker certificate (from
    the right CA) for another host: at start, a clear error in the relay's own words naming
    the cause (authentication, certificate verification, hostname) and a non-zero exit; the
    rows stay pending with no attempt counted, and the password is in no log line."""
    env, secret = bad_relay_env(secured_kafka, case)
    cause = {"wrong_password": "authentication", "unknown_ca": "certificate"}.get(case, "hostname")
    conn = await asyncpg.connect(db_dsn)
    try:
        await insert_rows(conn, "never-sent", 2)
        with RelayProcess(db_dsn, secured_kafka.sasl_ssl, env=env) as relay:
            line = await anyio.to_thread.run_sync(
                relay.wait_for_line, r"notify_outbox\.\w+: .*Kafka", 60.0
            )
            assert cause in line.lower(), line
            code = await anyio.to_thread.run_sync(relay.wait, 60.0)
        pending = await conn.fetch("SELECT attempts FROM outbox")
    finally:
        await conn.close()
    assert code != 0, relay.output()
    # The broker refused for the reason the case is about, not another (aiokafka's words).
    assert relay.matching(CAUSES[case]), relay.output()
    assert not relay.matching("Traceback"), relay.output()
    assert [r["attempts"] for r in pending] == [0, 0]
    assert not relay.matching(secret)


@pytest.mark.parametrize("case", BAD_CONNECTIONS)
async def test_a_running_relay_that_is_refused_keeps_retrying_and_says_why(
    db_dsn: str, secured_kafka: SecuredKafka, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    """After its first start (a producer replaced while the relay runs), the same refusals
    do not stop the relay: it retries, and its warning names the cause, never the secret."""
    env, secret = bad_relay_env(secured_kafka, case)
    fields = {
        k.removeprefix("NOTIFY_OUTBOX_").lower(): v
        for k, v in env.items()
        if k.startswith("NOTIFY_OUTBOX_KAFKA_")
    }
    publisher = KafkaPublisher(OutboxSettings(dsn=db_dsn, **fields))
    cause = {"wrong_password": "authentication", "unknown_ca": "certificate"}.get(case, "hostname")
    caplog.set_level(logging.WARNING, logger="notify_outbox")
    said = anyio.Event()

    class Watch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "Kafka not reachable" in record.getMessage():
                said.set()

    watch = Watch()
    logging.getLogger("notify_outbox.publisher").addHandler(watch)
    try:
        # start() retries until it connects: it is cancelled once it said why it waits.
        with anyio.move_on_after(60) as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(publisher.start)
                await said.wait()
                tg.cancel_scope.cancel()
    finally:
        logging.getLogger("notify_outbox.publisher").removeHandler(watch)
    assert not scope.cancelled_caught, caplog.text
    assert not publisher.connected  # still retrying: never connected
    warned = [r.getMessage() for r in caplog.records if "Kafka not reachable" in r.getMessage()]
    assert cause in warned[0].lower(), warned
    assert secret not in caplog.text


async def test_a_wrong_key_password_is_a_clear_error_at_start(
    db_dsn: str, secured_kafka: SecuredKafka
) -> None:
    """The client certificate's key does not open with NOTIFY_OUTBOX_KAFKA_SSL_PASSWORD: the
    relay exits at once, non-zero, with an error that names the key file and the setting to
    check (OpenSSL itself says only ``PEM lib``), never the password. (Without any password,
    OpenSSL asks for one on the terminal: "Enter PEM pass phrase:"; not tried here, a test run
    with a terminal would wait for it.)"""
    secret = "not-the-key-password"
    env = secured_kafka.relay_env("mtls", kafka_ssl_password=secret)
    with RelayProcess(db_dsn, secured_kafka.mtls, env=env) as relay:
        code = await anyio.to_thread.run_sync(relay.wait, 60.0)
    assert code != 0
    assert not relay.matching(secret)
    assert not relay.matching("Traceback"), relay.output()
    assert relay.matching(r"notify_outbox\.\w+: .*relaymtls\.key")
