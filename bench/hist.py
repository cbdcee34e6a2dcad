"""A small log-linear latency histogram with microsecond resolution.

Values are whole microseconds. Below 256 µs every microsecond has its own bucket; above, each
power of two is split into 128 equal buckets, so a reported value is within 0.4 % of the true
one (the bucket midpoint is reported; the minimum and maximum are kept exactly). The
histogram is sparse (a dict), merges by adding counts, and round-trips through JSON.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

# Precision: values below 2**_P are exact; above, 2**(_P - 1) buckets per power of two.
_P = 8
_EXACT = 1 << _P
_HALF = 1 << (_P - 1)

PERCENTILES: tuple[float, ...] = (50.0, 95.0, 99.0, 99.9)


def _index(v: int) -> int:
    if v < _EXACT:
        return v
    e = v.bit_length() - _P
    return (e << (_P - 1)) + (v >> e)


def _bounds(index: int) -> tuple[int, int]:
    """The lowest and highest value (inclusive) that map to ``index``."""
    if index < _EXACT:
        return index, index
    e = (index >> (_P - 1)) - 1
    m = index - (e << (_P - 1))
    return m << e, ((m + 1) << e) - 1


class Histogram:
    """Counts of latencies in microseconds; negative inputs count as 0 (and are tallied)."""

    __slots__ = ("buckets", "count", "max_us", "min_us", "negative", "sum_us")

    def __init__(self) -> None:
        self.buckets: dict[int, int] = {}
        self.count = 0
        self.sum_us = 0
        self.min_us = 0
        self.max_us = 0
        self.negative = 0

    def record(self, value_us: int) -> None:
        """Count one value (microseconds)."""
        if value_us < 0:
            self.negative += 1
            value_us = 0
        i = _index(value_us)
        self.buckets[i] = self.buckets.get(i, 0) + 1
        if self.count == 0 or value_us < self.min_us:
            self.min_us = value_us
        if value_us > self.max_us:
            self.max_us = value_us
        self.count += 1
        self.sum_us += value_us

    def record_ns(self, values_ns: Iterable[int]) -> None:
        """Count many values given in nanoseconds (truncated to microseconds)."""
        for v in values_ns:
            self.record(v // 1000 if v >= 0 else -1)

    def merge(self, other: Histogram) -> None:
        """Add ``other``'s counts to this histogram."""
        if other.count == 0:
            return
        for i, n in other.buckets.items():
            self.buckets[i] = self.buckets.get(i, 0) + n
        self.min_us = other.min_us if self.count == 0 else min(self.min_us, other.min_us)
        self.max_us = max(self.max_us, other.max_us)
        self.count += other.count
        self.sum_us += other.sum_us
        self.negative += other.negative

    def value_at(self, percentile: float) -> float:
        """The value (µs) at ``percentile`` (0-100]: the midpoint of the bucket holding that
        rank, clamped to the exact minimum and maximum. NaN when empty."""
        if self.count == 0:
            return math.nan
        if percentile >= 100.0:
            return float(self.max_us)
        rank = max(1, math.ceil(percentile / 100.0 * self.count))
        seen = 0
        for i in sorted(self.buckets):
            seen += self.buckets[i]
            if seen >= rank:
                lo, hi = _bounds(i)
                mid = (lo + hi) / 2.0
                return float(min(max(mid, self.min_us), self.max_us))
        return float(self.max_us)  # pragma: no cover - counts are consistent

    def mean(self) -> float:
        """Mean in µs (NaN when empty)."""
        return self.sum_us / self.count if self.count else math.nan

    def summary_ms(self) -> dict[str, float]:
        """count, mean, p50/p95/p99/p99.9 and max, in milliseconds."""
        out: dict[str, float] = {"count": float(self.count), "mean": self.mean() / 1000.0}
        for p in PERCENTILES:
            out[f"p{p:g}"] = self.value_at(p) / 1000.0
        out["max"] = self.max_us / 1000.0 if self.count else math.nan
        return out

    def cdf(self) -> tuple[list[float], list[float]]:
        """Points (value in ms at each bucket's upper bound, cumulative fraction) for a CDF."""
        xs: list[float] = []
        ys: list[float] = []
        seen = 0
        for i in sorted(self.buckets):
            seen += self.buckets[i]
            _, hi = _bounds(i)
            xs.append(min(hi, self.max_us) / 1000.0)
            ys.append(seen / self.count)
        return xs, ys

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict; ``from_json`` reads it back."""
        return {
            "count": self.count,
            "sum_us": self.sum_us,
            "min_us": self.min_us,
            "max_us": self.max_us,
            "negative": self.negative,
            "buckets": [[i, self.buckets[i]] for i in sorted(self.buckets)],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Histogram:
        """The histogram ``to_json`` wrote."""
        h = cls()
        h.count = int(data["count"])
        h.sum_us = int(data["sum_us"])
        h.min_us = int(data["min_us"])
        h.max_us = int(data["max_us"])
        h.negative = int(data.get("negative", 0))
        h.buckets = {int(i): int(n) for i, n in data["buckets"]}
        return h
