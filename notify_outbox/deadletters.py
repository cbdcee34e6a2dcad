"""Moved to ``notify_outbox.pg.deadletters``; this module re-exports its public names."""

from .pg.deadletters import (
    DeadLetter,
    DeadLetterFilter,
    RequeueResult,
    count_dead_letters,
    expire_dead_letters,
    get_dead_letter,
    list_dead_letters,
    purge,
    requeue,
)

__all__ = [
    "DeadLetter",
    "DeadLetterFilter",
    "RequeueResult",
    "count_dead_letters",
    "expire_dead_letters",
    "get_dead_letter",
    "list_dead_letters",
    "purge",
    "requeue",
]
