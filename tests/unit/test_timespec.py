"""Durations and times as operators type them (``--since``, ``--older-than``, retention)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from notify_outbox.core.timespec import (
    duration_seconds,
    format_duration,
    parse_duration,
    parse_time,
)

NOW = datetime(2026, 11, 23, 7, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90s", 90),
        ("30m", 1800),
        ("12h", 43200),
        ("7d", 7 * 86400),
        ("1w", 7 * 86400),
        ("1h30m", 5400),
        ("250ms", 0.25),
        ("1m30s", 90),
        ("1s500ms", 1.5),
        ("1.5d", 1.5 * 86400),
        (" 30M ", 1800),
        ("P7D", 7 * 86400),
        ("PT30M", 1800),
        ("P1DT2H", 93600),
        ("p1w", 7 * 86400),
        ("3600", 3600),
        ("0.5", 0.5),
    ],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == timedelta(seconds=seconds)


@pytest.mark.parametrize("text", ["", "7x", "d7", "-1d", "0s", "0", "P", "PT", "P1M", "1y", "7 d"])
def test_bad_durations_say_what_is_accepted(text: str) -> None:
    with pytest.raises(ValueError, match="invalid duration") as e:
        parse_duration(text)
    assert "\n" not in str(e.value)


def test_duration_seconds_allows_zero_and_never_quotes_its_input() -> None:
    # Settings apply their own bounds (keep_published=0s is valid), and a setting's value
    # stays out of the message.
    assert duration_seconds("0s") == 0.0
    assert duration_seconds(" 250ms ") == 0.25
    assert duration_seconds("2d") == 172800.0
    for text in ("5 parsecs", "-1s", "99999999999999d"):
        with pytest.raises(ValueError, match="invalid duration") as e:
            duration_seconds(text)
        assert text not in str(e.value)


def test_an_absurd_duration_is_an_error_not_a_crash() -> None:
    with pytest.raises(ValueError, match="too long"):
        parse_duration("99999999999999d")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("now", NOW),
        ("2h", NOW - timedelta(hours=2)),
        ("7d", NOW - timedelta(days=7)),
        ("2026-11-20", datetime(2026, 11, 20, tzinfo=UTC)),
        ("2026-11-20T06:30:00Z", datetime(2026, 11, 20, 6, 30, tzinfo=UTC)),
        ("2026-11-20 06:30", datetime(2026, 11, 20, 6, 30, tzinfo=UTC)),  # no offset: UTC
        (
            "2026-11-20T07:30:00+01:00",
            datetime(2026, 11, 20, 7, 30, tzinfo=timezone(timedelta(hours=1))),
        ),
    ],
)
def test_times(text: str, expected: datetime) -> None:
    got = parse_time(text, now=NOW)
    assert got == expected
    assert got.tzinfo is not None


@pytest.mark.parametrize("text", ["yesterday", "2026-13-01", "1700000000", "", "2h ago"])
def test_bad_times_say_what_is_accepted(text: str) -> None:
    with pytest.raises(ValueError, match="invalid time") as e:
        parse_time(text, now=NOW)
    assert "ISO-8601" in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("seconds", "text"), [(0, "0s"), (45, "45s"), (720, "12m"), (7 * 86400, "7d"), (93600, "1d2h")]
)
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text
