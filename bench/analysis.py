"""Turning one cell's raw timestamps into latencies, rates and a verdict.

The generator gives, per event index: scheduled time, send start, commit ack. The consumer
gives, per received index: receive time and the Kafka CreateTime (the publisher's ``send()``).
Only events *scheduled* inside the measured window count (warm-up events flow through the same
pipeline before it).
"""

from __future__ import annotations

import bisect
import math
import statistics
from array import array
from collections.abc import Iterable
from typing import Any

from bench.arrays import new_array
from bench.hist import Histogram

P99_LIMIT_MS = 100.0  # the latency part of "sustained"
RATE_TOLERANCE = 0.01  # achieved must be within 1 % of offered
STAGES = ("send_lag", "commit", "ack_to_publish", "publish_to_recv")


def is_flat(first: float, last: float) -> bool:
    """Whether a delay did not grow across the window (its backlog stayed flat): the median of
    the last fifth of the window is at most 1.5x that of the first fifth, plus 10 ms."""
    if math.isnan(first) or math.isnan(last):
        return False
    return last <= 1.5 * first + 10.0


def _median_ms(values: list[int]) -> float:
    return statistics.median(values) / 1e6 if values else math.nan


def median(values: Iterable[Any]) -> float | None:
    """The median of the numbers among ``values`` (None, NaN and missing values left out)."""
    vs = [
        float(v)
        for v in values
        if isinstance(v, int | float) and not (isinstance(v, float) and math.isnan(v))
    ]
    return statistics.median(vs) if vs else None


def by_index(got: dict[str, array[int]], n: int) -> tuple[array[int], array[int]]:
    """The consumer's receipt and Kafka CreateTime of each of ``n`` events, by event index
    (0: not received)."""
    recv = new_array(n)
    kts = new_array(n)
    for i, r, k in zip(got["index"], got["recv"], got["kafka_ts"], strict=True):
        if 0 <= i < n:
            recv[i] = r
            kts[i] = k
    return recv, kts


def window_indices(sched: array[int], window_start: int, window_end: int) -> range:
    """The indices of the events *scheduled* in the measured window (the schedule is sorted)."""
    return range(bisect.bisect_left(sched, window_start), bisect.bisect_left(sched, window_end))


def analyse_cell(
    gen: dict[str, array[int]],
    got: dict[str, array[int]],
    window_start: int,
    window_end: int,
) -> dict[str, Any]:
    """Latency histograms, stage breakdown, rates, backlog and the sustained verdict."""
    sched, send, ack = gen["sched"], gen["send"], gen["ack"]
    recv, kts = by_index(got, len(sched))
    seconds = (window_end - window_start) / 1e9
    window = window_indices(sched, window_start, window_end)
    lo, hi = window.start, window.stop
    e2e, ack_recv = Histogram(), Histogram()
    stages = {name: Histogram() for name in STAGES}
    unsent = failed = missing = 0
    fifth = max(1, (hi - lo) // 5)
    # Medians of the first and last fifth of the window: of the generator's lag (does it fall
    # behind?) and of ack->recv (does the mode fall behind?).
    first_lag: list[int] = []
    last_lag: list[int] = []
    first_lat: list[int] = []
    last_lat: list[int] = []
    for i in range(lo, hi):
        if not send[i]:
            unsent += 1
            continue
        if not ack[i]:
            failed += 1
            continue
        stages["send_lag"].record((send[i] - sched[i]) // 1000)
        stages["commit"].record((ack[i] - send[i]) // 1000)
        if i < lo + fifth:
            first_lag.append(ack[i] - sched[i])
        elif i >= hi - fifth:
            last_lag.append(ack[i] - sched[i])
        if not recv[i]:
            missing += 1
            continue
        lat = recv[i] - ack[i]
        e2e.record((recv[i] - sched[i]) // 1000)
        ack_recv.record((recv[i] - ack[i]) // 1000)
        stages["ack_to_publish"].record((kts[i] - ack[i]) // 1000)
        stages["publish_to_recv"].record((recv[i] - kts[i]) // 1000)
        if i < lo + fifth:
            first_lat.append(lat)
        elif i >= hi - fifth:
            last_lat.append(lat)
    events = hi - lo
    acks_in_window = sum(1 for v in ack if window_start <= v < window_end)
    recv_in_window = sum(1 for v in recv if window_start <= v < window_end)
    backlog = _backlog(ack, recv, window_start, window_end)
    first_ms, last_ms = _median_ms(first_lat), _median_ms(last_lat)
    lag_first_ms, lag_last_ms = _median_ms(first_lag), _median_ms(last_lag)
    offered = events / seconds if seconds > 0 else 0.0
    commit_rate = acks_in_window / seconds if seconds > 0 else 0.0
    p99 = e2e.value_at(99.0) / 1000.0
    # Why a cell is not sustained, first reason first: the producers could not commit at the
    # offered rate (generator or database: not the mode's fault, though it shares the CPU), the
    # mode fell behind (events missing, or latency growing through the window), or only the
    # p99 limit was exceeded.
    if (
        events == 0
        or unsent
        or failed
        or commit_rate < (1 - RATE_TOLERANCE) * offered
        or not is_flat(lag_first_ms, lag_last_ms)
    ):
        limit: str | None = "commit"
    elif missing or not is_flat(first_ms, last_ms):
        limit = "delivery"
    elif not p99 <= P99_LIMIT_MS:
        limit = "p99"
    else:
        limit = None
    keeps_up = limit in (None, "p99")
    return {
        "events": events,
        "offered_rate": offered,
        "commit_rate": commit_rate,
        "delivered_rate": recv_in_window / seconds if seconds > 0 else 0.0,
        "unsent": unsent,
        "failed": failed,
        "missing": missing,
        "ack_to_recv_median_first_fifth_ms": first_ms,
        "ack_to_recv_median_last_fifth_ms": last_ms,
        "schedule_to_ack_median_first_fifth_ms": lag_first_ms,
        "schedule_to_ack_median_last_fifth_ms": lag_last_ms,
        "backlog": backlog,
        "keeps_up": keeps_up,
        "sustained": limit is None,
        "limit": limit,
        "latency": {"e2e": e2e.summary_ms(), "ack_to_recv": ack_recv.summary_ms()},
        "stages": {name: h.summary_ms() for name, h in stages.items()},
        "hist": {"e2e": e2e.to_json(), "ack_to_recv": ack_recv.to_json()},
    }


def _backlog(
    ack: array[int], recv: array[int], start: int, end: int, step_ns: int = 500_000_000
) -> dict[str, Any]:
    """Committed-but-not-received events sampled every 0.5 s across the window."""
    acks = sorted(v for v in ack if v)
    recvs = sorted(v for v in recv if v)
    samples = []
    t = start
    while t <= end:
        samples.append(bisect.bisect_right(acks, t) - bisect.bisect_right(recvs, t))
        t += step_ns
    return {
        "step_s": step_ns / 1e9,
        "samples": samples,
        "max": max(samples) if samples else 0,
        "end": samples[-1] if samples else 0,
    }
