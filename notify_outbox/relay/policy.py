"""What to write back for a published batch: pure functions, testable without a relay."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from notify_outbox.core.message import PublishResult
from notify_outbox.core.outbox import BatchOutcome, OutboxRow
from notify_outbox.core.settings import OutboxSettings

__all__ = ["decide", "retry_delay"]

# 2 ** 60 seconds is far beyond any cap; stopping the exponent there keeps the arithmetic in
# floats (2 ** 1100 would not fit one) however large max_attempts is.
_MAX_EXPONENT = 60


def retry_delay(attempts: int, base: float, cap: float) -> float:
    """Seconds before attempt ``attempts + 1`` of a row that failed ``attempts`` times:
    ``base * 2 ** (attempts - 1)``, capped, before jitter."""
    exponent = min(max(attempts - 1, 0), _MAX_EXPONENT)
    return float(min(cap, base * 2.0**exponent))


def decide(
    rows: Sequence[OutboxRow],
    result: PublishResult,
    settings: OutboxSettings,
    *,
    jitter: Callable[[], float],
) -> BatchOutcome:
    """The outcome of a batch: delivered rows are published, failed rows retried with backoff
    (dead-lettered after ``max_attempts``), rejected rows dead-lettered at once. ``jitter``
    gives the factor (0.5 to 1) a retry's delay is multiplied by; the caller draws it, and
    logs the outcome, so this stays a pure function.

    Per key, only what comes before the key's first row that was not delivered is kept: a
    later row of that key is neither marked nor counted as a failure, whatever happened to it
    (it stays pending and follows the earlier row). So a key's later row is never marked
    published while an earlier one waits for a retry, even when they went to different topics.
    """
    if len(result.delivered) == len(rows) and not result.failed and not result.rejected:
        # Every row acknowledged, the common case: nothing to decide row by row.
        return BatchOutcome(published=[row.id for row in rows])
    s = settings
    delivered = set(result.delivered)
    failed = dict(result.failed)
    rejected = dict(result.rejected)
    stopped: set[str] = set()  # keys whose earlier row was not delivered
    outcome = BatchOutcome()
    for row in rows:
        if row.key is not None and row.key in stopped:
            continue
        if row.id in delivered:
            outcome.published.append(row.id)
            continue
        if row.key is not None:
            stopped.add(row.key)
        if row.id in rejected:
            outcome.dead.append((row.id, rejected[row.id]))
        elif row.id in failed:
            reason = failed[row.id]
            attempts = row.attempts + 1
            if attempts >= s.max_attempts:
                outcome.dead.append((row.id, f"{reason} (after {attempts} attempts)"))
                continue
            delay = retry_delay(attempts, s.retry_base_delay, s.retry_max_delay) * jitter()
            outcome.retry.append((row.id, reason, delay))
        # Neither: not sent, or its ack did not come (Kafka unavailable): stays pending.
    return outcome
