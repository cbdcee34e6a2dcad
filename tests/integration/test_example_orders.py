"""The orders example (examples/orders, `make example`) runs and checks itself."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import Services
from tests.support import ROOT


def test_orders_example_applies_each_order_once(services: Services) -> None:
    env = {
        **os.environ,
        "NOTIFY_OUTBOX_DSN": services.dsn,
        "NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS": services.bootstrap,
    }
    result = subprocess.run(
        [sys.executable, "-m", "examples.orders", "--orders", "6"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "billing applied 6 orders, skipped 0 repeats" in result.stdout
    assert "billing applied 0 orders, skipped 6 repeats" in result.stdout
    assert "example: OK" in result.stdout
