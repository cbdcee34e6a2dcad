"""What the inbox raises: every error is an ``InboxError`` (a ``NotifyOutboxError``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from notify_outbox.core.errors import MigrationError, NotifyOutboxError

if TYPE_CHECKING:
    from .core import BatchResult

__all__ = [
    "BadEventId",
    "HandlerFailed",
    "InTransaction",
    "InboxError",
    "InboxNotMigrated",
    "NotInTransaction",
]


class InboxError(NotifyOutboxError):
    """Base class of the inbox's errors."""

    # Set when the error stopped a batch (``apply_each``/``apply_batch``): what was done.
    result: BatchResult | None = None


class BadEventId(InboxError, ValueError):
    """A message has no event id, or one that is malformed (see ``Inbox(on_bad_id=...)``)."""


class NotInTransaction(InboxError):
    """``Inbox.process`` was called outside a transaction, where it could not protect anything."""


class InboxNotMigrated(InboxError, MigrationError):
    """The inbox table does not exist in the consumer's database."""


class InTransaction(InboxError):
    """``apply``, ``apply_each``, ``apply_batch`` or ``consume`` got a connection inside an
    open transaction, whose commit they could not wait for."""


class HandlerFailed(InboxError):
    """The handler failed on ``message`` (``on_error="stop"``); the messages before it are
    applied (``result.done`` of them), it and the ones after it are not. The handler's error
    is the ``__cause__``."""

    def __init__(self, text: str, message: Any) -> None:
        super().__init__(text)
        self.message = message
