"""The Schema Registry example (examples/schema_registry) runs and checks itself."""

from __future__ import annotations

import os
import subprocess
import sys

from devstack.schema_registry import SchemaRegistryServer
from tests.conftest import Services
from tests.support import ROOT


def test_schema_registry_example_sends_avro_and_refuses_a_bad_event(
    services: Services, schema_registry: SchemaRegistryServer
) -> None:
    env = {
        **os.environ,
        "NOTIFY_OUTBOX_DSN": services.dsn,
        "NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS": services.bootstrap,
        "NOTIFY_OUTBOX_SCHEMA_REGISTRY_URL": schema_registry.url,
    }
    result = subprocess.run(
        [sys.executable, "-m", "examples.schema_registry"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "refused before the commit: event for topic" in out
    assert "total_cents" in out.split("refused before the commit:")[1].splitlines()[0]
    assert out.count("received (") == 3
    assert "'customer': 'grace', 'total_cents': 990" in out
    assert "example: OK" in out
