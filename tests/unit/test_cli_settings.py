"""The command line's settings: errors name the flag that was given, not its variable; unknown
``NOTIFY_OUTBOX_*`` variables are reported with a suggestion, never with their value; a
connection that gets no answer gives up after the connect timeout, naming host and port."""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from notify_outbox.cli.app import main
from notify_outbox.cli.flags import load_settings_from_flags
from notify_outbox.core.errors import ConfigurationError
from notify_outbox.core.settings import (
    DatabaseSettings,
    OutboxSettings,
    load_settings,
    unknown_variables,
)
from notify_outbox.ops.http import HttpSettings
from notify_outbox.pg.db import dsn_address

DSN = "postgresql://app:hunter2-secret@127.0.0.1:5432/app"


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    # Nothing of the caller's shell (a devstack's settings) leaks into the expectations.
    for name in list(os.environ):
        if name.upper().startswith("NOTIFY_OUTBOX_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("NOTIFY_OUTBOX_DSN", DSN)
    monkeypatch.setenv("NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092")
    return monkeypatch


def test_errors_name_the_flag_that_set_the_field(env: pytest.MonkeyPatch) -> None:
    env.setenv("NOTIFY_OUTBOX_WORKERS", "0")  # not given as a flag: its variable is named
    with pytest.raises(ConfigurationError) as info:
        load_settings_from_flags(
            OutboxSettings, poll_interval="5 parsecs", db_schema="Bad-Name", batch_size=None
        )
    lines = str(info.value).splitlines()[1:]
    assert any(line.strip().startswith("--poll-interval: invalid duration") for line in lines)
    assert any(line.strip().startswith("--schema: ") for line in lines)
    assert any(line.strip().startswith("NOTIFY_OUTBOX_WORKERS: ") for line in lines)
    assert "NOTIFY_OUTBOX_POLL_INTERVAL" not in str(info.value)
    assert "NOTIFY_OUTBOX_DB_SCHEMA" not in str(info.value)
    assert "parsecs" not in str(info.value)


def test_without_flags_errors_name_the_variable(env: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigurationError, match="NOTIFY_OUTBOX_POLL_INTERVAL: invalid duration"):
        load_settings(OutboxSettings, poll_interval="5 parsecs")


@pytest.mark.parametrize(
    ("argv", "expected", "variable"),
    [
        (
            ["run", "--poll-interval", "5 parsecs"],
            "--poll-interval: invalid duration",
            "NOTIFY_OUTBOX_POLL_INTERVAL",
        ),
        (["run", "--poll-interval", "0ms"], "--poll-interval: Input should be greater than 0", ""),
        (["run", "--workers", "0"], "--workers: Input should be greater than or equal to 1", ""),
        (
            ["status", "--dsn", "mysql://app:hunter2-secret@db/app"],
            "--dsn: must be a URL starting with postgresql://",
            "NOTIFY_OUTBOX_DSN",
        ),
        (
            ["dead-letters", "list", "--schema", "Bad-Name"],
            "--schema: ",
            "NOTIFY_OUTBOX_DB_SCHEMA",
        ),
    ],
)
def test_cli_errors_name_the_flag(
    argv: list[str],
    expected: str,
    variable: str,
    env: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert expected in err
    if variable:
        assert variable not in err
    assert "hunter2" not in err


def test_a_duration_flag_accepts_units(env: pytest.MonkeyPatch) -> None:
    settings = load_settings_from_flags(OutboxSettings, poll_interval="250ms")
    assert settings.poll_interval == 0.25


def test_an_unknown_variable_is_reported_with_a_suggestion_and_without_its_value(
    env: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    env.setenv("NOTIFY_OUTBOX_POLL_INTERVALL", "s3cr3t-value")
    env.setenv("NOTIFY_OUTBOX_SCHEMA", "another-s3cr3t")
    env.setenv("NOTIFY_OUTBOX_ZZZ_QQQ", "third-s3cr3t")
    with caplog.at_level(logging.WARNING, logger="notify_outbox.settings"):
        assert main(["sql"]) == 0
    warnings = [r.getMessage() for r in caplog.records if r.name == "notify_outbox.settings"]
    assert warnings == [
        "unknown environment variable NOTIFY_OUTBOX_POLL_INTERVALL is ignored; "
        "did you mean NOTIFY_OUTBOX_POLL_INTERVAL?",
        "unknown environment variable NOTIFY_OUTBOX_SCHEMA is ignored; "
        "did you mean NOTIFY_OUTBOX_DB_SCHEMA?",
        "unknown environment variable NOTIFY_OUTBOX_ZZZ_QQQ is ignored",
    ]
    assert all(r.levelno == logging.WARNING for r in caplog.records)
    assert "s3cr3t" not in caplog.text


def test_known_and_tool_variables_cause_no_warning() -> None:
    env = {
        # Every settings class the command line uses, in any case (as pydantic reads them)...
        "NOTIFY_OUTBOX_DSN": "postgresql://h/db",
        "NOTIFY_OUTBOX_CONNECT_TIMEOUT": "5s",
        "notify_outbox_kafka_client_id": "x",
        "NOTIFY_OUTBOX_HTTP_PORT": "9000",
        # ...the variables the command line reads by name...
        "NOTIFY_OUTBOX_LOG_FORMAT": "json",
        "NOTIFY_OUTBOX_INBOX_TABLE": "inbox",
        "NOTIFY_OUTBOX_DEBEZIUM_CONFIG": "c.json",
        # ...and those of the test suites, devstack and the bench.
        "NOTIFY_OUTBOX_FAULT_SOAK": "600s",
        "NOTIFY_OUTBOX_FAULT_SEED": "1",
        "NOTIFY_OUTBOX_TEST_DSN": "postgresql://h/db",
        "NOTIFY_OUTBOX_TEST_CRASH_AT": "after_ack",
        "NOTIFY_OUTBOX_PG_VERSION": "17",
        "NOTIFY_OUTBOX_CACHE_DIR": "/tmp/x",
        "OTHER_POLL_INTERVALL": "1",  # not ours
    }
    assert unknown_variables(env, settings=(DatabaseSettings, OutboxSettings, HttpSettings)) == []


def test_every_variable_the_repository_mentions_is_known() -> None:
    # The README, docs, compose file, tests and tools must not teach a name the warning calls
    # unknown (partial names such as NOTIFY_OUTBOX_HTTP_* end with "_" and are skipped).
    root = Path(__file__).resolve().parents[2]
    names: set[str] = set()
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
        for file in files:
            if file.endswith((".md", ".yml", ".py")) or file == "Dockerfile":
                text = Path(folder, file).read_text(encoding="utf-8", errors="replace")
                names.update(re.findall(r"NOTIFY_OUTBOX_[A-Z0-9_]*[A-Z0-9]\b", text))
    assert "NOTIFY_OUTBOX_POLL_INTERVAL" in names
    # Placeholders in docstrings and tests of this very warning.
    names -= {"NOTIFY_OUTBOX_X", "NOTIFY_OUTBOX_POLL_INTERVALL", "NOTIFY_OUTBOX_ZZZ_QQQ"}
    names -= {"NOTIFY_OUTBOX_SCHEMA", "NOTIFY_OUTBOX_KAFKA_BOOTSTRAP"}
    env = dict.fromkeys(names, "")
    assert unknown_variables(env, settings=(DatabaseSettings, OutboxSettings, HttpSettings)) == []


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A loopback port whose server never answers: the kernel completes the TCP handshake
    into the listen backlog, nobody ever accepts or replies."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield int(sock.getsockname()[1])


@pytest.mark.parametrize(
    ("argv", "variable"),
    [
        (["status", "--connect-timeout", "300ms"], None),
        (["dead-letters", "list", "--connect-timeout", "0.3"], None),
        (["migrate", "--inbox"], "300ms"),
    ],
)
def test_connect_timeout_names_the_address_and_the_timeout(
    argv: list[str],
    variable: str | None,
    silent_server: int,
    env: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    env.setenv("NOTIFY_OUTBOX_DSN", f"postgresql://app:hunter2-secret@127.0.0.1:{silent_server}/a")
    if variable is not None:
        env.setenv("NOTIFY_OUTBOX_CONNECT_TIMEOUT", variable)
    started = time.monotonic()
    assert main(argv) == 2  # as for any unreachable database
    assert time.monotonic() - started < 5
    err = capsys.readouterr().err
    assert f"cannot connect to PostgreSQL at 127.0.0.1:{silent_server}" in err
    assert "no answer within 0.3s" in err
    assert "NOTIFY_OUTBOX_CONNECT_TIMEOUT" in err
    assert "hunter2" not in err
    assert len(err.splitlines()) == 1, err


def test_connect_timeout_is_a_setting_with_a_default(env: pytest.MonkeyPatch) -> None:
    assert load_settings(DatabaseSettings).connect_timeout == 10.0
    env.setenv("NOTIFY_OUTBOX_CONNECT_TIMEOUT", "1m")
    assert load_settings(DatabaseSettings).connect_timeout == 60.0
    with pytest.raises(ConfigurationError, match="--connect-timeout: Input should be greater"):
        load_settings_from_flags(DatabaseSettings, connect_timeout="0s")


@pytest.mark.parametrize(
    ("dsn", "address"),
    [
        ("postgresql://u:p%40ss@db.example:6432/app", "db.example:6432"),
        (
            "postgresql://u:pw@h1:5432,h2:5433/app?target_session_attrs=read-write",
            "h1:5432,h2:5433",
        ),
        ("postgresql://u@[::1]:5433/db", "[::1]:5433"),
        ("postgresql://u:secret@h/db", "h:5432"),
        ("postgresql:///db?host=/run/postgresql&port=5433", "/run/postgresql:5433"),
    ],
)
def test_dsn_address_never_includes_the_user_or_password(
    dsn: str, address: str, env: pytest.MonkeyPatch
) -> None:
    env.delenv("PGHOST", raising=False)
    env.delenv("PGPORT", raising=False)
    assert dsn_address(dsn) == address


def test_the_relay_daemon_tunes_the_collector_and_only_it(env: pytest.MonkeyPatch) -> None:
    """``python -m notify_outbox``'s relay freezes what it loaded and collects the young
    generation every 50,000 allocations; the other commands and an embedded Relay do not."""
    import gc

    from notify_outbox.cli import app as cli

    before = gc.get_threshold()
    ran: list[tuple[int, int, int]] = []

    def run(coro: Any, *, uvloop_ok: bool) -> int:
        coro.close()
        ran.append(gc.get_threshold())
        return 0

    env.setattr(cli, "_run_async", run)
    try:
        assert main(["sql"]) == 0
        assert gc.get_threshold() == before
        assert main(["run"]) == 0
        assert ran == [(cli.GC_YOUNG_THRESHOLD, before[1], before[2])]
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
