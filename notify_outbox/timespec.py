"""Durations and points in time as operators type them: ``30m``, ``7d``, ``1h30m``, ``P7D``,
``2026-11-23T06:00:00Z``.

Used by the dead-letter and replay commands (``--since``, ``--until``, ``--older-than``) and by
the ``dead_letter_retention`` setting. Every parser raises ``ValueError`` with a message that
says what is accepted, so the command line can print it as one line.
"""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime, timedelta

__all__ = ["format_duration", "parse_duration", "parse_time"]

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
# One or more <number><unit> parts, largest unit first or not: "90s", "1h30m", "1.5d".
_SHORT = re.compile(r"(?:\d+(?:\.\d+)?[smhdw])+")
_SHORT_PART = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
# ISO-8601 durations without years or months (their length varies): P7D, PT30M, P1W, P1DT2H.
_ISO = re.compile(
    r"P(?:(?P<w>\d+(?:\.\d+)?)W)?(?:(?P<d>\d+(?:\.\d+)?)D)?"
    r"(?:T(?:(?P<h>\d+(?:\.\d+)?)H)?(?:(?P<m>\d+(?:\.\d+)?)M)?(?:(?P<s>\d+(?:\.\d+)?)S)?)?"
)
_DURATION_HELP = "a duration such as 90s, 30m, 12h, 7d, 1w, 1h30m or ISO-8601 P7D / PT30M"
_TIME_HELP = (
    "an ISO-8601 time such as 2026-11-23 or 2026-11-23T06:00:00Z, 'now', "
    f"or {_DURATION_HELP} (meaning that long ago)"
)


def parse_duration(text: str) -> timedelta:
    """A positive duration: ``90s``, ``30m``, ``12h``, ``7d``, ``1w``, combinations such as
    ``1h30m``, ISO-8601 ``P7D`` / ``PT30M``, or a plain number of seconds."""
    value = text.strip()
    seconds: float | None = None
    if re.fullmatch(r"\d+(?:\.\d+)?", value):
        seconds = float(value)
    elif _SHORT.fullmatch(value.lower()):
        seconds = sum(float(n) * _UNITS[u] for n, u in _SHORT_PART.findall(value.lower()))
    else:
        m = _ISO.fullmatch(value.upper())
        if m and any(m.groupdict().values()) and not value.upper().endswith("T"):
            seconds = sum(float(v) * _UNITS[k] for k, v in m.groupdict().items() if v is not None)
    if seconds is None:
        raise ValueError(f"invalid duration {text!r}: use {_DURATION_HELP}")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"invalid duration {text!r}: it must be longer than zero")
    try:
        return timedelta(seconds=seconds)
    except OverflowError:
        raise ValueError(f"invalid duration {text!r}: too long") from None


def parse_time(text: str, *, now: datetime | None = None) -> datetime:
    """A point in time, timezone-aware: an ISO-8601 date or date-time (without an offset it
    is taken as UTC), ``now``, or a duration meaning that long before ``now`` (``7d``)."""
    value = text.strip()
    current = now if now is not None else datetime.now(UTC)
    if value.lower() == "now":
        return current
    try:
        ago = parse_duration(value)
    except ValueError:
        pass
    else:
        # A bare number is far more likely a mistyped date than "that many seconds ago".
        if not value.replace(".", "").isdigit():
            return current - ago
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(f"invalid time {text!r}: use {_TIME_HELP}") from None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


def format_duration(seconds: float) -> str:
    """A short human form of ``seconds``: ``45s``, ``12m``, ``3h``, ``2d``, ``1d6h``."""
    total = round(seconds)
    if total < 60:
        return f"{max(total, 0)}s"
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        n, total = divmod(total, size)
        if n:
            parts.append(f"{n}{unit}")
    return "".join(parts[:2])
