"""Every regime of ``python -m bench`` by name (its module's ``REGIME``), and the report of any
result JSON: a regime's by its ``phase``, the latency run's (no ``phase``) by
``bench.report``."""

from __future__ import annotations

import json
from pathlib import Path

from bench import (
    drain,
    eos_freeze,
    failing_head,
    fleet,
    held_snapshot,
    inbox,
    recovery,
    stalled_relay,
)
from bench.regimes import Regime
from bench.report import write_run_report

REGIMES: dict[str, Regime] = {
    r.name: r
    for r in (
        drain.REGIME,
        recovery.REGIME,
        held_snapshot.REGIME,
        failing_head.REGIME,
        stalled_relay.REGIME,
        eos_freeze.REGIME,
        inbox.REGIME,
        fleet.REGIME,
    )
}


def write_report(json_path: Path, *, plots: bool = True) -> Path:
    """Write ``<stem>.md`` (and the plots) next to a result JSON; returns the markdown's
    path."""
    phase = json.loads(json_path.read_text()).get("phase")
    if phase is None:
        return write_run_report(json_path, plots=plots)
    if phase not in REGIMES:
        raise ValueError(f"{json_path}: unknown phase {phase!r}")
    return REGIMES[phase].write_report(json_path, plots=plots)
