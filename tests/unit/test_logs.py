"""The log formats of the command line: JSON lines with structured fields, text by default,
and secrets redacted in both."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from notify_outbox.core.errors import ConfigurationError
from notify_outbox.core.logs import (
    JsonFormatter,
    RedactingFormatter,
    Redactor,
    configure_logging,
    secrets_from_env,
)

SECRET = "s3cr3t-Pa55"
DSN = f"postgresql://relay:{SECRET}@db.example:5432/app"


def _record(msg: str, *args: object, **extra: object) -> logging.LogRecord:
    logger = logging.getLogger("notify_outbox.test")
    return logger.makeRecord(
        logger.name, logging.WARNING, __file__, 1, msg, args, None, extra=extra or None
    )


def test_json_lines_carry_time_level_logger_message_and_extra_fields() -> None:
    record = _record(
        "Kafka available again after %.1fs",
        3.25,
        dependency="Kafka",
        outage_seconds=3.25,
        row_ids=[1, 2],
        level="not the level",  # a taken name is kept, renamed
    )
    line = JsonFormatter().format(record)
    assert "\n" not in line
    doc = json.loads(line)
    assert doc["level"] == "WARNING"
    assert doc["logger"] == "notify_outbox.test"
    assert doc["message"] == "Kafka available again after 3.2s"
    assert doc["time"].endswith("Z")
    assert doc["time"][:4].isdigit()
    assert doc["dependency"] == "Kafka"
    assert doc["outage_seconds"] == 3.25
    assert doc["row_ids"] == [1, 2]
    assert doc["extra_level"] == "not the level"
    assert "exception" not in doc


def test_json_lines_hold_the_traceback_in_one_field() -> None:
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logger = logging.getLogger("notify_outbox.test")
        import sys

        record = logger.makeRecord(
            logger.name, logging.ERROR, __file__, 1, "failed", (), sys.exc_info()
        )
    line = JsonFormatter().format(record)
    assert "\n" not in line
    doc = json.loads(line)
    assert "RuntimeError: boom" in doc["exception"]


def test_values_that_are_not_json_become_strings() -> None:
    doc = json.loads(JsonFormatter().format(_record("x", when=object(), n={"a": (1, 2)})))
    assert doc["when"].startswith("<object")
    assert doc["n"] == {"a": [1, 2]}


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_dsn_with_a_password_never_reaches_the_log(fmt: str) -> None:
    redactor = Redactor(secrets_from_env(env={"NOTIFY_OUTBOX_DSN": DSN}))
    formatter = JsonFormatter(redactor) if fmt == "json" else RedactingFormatter(redactor=redactor)
    try:
        raise ConnectionError(f"could not connect to {DSN}")
    except ConnectionError:
        import sys

        logger = logging.getLogger("notify_outbox.test")
        record = logger.makeRecord(
            logger.name,
            logging.ERROR,
            __file__,
            1,
            "cannot connect: %s (password %s)",
            (DSN, SECRET),
            sys.exc_info(),
            extra={"dsn": DSN, "nested": {"where": [DSN]}},
        )
    out = formatter.format(record)
    assert SECRET not in out
    assert "***" in out
    if fmt == "json":
        doc = json.loads(out)
        assert doc["dsn"] == "postgresql://relay:***@db.example:5432/app"


def test_any_url_password_is_redacted_even_when_unknown() -> None:
    redact = Redactor()
    text = "kafka at sasl://bob:hunter2@k:9092 and postgres://x:y@h/db and http://h/p?a=b"
    assert (
        redact(text)
        == "kafka at sasl://bob:***@k:9092 and postgres://x:***@h/db and http://h/p?a=b"
    )


def test_known_secrets_are_redacted_but_short_ones_do_not_mangle_the_log() -> None:
    redact = Redactor(["hunter22", "ab"])
    assert redact("pw hunter22 about ab") == "pw *** about ab"


def test_secrets_from_env_finds_dsn_password_and_kafka_passwords() -> None:
    found = secrets_from_env(
        "postgresql://a:flag-pw@h/db",
        env={
            "NOTIFY_OUTBOX_DSN": DSN,
            "NOTIFY_OUTBOX_LISTEN_DSN": "postgresql://l:listen-pw@pg/db",
            "NOTIFY_OUTBOX_KAFKA_SASL_PASSWORD": "sasl-pw",
            "NOTIFY_OUTBOX_KAFKA_SSL_PASSWORD": "ssl-pw",
            "NOTIFY_OUTBOX_TABLE": "outbox",
            "OTHER_PASSWORD": "not ours",
        },
    )
    assert set(found) == {
        DSN,
        SECRET,
        "postgresql://l:listen-pw@pg/db",
        "listen-pw",
        "sasl-pw",
        "ssl-pw",
        "postgresql://a:flag-pw@h/db",
        "flag-pw",
    }


def test_secrets_from_a_malformed_dsn_are_still_found() -> None:
    # An unencoded "/" in the password: urlsplit reads the rest as a port and fails.
    dsn = "postgresql://u:pa/ss9@h:5432/db"
    assert "pa/ss9" in secrets_from_env(env={"NOTIFY_OUTBOX_DSN": dsn})


@contextmanager
def bare_root() -> Iterator[logging.Logger]:
    """The root logger without pytest's capture handlers (added for each test's call phase,
    so this runs inside the test), restored afterwards."""
    root = logging.getLogger()
    saved, level = root.handlers[:], root.level
    root.handlers = []
    try:
        yield root
    finally:
        root.handlers = saved
        root.setLevel(level)


def test_configure_logging_json() -> None:
    stream = io.StringIO()
    with bare_root():
        configure_logging("info", "JSON", secrets=[SECRET], stream=stream)
        logging.getLogger("notify_outbox.relay").warning(
            "row %s failed", 7, extra={"row_id": 7, "topic": "orders", "attempts": 2}
        )
        logging.getLogger("notify_outbox.relay").debug("not at INFO")
        logging.getLogger("x").info("password is %s", SECRET)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert first["message"] == "row 7 failed"
    assert (first["row_id"], first["topic"], first["attempts"]) == (7, "orders", 2)
    assert second["message"] == "password is ***"


def test_configure_logging_text_is_the_default_and_a_second_call_replaces_the_first() -> None:
    first, second = io.StringIO(), io.StringIO()
    with bare_root() as root:
        configure_logging("INFO", None, stream=first)
        configure_logging("INFO", "", secrets=[SECRET], stream=second)
        assert len(root.handlers) == 1
        logging.getLogger("notify_outbox.cli").info("hello %s", SECRET)
    assert first.getvalue() == ""
    assert second.getvalue().endswith(" INFO notify_outbox.cli: hello ***\n")


def test_configure_logging_leaves_an_applications_handlers_alone() -> None:
    theirs = logging.NullHandler()
    with bare_root() as root:
        root.addHandler(theirs)
        assert configure_logging("INFO", "json", stream=io.StringIO()) is None
        assert root.handlers == [theirs]


@pytest.mark.parametrize(
    ("level", "fmt", "match"),
    [("INFO", "xml", "NOTIFY_OUTBOX_LOG_FORMAT"), ("LOUD", "text", "--log-level")],
)
def test_bad_level_or_format_is_one_line(level: str, fmt: str, match: str) -> None:
    with pytest.raises(ConfigurationError, match=match) as e:
        configure_logging(level, fmt, stream=io.StringIO())
    assert "\n" not in str(e.value)
