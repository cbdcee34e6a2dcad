"""Settings errors name the environment variable to fix, and never echo a secret."""

from __future__ import annotations

import pytest

from notify_outbox.errors import ConfigurationError
from notify_outbox.settings import OutboxSettings, load_settings

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
