"""How long a claim may sit idle before PostgreSQL ends it: fixed, or learnt from this relay.

A claim holds its keys in an open transaction. PostgreSQL ends a claim left idle longer than
its ``idle_in_transaction_session_timeout`` (set in the claim's BEGIN), and that is how a
frozen relay (SIGSTOP, a VM pause, a debugger) gives its keys back to the fleet: the shorter
the timeout, the sooner. But a relay that is only slow (its event loop starved by a CPU limit,
a GC pause, a busy host, a distant database) looks the same from the server, and a claim ended
under it is published twice. Nothing tells the two apart faster than the slow relay's own
stalls, so in ``auto`` mode the timeout follows them: three times the worst recent stall of this
relay's event loop plus its worst recent round trip to PostgreSQL, between 0.1 and 2 s. A worse
stall raises it at once; it comes down once the stall is out of the window (80 s). A freeze
longer than 2 s does not count: whatever the timeout, the claim is lost to it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable

log = logging.getLogger("notify_outbox.stalls")

#: Bounds of the auto timeout (s). The floor keeps a frozen relay's keys from waiting more
#: than about a tenth of a second on a healthy host; the ceiling is the fixed default of
#: earlier releases.
AUTO_FLOOR = 0.1
AUTO_CEILING = 2.0
#: The timeout is this many times the worst recent stall of the event loop plus the worst
#: recent BEGIN round trip. While Kafka's acks are awaited, the server sees a claim idle
#: between two renewals for a quarter of the timeout plus a round trip plus the loop's delay
#: in answering: three times their worst keeps that under half the timeout.
FACTOR = 3.0
#: How often the watch looks at the event loop (s), and how many of its recent looks count
#: (4000 x 20 ms: 80 s of claiming). A stall shows in full when a look was due as it began,
#: else less what was left of the look's sleep: a short tick measures stalls closely (a 50 ms
#: one let a CI run lose a claim to a stall it had under-measured).
TICK = 0.02
SAMPLES = 4000
#: Until this many looks were made, auto mode keeps the ceiling (a starting process stalls:
#: imports, first connections).
WARMUP = 50
#: The watch rests after this long without a claim (s): what counts is how the loop behaves
#: while claims are open, and an idle relay should cost nothing (a look costs ~150 µs of CPU
#: on this VM: 0.75% of a core at 50 a second, while claims come).
REST_AFTER = 10.0


class Stalls:
    """Recent delays: keeps the last ``SAMPLES``, and answers the worst of them below
    ``AUTO_CEILING`` (a relay gone longer than that loses its claim whatever the timeout: a
    freeze, not a stall to allow for). A worse sample counts at once; the worst is looked for
    again after every 64 samples (4000 floats: a few tens of microseconds)."""

    def __init__(self, size: int = SAMPLES) -> None:
        self._samples: deque[float] = deque(maxlen=size)
        self._fresh = 0
        self._worst = 0.0

    def __len__(self) -> int:
        return len(self._samples)

    def add(self, seconds: float) -> None:
        self._samples.append(seconds)
        self._fresh += 1
        if self._worst < seconds < AUTO_CEILING:
            self._worst = seconds
        if self._fresh >= 64:
            # Samples leave the window as others come: the worst may have left it.
            self._fresh = 0
            self._worst = max((s for s in self._samples if s < AUTO_CEILING), default=0.0)

    def worst(self) -> float:
        return self._worst


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
        self._told = AUTO_CEILING  # the value last logged
        self._claimed_at = -REST_AFTER  # when a claim last asked for the timeout
        #: The timeout the latest claim was given (``for_claim``); None before the first.
        self.given: float | None = None
        self._claiming = asyncio.Event()  # set while claims come

    @property
    def auto(self) -> bool:
        return self.fixed is None

    def current(self) -> float:
        if self.fixed is not None:
            return self.fixed
        if len(self.loop) < WARMUP:
            return AUTO_CEILING
        wanted = FACTOR * (self.loop.worst() + self.round_trips.worst())
        return min(AUTO_CEILING, max(AUTO_FLOOR, wanted))

    def for_claim(self) -> float:
        """``current()`` for a claim about to start (which also wakes a resting watch)."""
        if self.fixed is not None:
            self.given = self.fixed
            return self.fixed
        self._claimed_at = self._clock()
        if not self._claiming.is_set():
            self._claiming.set()
        self.given = self.current()
        return self.given

    def round_trip(self, seconds: float) -> None:
        if self.fixed is None:  # a fixed timeout needs no measure
            self.round_trips.add(seconds)

    async def watch_loop(self) -> None:
        """Measure how late the event loop wakes a sleeping task, while claims come (auto
        mode only: a fixed timeout needs no measure)."""
        if not self.auto:
            return
        clock = self._clock
        while True:
            if clock() - self._claimed_at > REST_AFTER:
                self._claiming.clear()
                await self._claiming.wait()
            start = clock()
            await asyncio.sleep(TICK)  # not anyio's: its checkpoints double the cost
            self.loop.add(max(0.0, clock() - start - TICK))
            self._tell()

    def _tell(self) -> None:
        # Operators see the timeout move when it doubles or halves (rare: it follows the
        # host's load), with the stall behind it.
        now = self.current()
        if now >= 2 * self._told or now <= self._told / 2:
            log.info(
                "claim idle timeout now %.2fs (auto: the event loop's worst recent stall "
                "%.3fs, worst recent BEGIN round trip %.3fs)",
                now,
                self.loop.worst(),
                self.round_trips.worst(),
            )
            self._told = now
