"""The exactly-once relay shortens aiokafka's wait after CONCURRENT_TRANSACTIONS by setting a
module constant of aiokafka's sender: these tests fail when an aiokafka upgrade stops reading
it, so that the 20 ms stall per batch cannot come back unnoticed."""

from __future__ import annotations

import inspect

import aiokafka.producer.sender as sender
import pytest

from notify_outbox.relay import exactly_once
from notify_outbox.relay.exactly_once import CONCURRENT_TRANSACTIONS_BACKOFF


def test_aiokafka_reads_the_backoff_constant_when_a_first_partition_meets_a_commit() -> None:
    source = inspect.getsource(sender.AddPartitionsToTxnHandler.handle_response)
    assert "ConcurrentTransactions" in source
    assert "return BACKOFF_OVERRIDE" in source


def test_the_relay_sets_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sender, "BACKOFF_OVERRIDE", 0.02)
    exactly_once._shorten_concurrent_transactions_backoff()
    assert sender.BACKOFF_OVERRIDE == CONCURRENT_TRANSACTIONS_BACKOFF < 0.02
