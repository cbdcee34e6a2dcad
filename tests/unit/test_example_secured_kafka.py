"""The secured-Kafka example (examples/secured_kafka): every environment file is a valid
configuration of the relay with its secrets read from files, and the OpenID Connect token
provider fetches a token once and renews it before it expires (against a token endpoint on
loopback)."""

from __future__ import annotations

import base64
import json
import os
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest

from notify_outbox import OutboxSettings, load_settings
from notify_outbox.kafka.publisher import load_token_provider
from tests.support import ROOT, http_server

EXAMPLE = ROOT / "examples" / "secured_kafka"
SECRETS = "/run/secrets/notify-outbox/"


def env_of(name: str, secrets: Path) -> dict[str, str]:
    """The variables of an example's environment file, its secret paths moved to ``secrets``."""
    env = {}
    for line in (EXAMPLE / name).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key] = value.replace(SECRETS, f"{secrets}/")
    return env


@pytest.fixture
def secrets(tmp_path: Path) -> Path:
    for name, content in {
        "dsn": "postgresql://relay:pw@db.example.internal/app\n",
        "kafka-password": "kafka-pw\n",
        "key-password": "key-pw\n",
        "oidc-client-secret": "oidc-secret\n",
        "ca.pem": "",
        "relay.pem": "",
        "relay.key": "",
    }.items():
        (tmp_path / name).write_text(content)
    return tmp_path


@pytest.mark.parametrize("name", ["scram.env", "mtls.env", "oauth.env"])
def test_each_environment_file_configures_the_relay(
    name: str, secrets: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in [k for k in os.environ if k.startswith("NOTIFY_OUTBOX_")]:
        monkeypatch.delenv(key)  # only the file's settings
    for key, value in env_of(name, secrets).items():
        monkeypatch.setenv(key, value)
    settings = load_settings(OutboxSettings)
    assert settings.dsn.get_secret_value() == "postgresql://relay:pw@db.example.internal/app"
    assert settings.kafka_security_protocol in ("SASL_SSL", "SSL")
    assert settings.kafka_ssl_cafile == secrets / "ca.pem"
    if name == "scram.env":
        assert settings.kafka_sasl_mechanism == "SCRAM-SHA-512"
        assert settings.kafka_sasl_password is not None
        assert settings.kafka_sasl_password.get_secret_value() == "kafka-pw"
    elif name == "mtls.env":
        assert settings.kafka_ssl_password is not None
        assert settings.kafka_ssl_password.get_secret_value() == "key-pw"
    else:
        assert settings.kafka_sasl_oauth_token_provider is not None
        assert callable(load_token_provider(settings.kafka_sasl_oauth_token_provider))


@pytest.fixture
def token_endpoint() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """A client-credentials token endpoint: records each request, answers a new token with
    the lifetime the test put in ``lifetime`` (its last request list entry)."""
    seen: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers["Content-Length"])
            form = urllib.parse.parse_qs(self.rfile.read(length).decode())
            user, _, password = (
                base64.b64decode(self.headers["Authorization"].split()[1]).decode().partition(":")
            )
            seen.append({"form": form, "user": user, "password": password})
            body = json.dumps({"access_token": f"token-{len(seen)}", "expires_in": 31}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    with http_server(Handler) as url:
        yield f"{url}/token", seen


@pytest.mark.anyio
async def test_the_oidc_token_provider_caches_and_renews(
    token_endpoint: tuple[str, list[dict[str, Any]]],
    secrets: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url, seen = token_endpoint
    monkeypatch.setenv("OIDC_TOKEN_URL", url)
    monkeypatch.setenv("OIDC_CLIENT_ID", "notify-outbox")
    monkeypatch.setenv("OIDC_CLIENT_SECRET_FILE", str(secrets / "oidc-client-secret"))
    from examples.secured_kafka import oidc_token

    monkeypatch.setattr(oidc_token, "_cached", None)
    monkeypatch.setattr(oidc_token, "_lock", None)
    assert await oidc_token.token() == "token-1"
    assert await oidc_token.token() == "token-1"  # cached: 31 s, renewed 30 s early
    assert len(seen) == 1
    assert seen[0]["user"] == "notify-outbox"
    assert seen[0]["password"] == "oidc-secret"
    assert seen[0]["form"] == {"grant_type": ["client_credentials"]}
    monkeypatch.setattr(oidc_token, "_cached", ("token-1", 0.0))  # its renewal time passed
    assert await oidc_token.token() == "token-2"
