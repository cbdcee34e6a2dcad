"""Settings errors name the environment variable to fix, and never echo a secret."""

from __future__ import annotations

import os
import ssl
from pathlib import Path

import pytest

from notify_outbox.core.errors import ConfigurationError
from notify_outbox.core.logs import secrets_from_env
from notify_outbox.core.settings import OutboxSettings, load_settings, unknown_variables

DSN = "postgresql://app:hunter2-secret@127.0.0.1:5432/app"


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (
            {"retry_base_delay": 10, "retry_max_delay": 1},
            ["NOTIFY_OUTBOX_RETRY_MAX_DELAY", "NOTIFY_OUTBOX_RETRY_BASE_DELAY"],
        ),
        (
            {"reconnect_min_delay": 5, "reconnect_max_delay": 1},
            ["NOTIFY_OUTBOX_RECONNECT_MAX_DELAY", "NOTIFY_OUTBOX_RECONNECT_MIN_DELAY"],
        ),
        (
            {"kafka_security_protocol": "SASL_SSL"},
            ["NOTIFY_OUTBOX_KAFKA_SASL_MECHANISM", "NOTIFY_OUTBOX_KAFKA_SECURITY_PROTOCOL"],
        ),
        ({"workers": 0}, ["NOTIFY_OUTBOX_WORKERS"]),
    ],
)
def test_errors_across_fields_name_each_variable(
    overrides: dict[str, object], names: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NOTIFY_OUTBOX_DSN", DSN)
    monkeypatch.setenv("NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092")
    with pytest.raises(ConfigurationError) as info:
        load_settings(OutboxSettings, **overrides)
    message = str(info.value)
    for name in names:
        assert name in message
    assert "hunter2" not in message


def test_listen_dsn_is_checked_and_its_password_redacted() -> None:
    from notify_outbox.core.logs import redact

    settings = OutboxSettings(
        dsn="postgresql://app:pooled-secret@pgbouncer:6432/app",
        listen_dsn="postgresql://app:direct-secret@postgres:5432/app",
        kafka_bootstrap_servers="k:9092",
    )
    text = redact("failed: direct-secret / pooled-secret", settings)
    assert "secret" not in text
    with pytest.raises(ConfigurationError, match="NOTIFY_OUTBOX_LISTEN_DSN") as caught:
        load_settings(
            OutboxSettings,
            dsn="postgresql://a@h/db",
            listen_dsn="mysql://u:hunter2@h/db",
            kafka_bootstrap_servers="k:9092",
        )
    assert "hunter2" not in str(caught.value)


def test_connection_errors_that_no_retry_cures_are_told_apart() -> None:
    import asyncpg

    from notify_outbox.pg.db import never_heals, statement_cache_size

    def error(cls: type[Exception], message: str) -> Exception:
        return cls(message)

    assert never_heals(error(asyncpg.InvalidPasswordError, "password")) == (
        "the password was refused"
    )
    assert never_heals(error(asyncpg.InvalidCatalogNameError, "no db")) is not None
    # PgBouncer's own refusals come as protocol violations; its transient ones must not count.
    refused = error(asyncpg.ProtocolViolationError, "unsupported startup parameter: x")
    assert never_heals(refused) is not None
    assert never_heals(error(asyncpg.ProtocolViolationError, "pgbouncer cannot connect")) is None
    assert never_heals(error(asyncpg.CannotConnectNowError, "starting up")) is None
    assert never_heals(ConnectionRefusedError(111, "refused")) is None
    # sslmode=verify-full: the certificate the server shows now, it shows next time too.
    for code, words in ((20, "not trusted by the CA"), (62, "does not name the host")):
        unverified = ssl.SSLCertVerificationError(1, "certificate verify failed")
        unverified.verify_code = code
        unverified.verify_message = "as OpenSSL says"
        why = never_heals(unverified)
        assert why is not None
        assert words in why
    assert never_heals(ssl.SSLError(1, "unexpected eof")) is None  # a connection cut short
    assert statement_cache_size(None, pooled=True) == 0
    assert statement_cache_size(None, pooled=False) == 100
    assert statement_cache_size(50, pooled=True) == 50


def test_read_only_servers_are_told_apart() -> None:
    import asyncpg

    from notify_outbox.pg.db import read_only

    standby = asyncpg.ReadOnlySQLTransactionError("cannot execute LISTEN during recovery")
    assert read_only(standby)
    assert read_only(asyncpg.PostgresError("cannot execute INSERT in a read-only transaction"))
    assert read_only(asyncpg.InternalServerError("cannot assign TransactionIds during recovery"))
    assert not read_only(asyncpg.InsufficientPrivilegeError("permission denied for table outbox"))
    assert not read_only(ConnectionRefusedError(111, "refused"))
    assert not read_only(OSError("read-only file system during recovery"))


# Floats that are not durations, each named on purpose.
_FRACTIONS = {"outbox_drain_share"}
_DURATION_FIELDS = [
    name
    for name, field in OutboxSettings.model_fields.items()
    if "float" in str(field.annotation) and name not in _FRACTIONS
]


def test_every_float_setting_is_a_duration() -> None:
    # A new float field that forgot the Seconds type (and so its units) fails here.
    assert len(_DURATION_FIELDS) >= 18
    settings = load_settings(
        OutboxSettings,
        dsn=DSN,
        kafka_bootstrap_servers="k:9092",
        **dict.fromkeys(_DURATION_FIELDS, "1500ms"),
    )
    for name in _DURATION_FIELDS:
        assert getattr(settings, name) == 1.5, name


@pytest.mark.parametrize(
    ("variable", "text", "seconds"),
    [
        ("NOTIFY_OUTBOX_POLL_INTERVAL", "5s", 5.0),
        ("NOTIFY_OUTBOX_POLL_INTERVAL", "250ms", 0.25),
        ("NOTIFY_OUTBOX_POLL_INTERVAL", "2.5", 2.5),
        ("NOTIFY_OUTBOX_KAFKA_SEND_TIMEOUT", "1m", 60.0),
        ("NOTIFY_OUTBOX_CLAIM_IDLE_TIMEOUT", "1500ms", 1.5),
        ("NOTIFY_OUTBOX_SHUTDOWN_TIMEOUT", "1m30s", 90.0),
        ("NOTIFY_OUTBOX_RECONNECT_MAX_DELAY", "1h", 3600.0),
        ("NOTIFY_OUTBOX_CLEANUP_INTERVAL", "PT5M", 300.0),
        ("NOTIFY_OUTBOX_KEEP_PUBLISHED", "2d", 172800.0),
        ("NOTIFY_OUTBOX_KEEP_PUBLISHED", "0s", 0.0),
        ("NOTIFY_OUTBOX_GATE_LINGER", "10ms", 0.01),
        ("NOTIFY_OUTBOX_DEAD_LETTER_RETENTION", "30d", 30 * 86400.0),
    ],
)
def test_duration_settings_accept_units(
    variable: str, text: str, seconds: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NOTIFY_OUTBOX_DSN", DSN)
    monkeypatch.setenv("NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092")
    monkeypatch.setenv(variable, text)
    settings = load_settings(OutboxSettings)
    field = variable.removeprefix("NOTIFY_OUTBOX_").lower()
    assert getattr(settings, field) == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("poll_interval", "0s", "greater than 0"),  # the field's own bound, after the unit
        ("poll_interval", "-1", "greater than 0"),
        ("poll_interval", "5 parsecs", "invalid duration"),
        ("keep_published", "-1s", "invalid duration"),
        ("dead_letter_retention", "0ms", "greater than 0"),
    ],
)
def test_duration_settings_keep_their_bounds(field: str, value: str, message: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        load_settings(OutboxSettings, dsn=DSN, kafka_bootstrap_servers="k:9092", **{field: value})
    text = str(info.value)
    assert f"NOTIFY_OUTBOX_{field.upper()}: " in text
    assert message in text
    assert value not in text.replace(f"NOTIFY_OUTBOX_{field.upper()}", "")


def test_an_unknown_keyword_is_refused_with_the_closest_setting() -> None:
    """The environment may hold variables of other tools (they get a warning); a keyword
    argument is code, and a misspelt one would leave its setting at the default unnoticed."""
    base = {"dsn": DSN, "kafka_bootstrap_servers": "127.0.0.1:9092"}
    with pytest.raises(ConfigurationError, match="unknown setting 'batch_sise'") as info:
        OutboxSettings(**base, batch_sise=10)  # type: ignore[call-arg]
    assert "did you mean 'batch_size'?" in str(info.value)
    assert "hunter2" not in str(info.value)
    with pytest.raises(ConfigurationError, match="'no_such_thing'"):
        OutboxSettings(**base, no_such_thing=1)  # type: ignore[call-arg]
    # pydantic-settings' own init arguments still work.
    assert OutboxSettings(**base, _env_file=None).batch_size == 1000  # type: ignore[arg-type]


def test_secrets_are_read_from_the_files_their_file_variables_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``NOTIFY_OUTBOX_<SECRET>_FILE`` (a Kubernetes Secret mounted as files): the value is
    the file's content without its trailing newline, for every secret setting."""
    _clear_environment(monkeypatch)
    files = {
        "DSN": f"{DSN}\n",
        "LISTEN_DSN": "postgresql://l:listen-pw@pg/db\n",
        "KAFKA_SASL_PASSWORD": "sasl-pw\r\n",
        "KAFKA_SSL_PASSWORD": "ssl-pw",
    }
    for name, content in files.items():
        (tmp_path / name).write_text(content)
        monkeypatch.setenv(f"NOTIFY_OUTBOX_{name}_FILE", str(tmp_path / name))
    monkeypatch.setenv("NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092")
    s = OutboxSettings()
    assert s.dsn.get_secret_value() == DSN
    assert s.listen_dsn is not None
    assert s.listen_dsn.get_secret_value() == "postgresql://l:listen-pw@pg/db"
    assert s.kafka_sasl_password is not None
    assert s.kafka_sasl_password.get_secret_value() == "sasl-pw"
    assert s.kafka_ssl_password is not None
    assert s.kafka_ssl_password.get_secret_value() == "ssl-pw"
    # Known variables: no "unknown environment variable" warning for them.
    assert unknown_variables() == []
    # And as secret as the variables themselves: the logs redact what the files hold.
    found = secrets_from_env()
    assert {"sasl-pw", "ssl-pw", "listen-pw", DSN} <= set(found)
    assert str(tmp_path / "DSN") not in found  # a path is no secret


def test_a_secret_set_twice_or_in_an_unreadable_file_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _clear_environment(monkeypatch)
    secret = tmp_path / "pw"
    secret.write_text("the-password")
    monkeypatch.setenv("NOTIFY_OUTBOX_DSN", DSN)
    monkeypatch.setenv("NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092")
    monkeypatch.setenv("NOTIFY_OUTBOX_KAFKA_SASL_PASSWORD", "inline")
    monkeypatch.setenv("NOTIFY_OUTBOX_KAFKA_SASL_PASSWORD_FILE", str(secret))
    with pytest.raises(ConfigurationError, match="both set") as both:
        OutboxSettings()
    assert "the-password" not in str(both.value)
    assert "inline" not in str(both.value)
    monkeypatch.delenv("NOTIFY_OUTBOX_KAFKA_SASL_PASSWORD")
    monkeypatch.setenv("NOTIFY_OUTBOX_KAFKA_SASL_PASSWORD_FILE", str(tmp_path / "missing"))
    with pytest.raises(
        ConfigurationError, match=r"KAFKA_SASL_PASSWORD_FILE: cannot read .*missing"
    ):
        OutboxSettings()
    # A keyword in code wins over the environment, as for every setting.
    s = OutboxSettings(kafka_sasl_password="from-code")
    assert s.kafka_sasl_password is not None
    assert s.kafka_sasl_password.get_secret_value() == "from-code"


def _clear_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No setting from the shell (the test stack exports NOTIFY_OUTBOX_DSN, say)."""
    for name in list(os.environ):
        if name.upper().startswith("NOTIFY_OUTBOX_"):
            monkeypatch.delenv(name)
