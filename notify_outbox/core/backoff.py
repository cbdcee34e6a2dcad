"""One backoff for every retry loop of the relay: exponential, capped, with jitter.

Each loop owns its own ``Backoff`` (one per worker, one for the listener, ...), so that N
failing workers do not double one shared delay N times, and each loop resets it only once
the thing it waits for has proven to work again.
"""

from __future__ import annotations

import random

import anyio

__all__ = ["Backoff"]


class Backoff:
    """Delays of ``first``, ``2*first``, ... up to ``cap`` seconds, each drawn uniformly from
    its upper half (jitter, so that relays do not retry in lock-step)."""

    def __init__(self, first: float, cap: float) -> None:
        self.first = first
        self.cap = max(cap, first)
        self._next = first
        self.failures = 0  # consecutive, since the last reset

    def next_delay(self) -> float:
        """The delay to wait now; the following one will be twice as long (up to the cap)."""
        delay = self._next * random.uniform(0.5, 1.0)
        self._next = min(self._next * 2, self.cap)
        self.failures += 1
        return delay

    async def sleep(self) -> None:
        """Wait for the next delay."""
        await anyio.sleep(self.next_delay())

    def reset(self) -> None:
        """Start again from ``first``: what was retried works again."""
        self._next = self.first
        self.failures = 0
