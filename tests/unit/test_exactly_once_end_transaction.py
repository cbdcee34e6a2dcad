"""A transaction whose producer's state machine is broken is a failed transaction, not a crash
(relay/exactly_once.py, ``_end_transaction``)."""

from __future__ import annotations

import pytest
from aiokafka import errors as kafka_errors
from aiokafka.producer.transaction_manager import TransactionManager, TransactionState

from notify_outbox.relay.exactly_once import _end_transaction

pytestmark = pytest.mark.anyio


async def test_aiokafkas_fatal_state_assertion_becomes_a_kafka_error() -> None:
    # What aiokafka does when its sender routine crashed on a lost connection: the manager is
    # in FATAL_ERROR, and beginning an abort fails the state machine's assert.
    manager = TransactionManager("tid", 60000)
    manager._transition_to(TransactionState.FATAL_ERROR)  # as fatal_error() leaves it
    assert manager.state == TransactionState.FATAL_ERROR

    async def abort() -> None:
        manager.aborting_transaction()

    with pytest.raises(kafka_errors.KafkaError, match="transaction state is broken") as raised:
        await _end_transaction(abort(), 5)
    assert isinstance(raised.value.__cause__, AssertionError)


async def test_other_failures_and_success_pass_through() -> None:
    async def refused() -> None:
        raise kafka_errors.KafkaConnectionError("gone")

    async def fine() -> None:
        return None

    with pytest.raises(kafka_errors.KafkaConnectionError):
        await _end_transaction(refused(), 5)
    await _end_transaction(fine(), 5)
