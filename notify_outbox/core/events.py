"""Counters and named events that the relay emits: for metrics, and for tests that wait on
what the code did ("listening", "marked") instead of sleeping."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .outbox import BatchOutcome, OutboxRow

__all__ = ["BatchObserver", "RelayEvents"]

Hook = Callable[[str, int], None]
#: ``observer(rows, outcome, unavailable)``: a batch's claimed rows, what was written back for
#: them, and why Kafka was unavailable (None if it was not); called once the claim committed.
BatchObserver = Callable[["Sequence[OutboxRow]", "BatchOutcome", "str | None"], None]


class RelayEvents:
    """Counts events by name and lets callers await them.

    Names used by the relay: ``listening``, ``listener_lost``, ``wake:<source>`` (source is
    notification, poll, reconnect, start, backlog, retry (a row's retry time came) or gate
    (producers that may have skipped their NOTIFY have finished)), ``poll`` (a fallback poll
    ran), ``gate_awake`` / ``gate_sleep`` (the awake marker taken / let go), ``gate_renewed``
    (the marker's epochs taken again), ``gate_lapse`` (taken again only after the epochs held
    had ended: producers notified in between), ``gate_busy``
    (producers were in flight when the relay tried to sleep, or while it watched the gate),
    ``idle`` (a worker found nothing more to claim and waits for the next wake-up),
    ``claimed``, ``claimed_none`` (a claim that got no row), ``published``, ``retried``,
    ``dead_lettered``, ``batch_done``,
    ``kafka_unavailable``, ``kafka_back`` (the end of a Kafka outage), ``db_error``,
    ``cleanup`` (published rows deleted by retention),
    ``cleanup_dead_letters`` (dead letters deleted by their retention).
    ``claimed``, ``published``, ``retried``, ``dead_lettered``, ``cleanup`` and
    ``cleanup_dead_letters`` count rows; the others count occurrences.
    """

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.seen = 0  # events emitted so far, of every name (for ``wait_after``)
        self._changed = asyncio.Event()
        self._hooks: list[Hook] = []
        self._batch_observers: list[BatchObserver] = []

    def add_hook(self, hook: Hook) -> None:
        """Call ``hook(name, amount)`` on every event (it must not block or raise)."""
        self._hooks.append(hook)

    def add_batch_observer(self, observer: BatchObserver) -> None:
        """Call ``observer(rows, outcome, unavailable)`` after every committed claim, for what
        counts alone cannot say: topics, and rows' ``created_at`` (it must not block or raise)."""
        self._batch_observers.append(observer)

    def report_batch(
        self, rows: Sequence[OutboxRow], outcome: BatchOutcome, unavailable: str | None
    ) -> None:
        """Report a committed claim to the batch observers."""
        for observer in self._batch_observers:
            observer(rows, outcome, unavailable)

    def emit(self, name: str, amount: int = 1) -> None:
        """Record ``amount`` occurrences of ``name``."""
        self.counts[name] += amount
        self.seen += 1
        for hook in self._hooks:
            hook(name, amount)
        self._changed.set()

    async def wait_for(self, name: str, at_least: int = 1) -> int:
        """Wait until ``name`` has been counted ``at_least`` times in total; bound it with a
        timeout of your own."""
        while self.counts[name] < at_least:
            self._changed.clear()
            await self._changed.wait()
        return self.counts[name]

    async def wait_after(self, seen: int) -> None:
        """Wait until an event of any name follows the first ``seen`` (read ``seen`` before
        looking at what the events change, e.g. a count in the database, so that none is
        missed); bound it with a timeout of your own."""
        while self.seen <= seen:
            self._changed.clear()
            await self._changed.wait()
