"""A relay's tolerance (pulse.py): how long its pulse may be silent before a peer takes it for
stopped, from how late its pulse thread ran recently."""

from __future__ import annotations

from notify_outbox.relay.pulse import (
    FACTOR,
    TOLERANCE_CEILING,
    Lateness,
    tagged,
    tolerance_for,
)


def test_the_tolerance_is_the_timeout_until_the_pulse_ran_late() -> None:
    assert tolerance_for(0.15, 0.0) == 0.15
    # Three times a delay of up to 50 ms is within the 0.15 s timeout: as before.
    assert tolerance_for(0.15, 0.05) == 0.15
    assert tolerance_for(0.15, 0.1) == 0.3
    # Rounded up to 50 ms steps: few distinct statement texts.
    assert tolerance_for(0.15, 0.101) == 0.35
    assert FACTOR * 0.101 <= 0.35
    # At most the ceiling (PostgreSQL's idle timeout ends such a claim anyway), never less
    # than the relay's own setting.
    assert tolerance_for(0.15, 1.9) == TOLERANCE_CEILING
    assert tolerance_for(5.0, 0.5) == 5.0


def test_lateness_keeps_the_worst_of_its_recent_samples_and_leaves_freezes_out() -> None:
    late = Lateness(window=4)
    assert late.worst() == 0.0
    late.add(0.3)
    late.add(0.01)
    assert late.worst() == 0.3
    # A freeze (SIGSTOP, a VM pause) is no delay to allow for.
    late.add(TOLERANCE_CEILING)
    late.add(6.0)
    assert late.worst() == 0.3
    # It lasts at least a window of samples after it came, and at most two.
    for _ in range(2):
        late.add(0.01)
    assert late.worst() == 0.3  # the first bucket is full: 0.3 is in the previous one now
    for _ in range(3):
        late.add(0.02)
    assert late.worst() == 0.3
    late.add(0.02)
    assert late.worst() == 0.02


def test_a_statement_carries_its_tolerance_at_its_start() -> None:
    assert tagged("SELECT 1", 0.15) == "/* notify-outbox tolerance_ms=150 */ SELECT 1"
    assert tagged("SELECT 1", 1.35).startswith("/* notify-outbox tolerance_ms=1350 */")
