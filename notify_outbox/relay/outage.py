"""A quiet log while PostgreSQL or Kafka is away: one line when an outage starts, a reminder
every ``remind_every`` seconds, one line when it ends (with its duration and the rows held).

Workers report every failure here; only state changes reach the log. The same goes for
aiokafka's own loggers, which log every failed connection attempt (thousands of lines per
second while a broker restarts): ``tame_third_party_logs`` lets one line of each kind through
per interval and counts the rest.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["Outage", "RateLimitFilter", "tame_third_party_logs"]


class Outage:
    """The state of one dependency ("Kafka", "PostgreSQL") as seen by a relay.

    An outage may name another dependency that stands in the way of the same work (the
    Schema Registry, for Kafka's): ``failed(reason, dependency)``; ``dependency`` is the
    one named by the current (or last) outage."""

    def __init__(self, what: str, log: logging.Logger, *, remind_every: float = 30.0) -> None:
        self.what = what
        self.dependency = what
        self._log = log
        self._remind_every = remind_every
        self.started: float | None = None  # time.monotonic() of the first failure
        self._reminded = 0.0
        self.held = 0  # rows claimed during the outage and left pending
        self.count = 0  # outages so far

    @property
    def active(self) -> bool:
        """Whether the dependency is currently failing."""
        return self.started is not None

    def failed(self, reason: str, dependency: str | None = None) -> bool:
        """Record a failure of ``dependency`` (default: this outage's own); logs (and
        returns True) only for the first of an outage, which names the dependency."""
        if self.started is not None:
            return False
        self.dependency = dependency or self.what
        self.started = self._reminded = time.monotonic()
        self.held = 0
        self.count += 1
        self._log.warning(
            "%s unavailable (%s); rows stay pending",
            self.dependency,
            reason,
            extra={"dependency": self.dependency, "outage": "started", "reason": reason},
        )
        return True

    def remind(self) -> None:
        """Log a reminder if the outage has lasted another ``remind_every`` seconds."""
        if self.started is None:
            return
        now = time.monotonic()
        if now - self._reminded >= self._remind_every:
            self._reminded = now
            self._log.warning(
                "%s still unavailable after %.0fs; %d claimed rows given back so far",
                self.dependency,
                now - self.started,
                self.held,
                extra={
                    "dependency": self.dependency,
                    "outage": "ongoing",
                    "outage_seconds": round(now - self.started, 3),
                    "rows_given_back": self.held,
                },
            )

    def recovered(self, pending: int | None = None) -> float | None:
        """Record a success; logs the end of an outage (returns its duration) if one was on."""
        if self.started is None:
            return None
        duration = time.monotonic() - self.started
        self.started = None
        backlog = "" if pending is None else f"; {pending} rows pending now"
        self._log.warning(
            "%s available again after %.1fs; %d claimed rows were given back meanwhile%s",
            self.dependency,
            duration,
            self.held,
            backlog,
            extra={
                "dependency": self.dependency,
                "outage": "ended",
                "outage_seconds": round(duration, 3),
                "rows_given_back": self.held,
                "rows_pending": pending,
            },
        )
        return duration


class RateLimitFilter(logging.Filter):
    """Lets through one record per (logger, message template) every ``interval`` seconds; the
    next one that passes says how many were dropped meanwhile. DEBUG records pass untouched."""

    def __init__(self, interval: float = 60.0) -> None:
        super().__init__()
        self.interval = interval
        self._last: dict[tuple[str, str], float] = {}
        self._dropped: dict[tuple[str, str], int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno <= logging.DEBUG:
            return True
        key = (record.name, str(record.msg))
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self.interval:
            self._dropped[key] = self._dropped.get(key, 0) + 1
            return False
        self._last[key] = now
        dropped = self._dropped.pop(key, 0)
        if dropped:
            record.msg = f"{record.msg} ({dropped} similar lines suppressed)"
        if record.exc_info and record.levelno <= logging.WARNING:
            # A library's warning about a retry it makes (asyncpg's pool refilling itself)
            # needs the error, not a dozen lines of its traceback.
            error = record.exc_info[1]
            if error is not None:
                record.msg = f"{record.msg} ({type(error).__name__}: {error})"
            record.exc_info = None
            record.exc_text = None
        return True


# aiokafka logs every failed connection attempt; asyncpg's pool logs a traceback each time it
# fails to restore its minimum size while PostgreSQL is down.
_THIRD_PARTY = ("aiokafka", "asyncpg")
_installed: list[tuple[logging.Logger, RateLimitFilter]] = []
_users = 0


@contextmanager
def tame_third_party_logs(interval: float = 60.0) -> Iterator[None]:
    """While any relay runs, rate-limit aiokafka's and asyncpg's loggers (installed once,
    removed by the last relay to stop). A logger filter applies only to records logged on that
    very logger, so every one of their loggers gets it; the modules create theirs at import."""
    global _users
    if _users == 0:
        names = [
            name
            for name in logging.root.manager.loggerDict
            if name in _THIRD_PARTY or name.startswith(tuple(p + "." for p in _THIRD_PARTY))
        ]
        limiter = RateLimitFilter(interval)
        for name in names:
            logger = logging.getLogger(name)
            logger.addFilter(limiter)
            _installed.append((logger, limiter))
    _users += 1
    try:
        yield
    finally:
        _users -= 1
        if _users == 0:
            for logger, limiter in _installed:
                logger.removeFilter(limiter)
            _installed.clear()
