"""Durations and points in time as operators type them: ``30m``, ``7d``, ``1h30m``, ``P7D``,
``2026-11-23T06:00:00Z``.

Used by the dead-letter and replay commands (``--since``, ``--until``, ``--older-than``) and by
every duration setting (``poll_interval``, ``dead_letter_retention``, ...). Every parser raises
``ValueError`` with a message that says what is accepted, so the command line can print it as
one line.
"""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime, timedelta

__all__ = ["DURATION_HELP", "duration_seconds", "format_duration", "parse_duration", "parse_time"]

_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
# One or more <number><unit> parts, largest unit first or not: "250ms", "90s", "1h30m", "1.5d".
# "ms" is tried before "m", so "1m30s" is still a minute and a half.
_SHORT = re.compile(r"(?:\d+(?:\.\d+)?(?:ms|[smhdw]))+")
_SHORT_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|[smhdw])")
# ISO-8601 durations without years or months (their length varies): P7D, PT30M, P1W, P1DT2H.
_ISO = re.compile(
    r"P(?:(?P<w>\d+(?:\.\d+)?)W)?(?:(?P<d>\d+(?:\.\d+)?)D)?"
    r"(?:T(?:(?P<h>\d+(?:\.\d+)?)H)?(?:(?P<m>\d+(?:\.\d+)?)M)?(?:(?P<s>\d+(?:\.\d+)?)S)?)?"
)
#: What a duration may look like, for error messages and help texts.
DURATION_HELP = "a duration such as 250ms, 90s, 30m, 12h, 7d, 1w, 1h30m or ISO-8601 P7D / PT30M"
_TIME_HELP = (
    "an ISO-8601 time such as 2026-11-23 or 2026-11-23T06:00:00Z, 'now', "
    f"or {DURATION_HELP} (meaning that long ago)"
)


def _seconds(value: str) -> float | None:
    """The seconds ``value`` (stripped) spells, zero included; None if it spells none."""
    if re.fullmatch(r"\d+(?:\.\d+)?", value):
        return float(value)
    if _SHORT.fullmatch(value.lower()):
        return sum(float(n) * _UNITS[u] for n, u in _SHORT_PART.findall(value.lower()))
    m = _ISO.fullmatch(value.upper())
    if m and any(m.groupdict().values()) and not value.upper().endswith("T"):
        return sum(float(v) * _UNITS[k] for k, v in m.groupdict().items() if v is not None)
    return None


def duration_seconds(text: str) -> float:
    """The length of a duration in seconds, zero allowed (the caller applies its own bounds):
    ``250ms``, ``5s``, ``1m``, ``1h30m``, ``2d``, ISO-8601 ``PT5S``, or a plain number. The
    error message never quotes ``text`` (a setting's value stays out of logs)."""
    seconds = _seconds(text.strip())
    if seconds is None:
        raise ValueError(f"invalid duration: use a number of seconds or {DURATION_HELP}")
    if not math.isfinite(seconds) or seconds > timedelta.max.total_seconds():
        raise ValueError("invalid duration: too long")
    return seconds


def parse_duration(text: str) -> timedelta:
    """A positive duration: ``250ms``, ``90s``, ``30m``, ``12h``, ``7d``, ``1w``, combinations
    such as ``1h30m``, ISO-8601 ``P7D`` / ``PT30M``, or a plain number of seconds."""
    seconds = _seconds(text.strip())
    if seconds is None:
        raise ValueError(f"invalid duration {text!r}: use {DURATION_HELP}")
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
