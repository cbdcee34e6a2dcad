"""Tests of devstack's throwaway schema registry (Apicurio, Confluent-compatible API)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from devstack import SchemaRegistryServer

CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"


def _record(*fields: dict[str, Any]) -> str:
    return json.dumps({"type": "record", "name": "T", "namespace": "t", "fields": list(fields)})


V1 = _record({"name": "a", "type": "string"})
# A new field without a default: readers of V2 cannot read data written with V1.
V2_INCOMPATIBLE = _record({"name": "a", "type": "string"}, {"name": "b", "type": "string"})
# The same field with a default: a BACKWARD-compatible change.
V2_COMPATIBLE = _record(
    {"name": "a", "type": "string"}, {"name": "b", "type": "string", "default": ""}
)


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SchemaRegistryServer]:
    """One registry for the module; tests use subjects of their own."""
    server = SchemaRegistryServer(tmp_path_factory.mktemp("registry"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _subject() -> str:
    return f"t-{uuid.uuid4().hex[:12]}-value"


def _register(url: str, subject: str, schema: str) -> httpx.Response:
    return httpx.post(
        f"{url}/subjects/{subject}/versions",
        json={"schema": schema},
        headers={"Content-Type": CONTENT_TYPE},
        timeout=10,
    )


def _latest(url: str, subject: str) -> dict[str, Any]:
    response = httpx.get(f"{url}/subjects/{subject}/versions/latest", timeout=10)
    response.raise_for_status()
    body: dict[str, Any] = response.json()
    return body


def test_register_and_read_back(registry: SchemaRegistryServer) -> None:
    response = _register(registry.url, "t-value", V1)
    assert response.status_code == 200, response.text
    schema_id = response.json()["id"]
    latest = _latest(registry.url, "t-value")
    assert latest["id"] == schema_id
    assert latest["version"] == 1
    assert latest["schemaType"] == "AVRO"
    assert json.loads(latest["schema"]) == json.loads(V1)
    # Registering the same schema again is idempotent: same id, no new version.
    again = _register(registry.url, "t-value", V1)
    assert again.json()["id"] == schema_id
    assert httpx.get(f"{registry.url}/subjects/t-value/versions", timeout=10).json() == [1]


def test_compatibility_is_backward(registry: SchemaRegistryServer) -> None:
    # Confluent's default, which start() sets (Apicurio's own is NONE).
    config = httpx.get(f"{registry.url}/config", timeout=10).json()
    assert config["compatibilityLevel"] == "BACKWARD"


def test_incompatible_change_refused(registry: SchemaRegistryServer) -> None:
    subject = _subject()
    assert _register(registry.url, subject, V1).status_code == 200
    refused = _register(registry.url, subject, V2_INCOMPATIBLE)
    assert refused.status_code == 409, refused.text
    assert _latest(registry.url, subject)["version"] == 1
    accepted = _register(registry.url, subject, V2_COMPATIBLE)
    assert accepted.status_code == 200, accepted.text
    assert _latest(registry.url, subject)["version"] == 2


def test_schemas_survive_restart_and_crash(registry: SchemaRegistryServer) -> None:
    subject = _subject()
    schema_id = _register(registry.url, subject, V1).json()["id"]
    port = registry.port
    registry.restart()
    assert registry.port == port
    latest = _latest(registry.url, subject)
    assert (latest["id"], latest["version"]) == (schema_id, 1)
    # Registered just before a SIGKILL: still there (the H2 file is written at once).
    crashed = _subject()
    crashed_id = _register(registry.url, crashed, V2_COMPATIBLE).json()["id"]
    registry.kill()
    assert not registry.is_running()
    registry.start()
    assert _latest(registry.url, crashed)["id"] == crashed_id
    assert _latest(registry.url, subject)["id"] == schema_id
    # The compatibility setting is re-applied (and kept) too.
    assert httpx.get(f"{registry.url}/config", timeout=10).json()["compatibilityLevel"] == (
        "BACKWARD"
    )


def test_second_object_controls_same_server(registry: SchemaRegistryServer) -> None:
    # The state file lets another process (here another object) find port and pid.
    other = SchemaRegistryServer(registry.base_dir)
    assert other.port == registry.port
    assert other.pid is not None
    assert other.pid == registry.pid
    assert other.url == registry.url


def test_fresh_directory_starts_empty(tmp_path: Path, registry: SchemaRegistryServer) -> None:
    # Each server has its own database: nothing leaks from the module's registry.
    server = SchemaRegistryServer(tmp_path / "fresh")
    assert server.port != registry.port
    server.start()
    try:
        assert httpx.get(f"{server.url}/subjects", timeout=10).json() == []
    finally:
        server.stop()
    assert not server.is_running()
