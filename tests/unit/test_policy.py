"""The retry decision, the backoff and the quiet outage log, without a relay."""

from __future__ import annotations

import logging
import uuid

import pytest

from notify_outbox import OutboxSettings
from notify_outbox.core.backoff import Backoff
from notify_outbox.core.outbox import OutboxRow
from notify_outbox.kafka.publisher import PublishResult
from notify_outbox.relay.outage import Outage, RateLimitFilter
from notify_outbox.relay.policy import decide, retry_delay


def settings(**kw: object) -> OutboxSettings:
    base: dict[str, object] = {
        "dsn": "postgresql://u:secret@127.0.0.1:1/db",
        "kafka_bootstrap_servers": "127.0.0.1:1",
    }
    base.update(kw)
    return OutboxSettings(**base)  # type: ignore[arg-type]


def jitter() -> float:
    return 0.75  # what the relay draws between 0.5 and 1


def row(row_id: int, key: str | None, topic: str = "t", attempts: int = 0) -> OutboxRow:
    return OutboxRow(row_id, uuid.uuid4(), topic, key, "{}", None, None, attempts=attempts)


def test_retry_delay_doubles_up_to_the_cap_and_never_overflows() -> None:
    assert [retry_delay(n, 1.0, 300.0) for n in (1, 2, 3, 9, 10)] == [1, 2, 4, 256, 300]
    # 2 ** 1100 does not fit a float: the exponent stops long before that.
    assert retry_delay(5000, 1.0, 300.0) == 300.0
    assert retry_delay(5000, 1e-9, 1e9) == 1e9


def test_a_row_failing_past_attempt_1024_is_retried_or_dead_lettered_not_crashing() -> None:
    s = settings(max_attempts=100_000, retry_base_delay=1.0, retry_max_delay=60.0)
    rows = [row(1, "k", attempts=2000)]
    outcome = decide(rows, PublishResult(failed=[(1, "boom")]), s, jitter=jitter)
    assert [(i, e) for i, e, _ in outcome.retry] == [(1, "boom")]
    assert outcome.retry[0][2] == 45.0  # capped at 60 s, then the jitter's factor


def test_a_keys_later_row_is_not_marked_while_an_earlier_one_is_retried() -> None:
    # r1 (topic a) failed at ack time; r2 of the same key (topic b) was acknowledged: r2 must
    # stay pending behind r1, neither published nor counted as a failure.
    rows = [row(1, "k", "a"), row(2, "k", "b"), row(3, "other", "b"), row(4, "k", "a")]
    result = PublishResult(delivered=[2, 3, 4], failed=[(1, "MessageSizeTooLarge")])
    outcome = decide(rows, result, settings(), jitter=jitter)
    assert outcome.published == [3]
    assert [i for i, _, _ in outcome.retry] == [1]
    assert outcome.dead == []


def test_rows_after_an_unacknowledged_row_of_their_key_stay_pending() -> None:
    # Kafka went away mid-batch: row 2 has no ack; row 3 of the same key was acked (another
    # topic): only what precedes the gap is marked.
    rows = [row(1, "k"), row(2, "k"), row(3, "k", "b"), row(4, None)]
    outcome = decide(
        rows, PublishResult(delivered=[1, 3, 4], unavailable="down"), settings(), jitter=jitter
    )
    assert outcome.published == [1, 4]
    assert outcome.retry == []
    assert outcome.dead == []


def test_rejected_rows_are_dead_lettered_and_failed_rows_after_max_attempts() -> None:
    rows = [row(1, "a"), row(2, "b", attempts=2), row(3, "c", attempts=1)]
    result = PublishResult(rejected=[(1, "malformed")], failed=[(2, "x"), (3, "y")])
    outcome = decide(rows, result, settings(max_attempts=3), jitter=jitter)
    assert outcome.dead == [(1, "malformed"), (2, "x (after 3 attempts)")]
    assert [i for i, _, _ in outcome.retry] == [3]


def test_backoff_doubles_with_jitter_caps_and_resets() -> None:
    b = Backoff(0.1, 0.5)
    delays = [b.next_delay() for _ in range(5)]
    for delay, upper in zip(delays, [0.1, 0.2, 0.4, 0.5, 0.5], strict=True):
        assert upper / 2 <= delay <= upper
    assert b.failures == 5
    b.reset()
    assert b.failures == 0
    assert b.next_delay() <= 0.1


def test_an_outage_logs_its_start_and_end_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A clock of the test's own: the outage lasts exactly 12.5 s, and the duration returned
    # and logged must be that (not merely some non-negative number).
    now = [1000.0]
    monkeypatch.setattr("notify_outbox.relay.outage.time.monotonic", lambda: now[0])
    log = logging.getLogger("test.outage")
    outage = Outage("Kafka", log, remind_every=3600)
    with caplog.at_level(logging.INFO, logger="test.outage"):
        assert outage.failed("broker down") is True
        for _ in range(1000):
            assert outage.failed("broker down") is False
            outage.remind()
            now[0] += 0.0125
        outage.held += 7
        duration = outage.recovered(pending=42)
        assert outage.recovered() is None
    assert duration == pytest.approx(12.5)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert lines[0] == "Kafka unavailable (broker down); rows stay pending"
    assert "available again after 12.5s" in lines[1]
    assert "7 claimed rows were given back" in lines[1]
    assert "42 rows pending" in lines[1]


def test_rate_limit_filter_lets_one_line_per_kind_through_and_counts_the_rest() -> None:
    limiter = RateLimitFilter(interval=3600)

    def record(msg: str, level: int = logging.ERROR) -> logging.LogRecord:
        return logging.LogRecord("aiokafka.conn", level, __file__, 1, msg, ("x",), None)

    assert limiter.filter(record("Unable connect to node %s"))
    assert not any(limiter.filter(record("Unable connect to node %s")) for _ in range(500))
    assert limiter.filter(record("another kind %s"))  # a different template passes
    assert limiter.filter(record("debug %s", logging.DEBUG))  # DEBUG is never limited
    limiter.interval = 0  # the next line of the first kind says what was dropped
    passed = record("Unable connect to node %s")
    assert limiter.filter(passed)
    assert str(passed.msg).endswith("(500 similar lines suppressed)")


def test_rate_limit_filter_keeps_a_library_warnings_error_but_not_its_traceback() -> None:
    try:
        raise ConnectionRefusedError("the database system is shutting down")
    except ConnectionRefusedError:
        import sys

        info = sys.exc_info()
    record = logging.LogRecord(
        "asyncpg.pool", logging.WARNING, __file__, 1, "Failed to restore the pool", (), info
    )
    assert RateLimitFilter().filter(record)
    assert record.exc_info is None
    assert record.getMessage() == (
        "Failed to restore the pool (ConnectionRefusedError: the database system is shutting down)"
    )
