"""How long a claim may sit idle before PostgreSQL ends it: fixed, or learnt from this relay.

A claim holds its keys in an open transaction. PostgreSQL ends a claim left idle longer than
its ``idle_in_transaction_session_timeout`` (set in the claim's BEGIN), and that is how a
frozen relay (SIGSTOP, a VM pause, a debugger) gives its keys back to the fleet: the shorter
the timeout, the sooner. But a relay that is only slow (its event loop starved by a CPU limit,
a GC pause, a busy host, a distant database) looks the same from the server, and a claim ended
under it is published twice. Nothing tells the two apart faster than the slow relay's own
stalls, so in ``auto`` mode the timeout follows them: a multiple of the recent stalls of this
relay's event loop and of its round trips to PostgreSQL, between 0.1 and 2 s. A freeze of
seconds is one sample among thousands and does not move the quantile; a loop that stalls often
does, within seconds.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import anyio

#: Bounds of the auto timeout (s). The floor keeps a frozen relay's keys from waiting more
#: than about a tenth of a second on a healthy host; the ceiling is the fixed default of
#: earlier releases.
AUTO_FLOOR = 0.1
AUTO_CEILING = 2.0
#: The timeout is this many times the recent stall quantile: a claim is lost only to a stall
#: several times longer than the worst of all but one in a hundred.
AUTO_FACTOR = 4.0
QUANTILE = 0.99
#: How often the watch looks at the event loop (s), and how many of its recent looks count
#: (4096 x 20 ms: the last 80 s or so).
TICK = 0.02
SAMPLES = 4096
#: Until this many looks were made, auto mode keeps the ceiling (a starting process stalls:
#: imports, first connections).
WARMUP = 50


class Stalls:
    """Recent delays: keeps the last ``SAMPLES`` and answers their ``QUANTILE``, recomputed
    at every sample while there are few, then after every 64 (sorting 4096 floats costs
    about half a millisecond)."""

    def __init__(self, size: int = SAMPLES) -> None:
        self._samples: deque[float] = deque(maxlen=size)
        self._fresh = 0
        self._quantile = 0.0

    def __len__(self) -> int:
        return len(self._samples)

    def add(self, seconds: float) -> None:
        self._samples.append(seconds)
        self._fresh += 1
        if self._fresh >= 64 or len(self._samples) <= 256:
            self._recompute()

    def quantile(self) -> float:
        return self._quantile

    def _recompute(self) -> None:
        self._fresh = 0
        ordered = sorted(self._samples)
        self._quantile = ordered[min(len(ordered) - 1, int(QUANTILE * len(ordered)))]


class ClaimIdleTimeout:
    """The ``idle_in_transaction_session_timeout`` of the next claim (seconds).

    ``fixed``: a number from the settings, used as it is; ``None``: auto (see the module).
    ``loop`` is fed by ``watch_loop`` (how late the event loop runs a timer), ``round_trips``
    by the store (each claim's BEGIN, which includes the network and the loop's delays)."""

    def __init__(self, fixed: float | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.fixed = fixed
        self.loop = Stalls()
        self.round_trips = Stalls()
        self._clock = clock

    @property
    def auto(self) -> bool:
        return self.fixed is None

    def current(self) -> float:
        if self.fixed is not None:
            return self.fixed
        if len(self.loop) < WARMUP:
            return AUTO_CEILING
        stall = max(self.loop.quantile(), self.round_trips.quantile())
        return min(AUTO_CEILING, max(AUTO_FLOOR, AUTO_FACTOR * stall))

    def round_trip(self, seconds: float) -> None:
        self.round_trips.add(seconds)

    async def watch_loop(self) -> None:
        """Measure how late the event loop wakes a sleeping task, forever (auto mode only:
        a fixed timeout needs no measure)."""
        if not self.auto:
            return
        clock = self._clock
        while True:
            start = clock()
            await anyio.sleep(TICK)
            self.loop.add(max(0.0, clock() - start - TICK))
