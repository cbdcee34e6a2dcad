"""docker-compose.yml and the Dockerfile, checked against the relay's real settings.

No Docker needed: the files are parsed, not run.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from notify_outbox.core.settings import OutboxSettings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
PREFIX = "NOTIFY_OUTBOX_"
SERVICES = ("postgres", "kafka", "kafka-init", "relay")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))
    assert isinstance(data, dict), "docker-compose.yml is not a mapping"
    return data


def _service(compose: dict[str, Any], name: str) -> dict[str, Any]:
    service = compose["services"][name]
    assert isinstance(service, dict), f"service {name} is not a mapping"
    return service


def _env(service: dict[str, Any]) -> dict[str, str]:
    """A service's environment, whether written as a mapping or as a KEY=VALUE list."""
    raw = service.get("environment") or {}
    if isinstance(raw, list):
        pairs = (str(item).partition("=") for item in raw)
        return {key: value for key, _, value in pairs}
    return {str(key): "" if value is None else str(value) for key, value in raw.items()}


def _command(service: dict[str, Any]) -> str:
    raw = service.get("command")
    assert raw, "the service has no command"
    return raw if isinstance(raw, str) else shlex.join(str(part) for part in raw)


def _container_ports(service: dict[str, Any]) -> set[int]:
    """Container-side ports the service publishes (``ports``) or exposes (``expose``)."""
    found: set[int] = set()
    for entry in service.get("ports") or []:
        if isinstance(entry, dict):
            found.add(int(entry["target"]))
        else:
            # "5432", "5432:5432", "127.0.0.1:5432:5432", optionally with "/tcp".
            found.add(int(str(entry).split("/")[0].rsplit(":", 1)[-1]))
    found.update(int(str(entry).split("/")[0]) for entry in service.get("expose") or [])
    return found


def _listeners(value: str) -> dict[str, tuple[str, int]]:
    """``NAME://host:port,...`` as {name: (host, port)}; an empty host means all interfaces."""
    result: dict[str, tuple[str, int]] = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        match = re.fullmatch(r"([A-Za-z0-9_]+)://([^:]*):(\d+)", item)
        assert match, f"listener {item!r} is not NAME://host:port"
        result[match[1]] = (match[2], int(match[3]))
    return result


def _valid_env_names() -> set[str]:
    return {PREFIX + field.upper() for field in OutboxSettings.model_fields}


def test_the_four_services_exist(compose: dict[str, Any]) -> None:
    assert set(SERVICES) <= set(compose.get("services") or {})


def test_relay_uses_only_real_settings(compose: dict[str, Any]) -> None:
    used = {name for name in _env(_service(compose, "relay")) if name.startswith(PREFIX)}
    unknown = used - _valid_env_names()
    assert not unknown, f"relay sets variables that are no setting of the relay: {unknown}"


def test_relay_sets_the_required_settings(compose: dict[str, Any]) -> None:
    env = _env(_service(compose, "relay"))
    required = {
        PREFIX + name.upper() for name, f in OutboxSettings.model_fields.items() if f.is_required()
    }
    # Guards the guard: if the settings stop requiring these, this test must be revisited.
    assert {PREFIX + "DSN", PREFIX + "KAFKA_BOOTSTRAP_SERVERS"} <= required
    missing = {name for name in required if not env.get(name)}
    assert not missing, f"relay does not set required settings: {missing}"


def test_relay_environment_is_accepted_by_the_settings(
    compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Only the compose file's values count, not whatever the shell running the tests exports.
    for name in [n for n in os.environ if n.startswith(PREFIX)]:
        monkeypatch.delenv(name)
    env = {
        name.removeprefix(PREFIX).lower(): value
        for name, value in _env(_service(compose, "relay")).items()
        if name.startswith(PREFIX)
    }
    settings = OutboxSettings.model_validate(env)  # raises on what the relay would reject
    assert settings.kafka_bootstrap_servers


def test_kafka_is_kraft_without_topic_auto_creation(compose: dict[str, Any]) -> None:
    kafka = _service(compose, "kafka")
    assert kafka["image"] == "apache/kafka:3.9.1"
    env = _env(kafka)
    assert env.get("KAFKA_AUTO_CREATE_TOPICS_ENABLE", "").lower() == "false"
    assert set(env["KAFKA_PROCESS_ROLES"].replace(" ", "").split(",")) == {"broker", "controller"}
    node_id = env["KAFKA_NODE_ID"]
    listeners = _listeners(env["KAFKA_LISTENERS"])
    controller = env["KAFKA_CONTROLLER_LISTENER_NAMES"]
    assert controller in listeners
    # The single voter is this node, at its own controller listener.
    voter = env["KAFKA_CONTROLLER_QUORUM_VOTERS"]
    assert voter == f"{node_id}@kafka:{listeners[controller][1]}"
    for key in (
        "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR",
        "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR",
        "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR",
    ):
        assert env.get(key) == "1", f"{key} must be 1 on a single node"
    assert "healthcheck" in kafka


def test_kafka_listeners_serve_containers_and_host(compose: dict[str, Any]) -> None:
    kafka = _service(compose, "kafka")
    env = _env(kafka)
    listeners = _listeners(env["KAFKA_LISTENERS"])
    advertised = _listeners(env["KAFKA_ADVERTISED_LISTENERS"])
    protocols = dict(
        item.split(":", 1) for item in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(",")
    )
    assert set(listeners) <= set(protocols), "a listener has no security protocol"
    for name, (_host, port) in advertised.items():
        assert name in listeners, f"advertised listener {name} is not a listener"
        assert listeners[name][1] == port, f"{name} advertises another port than it binds"
    inside = [name for name, (host, _port) in advertised.items() if host == "kafka"]
    outside = [name for name, (host, _port) in advertised.items() if host != "kafka"]
    assert inside, "no listener advertised to other containers as kafka:<port>"
    assert outside, "no listener advertised to the host"
    published = _container_ports(kafka)
    for name in outside:
        assert advertised[name][1] in published, f"host listener {name} is not published"


def test_relay_dsn_points_at_the_postgres_service(compose: dict[str, Any]) -> None:
    postgres = _service(compose, "postgres")
    dsn = urlsplit(_env(_service(compose, "relay"))[PREFIX + "DSN"])
    assert dsn.scheme in ("postgresql", "postgres")
    assert dsn.hostname == "postgres"
    assert (dsn.port or 5432) in _container_ports(postgres)
    pg_env = _env(postgres)
    assert pg_env.get("PGPORT", "5432") == str(dsn.port or 5432)
    # The credentials and database are the ones the postgres image creates.
    assert dsn.username == pg_env.get("POSTGRES_USER", "postgres")
    assert dsn.password == pg_env["POSTGRES_PASSWORD"]
    assert dsn.path.lstrip("/") == pg_env.get("POSTGRES_DB", dsn.username)
    assert "pg_isready" in str(postgres["healthcheck"]["test"])


def test_relay_bootstrap_points_at_an_internal_kafka_listener(compose: dict[str, Any]) -> None:
    env = _env(_service(compose, "kafka"))
    listeners = _listeners(env["KAFKA_LISTENERS"])
    advertised = _listeners(env["KAFKA_ADVERTISED_LISTENERS"])
    controller = env["KAFKA_CONTROLLER_LISTENER_NAMES"]
    servers = _env(_service(compose, "relay"))[PREFIX + "KAFKA_BOOTSTRAP_SERVERS"].split(",")
    for server in servers:
        host, _, port = server.strip().rpartition(":")
        assert host == "kafka", f"{server} is not the kafka service"
        # A client must reach a broker listener whose advertised address is reachable from a
        # container too, or the metadata it gets back sends it somewhere it cannot go.
        matching = [
            name
            for name, (_host, bound) in listeners.items()
            if bound == int(port) and name != controller
        ]
        assert matching, f"kafka has no broker listener on port {port}"
        assert advertised.get(matching[0]) == ("kafka", int(port))


def test_relay_waits_for_its_dependencies(compose: dict[str, Any]) -> None:
    relay = _service(compose, "relay")
    depends = relay["depends_on"]
    assert isinstance(depends, dict), "depends_on needs conditions, not a plain list"
    assert depends["postgres"]["condition"] == "service_healthy"
    assert depends["kafka"]["condition"] == "service_healthy"
    assert depends["kafka-init"]["condition"] == "service_completed_successfully"
    assert relay["restart"] == "unless-stopped"
    assert relay.get("build"), "the relay image is built from the Dockerfile"


def test_relay_migrates_then_runs(compose: dict[str, Any]) -> None:
    command = _command(_service(compose, "relay"))
    migrate = re.search(r"python -m notify_outbox migrate\b", command)
    run = re.search(r"python -m notify_outbox run\b", command)
    assert migrate, f"the relay command does not migrate: {command}"
    assert run, f"the relay command does not run the relay: {command}"
    assert migrate.start() < run.start(), "the relay must migrate before it runs"
    # `&&`: a failed migration must not start the relay.
    assert "&&" in command[migrate.end() : run.start()]


def test_kafka_init_creates_the_orders_topic(compose: dict[str, Any]) -> None:
    init = _service(compose, "kafka-init")
    assert init["image"] == _service(compose, "kafka")["image"]
    assert init["depends_on"]["kafka"]["condition"] == "service_healthy"
    entrypoint = init.get("entrypoint") or []
    argv = [*([entrypoint] if isinstance(entrypoint, str) else entrypoint)]
    command = init.get("command") or []
    argv += shlex.split(command) if isinstance(command, str) else [str(c) for c in command]
    text = " ".join(argv)
    assert "/opt/kafka/bin/kafka-topics.sh" in text
    assert "--create" in argv
    assert argv[argv.index("--topic") + 1] == "orders"
    assert "--if-not-exists" in argv, "a restart of the stack must not fail on an existing topic"


def test_dockerfile_installs_the_project() -> None:
    assert DOCKERFILE.is_file(), "Dockerfile is missing"
    lines = [
        line.strip()
        for line in DOCKERFILE.read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert lines[0] == "FROM python:3.11-slim"
    copied = " ".join(line for line in lines if line.startswith("COPY"))
    # The wheel is built from these (pyproject force-includes sql/ into the package).
    for needed in ("pyproject.toml", "notify_outbox", "sql"):
        assert needed in copied, f"the Dockerfile does not copy {needed}"
    assert any(re.match(r"RUN .*\bpip install (\S+ )*\.(\s|$)", line) for line in lines), (
        "the Dockerfile does not pip install the project"
    )


def test_relay_serves_metrics_and_its_healthcheck_uses_readyz(compose: dict[str, Any]) -> None:
    relay = _service(compose, "relay")
    env = _env(relay)
    port = int(env["NOTIFY_OUTBOX_HTTP_PORT"])
    # Reachable from outside the container, and published.
    assert env["NOTIFY_OUTBOX_HTTP_HOST"] == "0.0.0.0"  # noqa: S104
    assert port in _container_ports(relay)
    test = relay["healthcheck"]["test"]
    text = test if isinstance(test, str) else " ".join(str(part) for part in test)
    assert "notify_outbox healthcheck" in text or "/readyz" in text
