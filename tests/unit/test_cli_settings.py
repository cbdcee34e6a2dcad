"""The command line's settings: errors name the flag that was given, not its variable."""

from __future__ import annotations

import pytest

from notify_outbox.cli import main
from notify_outbox.errors import ConfigurationError
from notify_outbox.settings import OutboxSettings, load_settings, load_settings_from_flags

DSN = "postgresql://app:hunter2-secret@127.0.0.1:5432/app"


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in (
        "NOTIFY_OUTBOX_POLL_INTERVAL",
        "NOTIFY_OUTBOX_WORKERS",
        "NOTIFY_OUTBOX_LOG_FORMAT",
    ):
        monkeypatch.delenv(name, raising=False)
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
