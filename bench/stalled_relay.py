"""The stalled-relay regime (``python -m bench stalled-relay``): what one relay frozen with
SIGSTOP (the holder of the gated notify's awake marker, found in ``pg_locks``) costs the rest of
a fleet; per phase and, during a freeze, per key (in a bucket the frozen relay held, or not).
Method: ``bench/README.md``, "Stalled relay"."""

from __future__ import annotations

import argparse
import bisect
import contextlib
import dataclasses
import json
import signal
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import envinfo
from bench.analysis import median
from bench.arrays import load_arrays
from bench.config import Mode, PhaseConfig, add_options, common_options, from_args, phase_options
from bench.fmt import (
    environment_lines,
    finish,
    modes_section,
    ms,
    num,
    pct,
    percent,
    share,
    table,
    targets_section,
)
from bench.hist import Histogram
from bench.phase import PhaseRun, loadavg
from bench.procs import BenchError, Child, tcp_ports
from bench.regimes import (
    Cells,
    Looker,
    Regime,
    acked_events,
    cell_record,
    event_counts,
    latency_ms,
    received_at,
    regime_mode,
    target,
    unfinished,
)
from bench.services import Services, connection
from notify_outbox import OutboxNames

NOTIFY_MODES = ("gated", "always")
PHASES = ("baseline", "freeze", "between", "recovery")
_QUERY_TIMEOUT = 10.0
_FREEZER_TIMEOUT = 10.0
_GUARD_NS = 1_000_000_000  # the end of the baseline before the first freeze, in no phase
# Codes of the watch's timeline besides a relay's index: who held the current epoch's marker.
_UNMAPPED, _NOBODY, _UNKNOWN = -1, -2, -3

# Every session of a relay in the cell's database, its transaction, and the advisory locks it
# holds of two namespaces ($1: the awake marker, $2: the claim's key buckets; two-key locks show
# the first key as classid and the second as objid, objsubid 2), plus the current epoch.
_LOOK = """
WITH cur AS MATERIALIZED (SELECT {cur}::bigint AS e),
l AS MATERIALIZED (
    SELECT pid, classid::bigint AS ns, objid::bigint AS k FROM pg_locks
    WHERE locktype = 'advisory' AND objsubid = 2 AND granted AND mode = 'ExclusiveLock'
      AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
      AND classid::bigint IN ($1, $2)
),
s AS (
    SELECT a.pid, a.client_port,
           extract(epoch FROM clock_timestamp() - a.xact_start)::float8 AS xact_age,
           a.backend_xid IS NOT NULL AS has_xid,
           ARRAY(SELECT l.k FROM l WHERE l.pid = a.pid AND l.ns = $1 ORDER BY l.k) AS awake,
           ARRAY(SELECT l.k FROM l WHERE l.pid = a.pid AND l.ns = $2 ORDER BY l.k) AS buckets
    FROM pg_stat_activity AS a
    WHERE a.datname = current_database() AND a.application_name LIKE 'notify-outbox-%'
)
SELECT cur.e AS cur, s.* FROM cur LEFT JOIN s ON true
"""
_CURRENT_EPOCH = "(SELECT outbox_awake_epoch(c.awake_epoch_ms) FROM outbox_config AS c)"
# The claim bucket of each of the writers' keys k0 .. k<n-1> (migration 0005's bucket).
_KEY_BUCKETS = (
    "SELECT array_agg(hashtext('k' || g) & 255 ORDER BY g) FROM generate_series(0, $1 - 1) AS g"
)


@dataclass
class StalledRelayConfig(PhaseConfig):
    """Everything one stalled-relay run does; recorded in the result JSON."""

    rate: float = 1200.0
    keys: list[int] = field(default_factory=lambda: [20, 5000])
    notify_modes: list[str] = field(default_factory=lambda: list(NOTIFY_MODES))
    relays: int = 2
    warmup: float = 2.0  # load before the baseline (relays' first claims), in no phase
    baseline: float = 20.0
    freezes: int = 6
    freeze: float = 6.0
    gap: float = 6.0
    recovery: float = 10.0
    pick: str = "marker"  # "marker": the relay holding the awake marker; "alternate"
    repeat: int = 3
    look_every: float = 0.1
    drain_timeout: float = 120.0  # after the load: until every committed event arrived

    def cell_seconds(self) -> float:
        """The length of a cell's load, set-up and drain left out."""
        return (
            self.warmup
            + self.baseline
            + self.freezes * self.freeze
            + max(0, self.freezes - 1) * self.gap
            + self.recovery
        )


HELP = "two relays under steady load, one of them frozen (SIGSTOP) again and again"


def arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m bench stalled-relay``."""
    add_options(
        p,
        StalledRelayConfig,
        rate="writers' events/s (default 1200)",
        keys="key mixes: distinct keys (default 20 5000)",
        notify_modes=(
            "the outbox's notify_mode per cell (default gated always)",
            {"choices": list(NOTIFY_MODES)},
        ),
        relays="relay processes (default 2)",
        warmup="seconds of load before the baseline (default 2)",
        baseline="seconds before the 1st freeze",
        freezes="freezes per cell (default 6)",
        freeze="seconds per freeze (default 6)",
        gap="seconds between freezes (default 6)",
        recovery="seconds after the last freeze",
        pick=(
            "which relay to freeze: the one holding the awake marker (else in turn; default), "
            "or always in turn",
            {"choices": ["marker", "alternate"]},
        ),
        repeat="rounds (cells interleaved; medians)",
        drain_timeout="after the load, seconds to wait for every committed event",
    )
    phase_options(p)


def configure(args: argparse.Namespace) -> StalledRelayConfig:
    """The config of ``python -m bench stalled-relay ...`` (a BenchError for a bad value)."""
    common = common_options(args)
    if args.repeat < 1 or args.freezes < 1 or args.relays < 2 or min(args.keys) < 1:
        raise BenchError("--repeat, --freezes and --keys must be at least 1, --relays at least 2")
    if min(args.freeze, args.rate, args.baseline) <= 0:
        raise BenchError("--freeze, --baseline and --rate must be > 0")
    if min(args.warmup, args.gap, args.recovery) < 0:
        raise BenchError("--warmup, --gap and --recovery must be >= 0")
    return from_args(StalledRelayConfig, args, **common)


class _Fleet:
    """The relay processes of a cell, and which of them a database session belongs to: the
    session's ``client_port`` is the local port of one of the process's sockets."""

    def __init__(self, relays: list[Child]) -> None:
        self.relays = relays
        self._relay_of_port: dict[int, int | None] = {}

    def relay_of(self, port: int | None) -> int | None:
        """The index of the relay whose socket has local port ``port`` (None if none has)."""
        if port is None:
            return None
        if port not in self._relay_of_port:
            for k, relay in enumerate(self.relays):  # a new connection: look again
                for p in tcp_ports(relay.pid):
                    self._relay_of_port[p] = k
            self._relay_of_port.setdefault(port, None)
        return self._relay_of_port[port]


@dataclass
class _Session:
    relay: int | None  # None: not mapped to a relay process
    xact_age: float | None  # seconds; None: not in a transaction
    has_xid: bool
    awake: list[int]  # epochs of the awake marker it holds
    buckets: list[int]  # claim buckets it holds (in an open claim transaction)


@dataclass
class _Look:
    t: int  # monotonic ns
    cur: int | None  # the current epoch (None: no marker of migration 0006)
    sessions: list[_Session]

    def holder(self) -> int:
        """Who holds the current epoch's marker: a relay's index, ``_UNMAPPED``, ``_NOBODY``
        or ``_UNKNOWN`` (no epoch marker in this schema)."""
        if self.cur is None:
            return _UNKNOWN
        for s in self.sessions:
            if self.cur in s.awake:
                return s.relay if s.relay is not None else _UNMAPPED
        return _NOBODY

    def latest_holder(self) -> int | None:
        """The relay holding the latest epoch of the marker that any relay holds."""
        best: tuple[int, int] | None = None
        for s in self.sessions:
            if s.relay is not None and s.awake and (best is None or max(s.awake) > best[0]):
                best = (max(s.awake), s.relay)
        return best[1] if best else None

    def of(self, relay: int) -> list[_Session]:
        """The sessions of one relay."""
        return [s for s in self.sessions if s.relay == relay]


class _Watch(Looker):
    """Looks at the relays' sessions and locks every ``every`` seconds (and on demand), on
    its own connection to the cell's database; keeps the timeline of the marker's holder."""

    def __init__(self, dsn: str, fleet: _Fleet, every: float) -> None:
        super().__init__(dsn, every, "bench-marker-watch")
        self.fleet = fleet
        names = OutboxNames()
        self.namespaces = (names.awake_namespace & 0xFFFFFFFF, names.claim_namespace & 0xFFFFFFFF)
        self.timeline: list[tuple[int, int]] = []  # (monotonic ns, holder code)
        self.marker = False  # whether the schema has the epoch marker (migration 0006)
        self._sql = _LOOK.format(cur="NULL")

    async def prepare(self) -> None:
        rows = await self.fetch("SELECT to_regprocedure('outbox_awake_epoch(integer)') AS f")
        self.marker = bool(rows and rows[0]["f"] is not None)
        self._sql = _LOOK.format(cur=_CURRENT_EPOCH if self.marker else "NULL")

    async def look(self) -> _Look | None:
        """One look now (None if the query failed: recorded as an error)."""
        async with self.lock:  # the loop and the cell's own calls share one connection
            t0 = time.monotonic_ns()
            rows = await self.fetch(self._sql, *self.namespaces, within=_QUERY_TIMEOUT)
            t = (t0 + time.monotonic_ns()) // 2
        if rows is None:
            self.timeline.append((t, _UNKNOWN))
            return None
        look = _Look(
            t,
            rows[0]["cur"] if rows else None,
            [
                _Session(
                    self.fleet.relay_of(r["client_port"]),
                    r["xact_age"],
                    bool(r["has_xid"]),
                    list(r["awake"]),
                    list(r["buckets"]),
                )
                for r in rows
                if r["pid"] is not None
            ],
        )
        self.timeline.append((t, look.holder()))
        return look


def frozen_state(look: _Look | None, relay: int, buckets: list[int]) -> dict[str, Any]:
    """What the frozen relay held, from a look just after its stop: its sessions, those
    in a transaction, its claim buckets and the writers' keys in them."""
    if look is None:
        return {"looked": False}
    own = look.of(relay)
    held = sorted({b for s in own for b in s.buckets})
    ages = [s.xact_age for s in own if s.xact_age is not None]
    held_set = set(held)
    return {
        "looked": True,
        "sessions": len(own),
        "unmapped_sessions": sum(1 for s in look.sessions if s.relay is None),
        "in_transaction": len(ages),
        "oldest_xact_s": max(ages) if ages else None,
        "xid": any(s.has_xid for s in own),
        "claim_buckets": held,
        "held_keys": sorted(k for k, b in enumerate(buckets) if b in held_set),
        "awake_epochs": sum(len(s.awake) for s in own),
        "marker_holder_at_end": look.holder(),
    }


def _spans(freezes: list[dict[str, Any]], t0: int, t_end: int) -> list[tuple[str, int, int, int]]:
    """(phase, start ns, end ns, freeze index or -1) of every part of a cell. The baseline
    ends a guard (1 s, at most half of it) before the first SIGSTOP, in no phase: an event
    committed just before it may be in the claim the SIGSTOP freezes."""
    stop = freezes[0]["t_stop_ns"]
    guard = min(_GUARD_NS, (stop - t0) // 2)
    out = [("baseline", t0, stop - guard, -1), ("guard", stop - guard, stop, -1)]
    for k, f in enumerate(freezes):
        out.append(("freeze", f["t_stop_ns"], f["t_cont_ns"], k))
        last = k + 1 == len(freezes)
        nxt = t_end if last else freezes[k + 1]["t_stop_ns"]
        out.append(("recovery" if last else "between", f["t_cont_ns"], nxt, k))
    return out


def _marker_shares(
    timeline: list[tuple[int, int]], start: int, end: int, frozen: int | None
) -> dict[str, Any]:
    """Of the watch's looks in [start, end): the shares of the marker's holders
    (frozen relay, other relay, nobody, unmapped, unknown) and the last look at which the
    frozen relay held it (s after ``start``)."""
    looks = [(t, h) for t, h in timeline if start <= t < end]
    n = len(looks)
    if n == 0:
        return {"looks": 0}
    count = Counter(
        "frozen"
        if h == frozen
        else "other"
        if h >= 0
        else {_UNMAPPED: "unmapped", _NOBODY: "nobody"}.get(h, "unknown")
        for _, h in looks
    )
    kept = [t for t, h in looks if frozen is not None and h == frozen]
    return {
        "looks": n,
        **{k: count.get(k, 0) / n for k in ("frozen", "other", "nobody", "unmapped", "unknown")},
        "frozen_held_until_s": (max(kept) - start) / 1e9 if kept else None,
    }


@dataclass
class _FreezeTally:
    """One freeze's events: all, those of keys the frozen relay held, the others."""

    all: Histogram = field(default_factory=Histogram)
    held: Histogram = field(default_factory=Histogram)
    free: Histogram = field(default_factory=Histogram)
    committed: int = 0


def analyse_cell(
    cfg: StalledRelayConfig,
    keys: int,
    gen: dict[str, Any],
    got: dict[str, Any],
    freezes: list[dict[str, Any]],
    timeline: list[tuple[int, int]],
    t_base: int,
    t_end: int,
) -> dict[str, Any]:
    """Per phase and per freeze: ack -> receipt latency, commits and rate share; a freeze's
    events split by whether the frozen relay held their key's bucket; the marker's holders."""
    spans = _spans(freezes, t_base, t_end)
    starts = [s[1] for s in spans]
    hist = {p: Histogram() for p in PHASES}
    held_h, free_h = Histogram(), Histogram()
    committed = dict.fromkeys(PHASES, 0)
    missing = dict.fromkeys(PHASES, 0)
    seconds = dict.fromkeys(PHASES, 0.0)
    for phase, a, b, _ in spans:
        if phase in seconds:
            seconds[phase] += (b - a) / 1e9
    per = [_FreezeTally() for _ in freezes]
    held_keys = [set(f["frozen"].get("held_keys", [])) for f in freezes]
    recv_of = received_at(got)
    for i, a, r in acked_events(gen["ack"], recv_of):
        j = bisect.bisect_right(starts, a) - 1
        if j < 0 or a >= t_end:
            continue
        phase, _, _, k = spans[j]
        if phase not in committed:
            continue  # the guard
        committed[phase] += 1
        if phase == "freeze":
            per[k].committed += 1
        if r is None:
            missing[phase] += 1
            continue
        us = (r - a) // 1000
        hist[phase].record(us)
        if phase == "freeze":
            held = (i % keys) in held_keys[k]
            for h in (per[k].all, per[k].held if held else per[k].free):
                h.record(us)
            (held_h if held else free_h).record(us)
    phases = {
        p: {
            **latency_ms(hist[p]),
            "committed": committed[p],
            "missing": missing[p],
            "seconds": round(seconds[p], 3),
            "rate": committed[p] / seconds[p] if seconds[p] > 0 else None,
            "rate_share": committed[p] / (cfg.rate * seconds[p]) if seconds[p] > 0 else None,
        }
        for p in PHASES
    }
    for k, f in enumerate(freezes):
        secs = (f["t_cont_ns"] - f["t_stop_ns"]) / 1e9
        f.update(
            {
                "latency": latency_ms(per[k].all),
                "held_keys_latency": latency_ms(per[k].held),
                "free_keys_latency": latency_ms(per[k].free),
                "committed": per[k].committed,
                "rate_share": per[k].committed / (cfg.rate * secs) if secs > 0 else None,
                "marker": _marker_shares(timeline, f["t_stop_ns"], f["t_cont_ns"], f["relay"]),
            }
        )
    freeze_looks = [
        (t, h) for t, h in timeline if any(a <= t < b for p, a, b, _ in spans if p == "freeze")
    ]
    return {
        "phases": phases,
        "freeze_held_keys": latency_ms(held_h),
        "freeze_free_keys": latency_ms(free_h),
        "marker": {
            "baseline": _marker_shares(timeline, t_base, spans[0][2], None),
            # Pooled over the freezes: "frozen" is counted per freeze, so it is left out here.
            "freezes": {
                k: v
                for k, v in _marker_shares(freeze_looks, 0, 1 << 62, None).items()
                if k not in ("frozen", "frozen_held_until_s")
            },
        },
        "events": event_counts(gen["ack"], recv_of),
    }


class _StalledRelay(Cells[Mode]):
    name, short = "stalled-relay", "stalled"
    cfg: StalledRelayConfig

    def __init__(self, cfg: StalledRelayConfig, run: PhaseRun) -> None:
        # A mode per notify mode: the relay (or --alt-relay's) with that notify_mode.
        base = regime_mode("notify-alt" if cfg.alt_relay else "notify", cfg.alt_relay)
        modes = [
            dataclasses.replace(
                base,
                name=nm,
                description=f"{cfg.relays} x {base.description}; notify_mode '{nm}'",
                notify=nm,
            )
            for nm in cfg.notify_modes
        ]
        super().__init__(cfg, run, modes)

    def intro(self) -> str:
        cfg = self.cfg
        return (
            f"stalled-relay: {cfg.relays} relays, notify modes {' '.join(cfg.notify_modes)}, "
            f"keys {' '.join(str(k) for k in cfg.keys)}, {cfg.repeat} round(s): {cfg.rate:g} "
            f"ev/s, baseline {cfg.baseline:g}s, {cfg.freezes} freezes of {cfg.freeze:g}s "
            f"{cfg.gap:g}s apart, recovery {cfg.recovery:g}s (~{cfg.cell_seconds():.0f}s of "
            "load per cell)"
        )

    def grid(self) -> Iterator[tuple[dict[str, Any], str]]:
        for rnd in range(self.cfg.repeat):
            for keys in self.cfg.keys:
                for nm in self.cfg.notify_modes:
                    identity = {"round": rnd, "notify_mode": nm, "keys": keys}
                    yield identity, f"{nm}, {keys} keys, round {rnd + 1}"

    async def cell(
        self, services: Services, identity: dict[str, Any], label: str
    ) -> dict[str, Any]:
        run = self.run
        cell = cell_record(len(self.cells) + 1, **identity)
        topic = self.names(cell)[1]
        run.progress.status(f"{label}: database and topic")
        mode = self.modes[identity["notify_mode"]]
        await self.in_fresh_database(
            services,
            mode,
            cell,
            lambda dsn: self._measure(services, mode, dsn, topic, cell, label),
        )
        ph = cell["phases"]
        run.progress.line(
            f"{label:<26} baseline p50/p99 {ms(ph['baseline']['p50'])} / "
            f"{ms(ph['baseline']['p99'])}; during freezes {ms(ph['freeze']['p50'])} / "
            f"{ms(ph['freeze']['p99'])} (max {ms(ph['freeze']['max'])}; keys not held by "
            f"the frozen relay p99 {ms(cell['freeze_free_keys']['p99'])}); producers "
            f"{pct(ph['freeze']['rate_share'])} of the rate during freezes; "
            f"{cell['events']['missing']} missing",
            cell=True,
        )
        return cell

    async def _measure(
        self, services: Services, mode: Mode, dsn: str, topic: str, cell: dict[str, Any], label: str
    ) -> None:
        run, cfg = self.run, self.cfg
        gen_path, got_path = run.array_paths(f"stalled-{cell['cell']}")
        consumer = await run.start_consumer(services.bootstrap, topic, name=f"consumer-{label}")
        relays: list[Child] = []
        freezer: Child | None = None
        gen: Child | None = None
        watch: _Watch | None = None
        keys = int(cell["keys"])
        host0 = envinfo.cpu_times()
        try:
            names = [f"relay-{i + 1}-{label}" for i in range(cfg.relays)]
            await run.start_all(services, mode, dsn, names, relays, cfg.relay_env)
            cell["relay_pids"] = [r.pid for r in relays]
            pids = [str(r.pid) for r in relays]
            freezer = await run.start_helper(f"freezer-{label}", "_freezer", *pids)
            if not json.loads(await freezer.read_line(_FREEZER_TIMEOUT * 3)).get("ready"):
                raise BenchError(f"the freezer of {label} did not get ready")
            watch = _Watch(dsn, _Fleet(relays), cfg.look_every)
            await watch.start()
            cell["marker_in_schema"] = watch.marker
            buckets = list(await _fetchval(dsn, _KEY_BUCKETS, keys))
            gen, t0 = await run.start_steady_writers(
                dsn,
                topic,
                rate=cfg.rate,
                keys=keys,
                seconds=cfg.cell_seconds(),
                out=gen_path,
                name=f"writers-{label}",
            )
            freezes = await self._freezes(label, t0, relays, gen, freezer, watch, buckets)
            await self._until(
                label, "recovery", freezes[-1]["t_cont_ns"] + int(cfg.recovery * 1e9), relays, gen
            )
            t_end = time.monotonic_ns()
            cell["writers"] = await run.stop_writers(gen)
            cell["consumer"] = await run.collect_writers(
                consumer, cell["writers"], label=label, within=cfg.drain_timeout, out=got_path
            )
            await watch.stop()
            host1 = envinfo.cpu_times()
            cell.update(
                analyse_cell(
                    cfg,
                    keys,
                    load_arrays(gen_path),
                    load_arrays(got_path),
                    freezes,
                    watch.timeline,
                    t0 + int(cfg.warmup * 1e9),
                    t_end,
                )
            )
            for f in freezes:  # relative times for the record (ns stay for re-analysis)
                f["stop_s"] = round((f["t_stop_ns"] - t0) / 1e9, 3)
                f["seconds"] = round((f["t_cont_ns"] - f["t_stop_ns"]) / 1e9, 3)
            cell.update(
                {
                    "freezes": freezes,
                    "seconds": round((t_end - t0) / 1e9, 3),
                    "watch_looks": len(watch.timeline),
                    "watch_errors": watch.errors,
                    "host_cpu_busy": envinfo.busy_share(host0, host1),
                    "load_average_end": loadavg(),
                }
            )
        finally:
            if freezer is not None:
                with contextlib.suppress(Exception):
                    await freezer.send_line("cont")
                await freezer.stop(5)  # it continues every relay as it exits
            for r in relays:  # and in case the freezer could not
                with contextlib.suppress(ProcessLookupError):
                    r.proc.send_signal(signal.SIGCONT)
            if gen is not None:
                await gen.stop(10)
            if watch is not None:
                await watch.stop()
            cell["exit_codes"] = [await run.stop(r) for r in relays]
            await run.quit_consumer(consumer)
            for p in (gen_path, got_path):
                p.unlink(missing_ok=True)

    async def _freezes(
        self,
        label: str,
        t0: int,
        relays: list[Child],
        gen: Child,
        freezer: Child,
        watch: _Watch,
        buckets: list[int],
    ) -> list[dict[str, Any]]:
        """The baseline, then every freeze and the gap after it (the last gap is the
        recovery, paced by the caller)."""
        cfg = self.cfg
        freezes: list[dict[str, Any]] = []
        due = t0 + int((cfg.warmup + cfg.baseline) * 1e9)
        last = -1
        for k in range(cfg.freezes):
            phase = "warm-up and baseline" if k == 0 else f"between freezes {k} and {k + 1}"
            await self._until(label, phase, due, relays, gen)
            relay, picked_by = await self._pick(watch, last, len(relays))
            stopped = await _command(freezer, f"stop {relay}")
            t_stop = int(stopped["t"])
            freeze = f"freeze {k + 1}/{cfg.freezes}"
            # What it holds, once statements in flight at the stop have finished: its client
            # cannot change it while stopped, but the other relay's pulse ends a claim left
            # idle for frozen_relay_timeout (0.15 s), PostgreSQL for claim_idle_timeout (2 s),
            # so a look just before the SIGCONT would miss the claim whose keys waited.
            await self._until(label, freeze, t_stop + _HELD_LOOK_NS, relays, gen)
            state = frozen_state(await watch.look(), relay, buckets)
            await self._until(label, freeze, t_stop + int(cfg.freeze * 1e9), relays, gen)
            t_cont = int((await _command(freezer, "cont"))["t"])
            freezes.append(
                {
                    "n": k + 1,
                    "relay": relay,
                    "picked_by": picked_by,
                    "confirmed_stopped": bool(stopped.get("confirmed")),
                    "t_stop_ns": t_stop,
                    "t_cont_ns": t_cont,
                    "frozen": state,
                }
            )
            last = relay
            due = t_cont + int(cfg.gap * 1e9)
        return freezes

    async def _pick(self, watch: _Watch, last: int, count: int) -> tuple[int, str]:
        """The relay to freeze: the one holding the current epoch's marker, else the one
        holding the latest epoch of it, else the next in turn."""
        if self.cfg.pick == "marker":
            look = await watch.look()
            if look is not None:
                holder = look.holder()
                if holder >= 0:
                    return holder, "marker (current epoch)"
                latest = look.latest_holder()
                if latest is not None:
                    return latest, "marker (latest epoch)"
        return (last + 1) % count, "alternate"

    async def _until(
        self, label: str, phase: str, t_ns: int, relays: list[Child], gen: Child
    ) -> None:
        """Wait until ``t_ns`` (this paces the schedule), failing early if the writers or a
        relay exited."""
        await self.run.pace(
            t_ns,
            lambda left: f"{label}: {phase}, {left:.0f}s left",
            alive=[(gen, "the writers"), *((r, r.name) for r in relays)],
            step=0.5,
        )


# When, after the SIGSTOP, the frozen relay's locks are looked at (see _freezes): after the
# statements in flight, before the other relay's pulse ends the claim (0.15 s).
_HELD_LOOK_NS = 80_000_000


async def _command(freezer: Child, line: str) -> dict[str, Any]:
    """One command of the freezer's line protocol, and its answer."""
    await freezer.send_line(line)
    answer: dict[str, Any] = json.loads(await freezer.read_line(_FREEZER_TIMEOUT))
    if "error" in answer:
        raise BenchError(f"freezer: {answer['error']}")
    return answer


async def _fetchval(dsn: str, sql: str, *args: object) -> Any:
    async with connection(dsn) as conn:
        return await conn.fetchval(sql, *args, timeout=_QUERY_TIMEOUT)


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Medians over rounds per notify mode and key mix, and the target: p99 of the events
    committed during the freezes <= 100 ms."""
    cfg = result["config"]
    rows: list[dict[str, Any]] = []
    targets: list[dict[str, Any]] = []
    for keys in cfg["keys"]:
        for nm in cfg["notify_modes"]:
            cells = [
                c
                for c in result.get("cells", [])
                if c["keys"] == keys and c["notify_mode"] == nm and "phases" in c
            ]
            if not cells:
                continue
            freezes = [f for c in cells for f in c["freezes"]]
            row: dict[str, Any] = {"notify_mode": nm, "keys": keys, "rounds": len(cells)}
            for p in PHASES:
                for k in ("p50", "p99", "max", "rate_share"):
                    row[f"{p}_{k}"] = median(c["phases"][p][k] for c in cells)
            for part in ("held", "free"):
                for k in ("p50", "p99", "max"):
                    row[f"freeze_{part}_{k}"] = median(c[f"freeze_{part}_keys"][k] for c in cells)
            row["freeze_held_share"] = median(
                c["freeze_held_keys"]["count"] / c["phases"]["freeze"]["committed"]
                for c in cells
                if c["phases"]["freeze"]["committed"]
            )
            row["rate_share"] = median(
                c["writers"]["acked"] / (cfg["rate"] * c["seconds"]) for c in cells if c["seconds"]
            )
            row["lost"] = sum(c["events"]["missing"] for c in cells)
            row["freezes"] = len(freezes)
            row["picked_by"] = dict(Counter(f["picked_by"] for f in freezes))
            row["claim_open"] = sum(1 for f in freezes if f["frozen"].get("in_transaction"))
            row["held_keys_median"] = median(len(f["frozen"].get("held_keys", [])) for f in freezes)
            kept = [
                f["marker"]["frozen_held_until_s"]
                for f in freezes
                if f["marker"].get("frozen_held_until_s") is not None
            ]
            row["marker_kept_max_s"] = max(kept) if kept else None
            row["marker_kept_freezes"] = len(kept)
            for k in ("frozen", "other", "nobody"):
                row[f"marker_{k}"] = median(f["marker"].get(k) for f in freezes)
            row["baseline_awake"] = median(
                m["other"] + m["unmapped"]
                for c in cells
                if (m := c["marker"]["baseline"]).get("looks") and m["unknown"] < 1.0
            )
            rows.append(row)
            p99 = row["freeze_p99"]
            if p99 is not None:
                targets.append(
                    target(
                        f"{nm}, {keys:,} keys: p99 of the events committed during the "
                        "freezes <= 100 ms",
                        f"{p99:.1f} ms (baseline {ms(row['baseline_p99'])}; "
                        f"keys the frozen relay did not hold {ms(row['freeze_free_p99'])})",
                        p99 <= 100.0,
                    )
                )
    return {"rows": rows, "targets": targets}


def problems(result: dict[str, Any]) -> list[str]:
    """What makes a stalled-relay result wrong (not slow): a cell that failed, committed
    events that never arrived, a freeze the kernel did not confirm."""
    problems = []
    for c in result.get("cells", []):
        where = f"cell {c['cell']} ({c['notify_mode']}, {c['keys']} keys, round {c['round'] + 1})"
        if bad := unfinished(c, where, "events"):
            problems += bad
            continue
        if c["events"]["missing"]:
            problems.append(f"{where}: {c['events']['missing']} committed events never arrived")
        for f in c["freezes"]:
            if not f["confirmed_stopped"]:
                problems.append(f"{where}: freeze {f['n']}: the relay was not seen stopped")
    return problems


def markdown(result: dict[str, Any], summary: dict[str, Any], plots: list[str]) -> str:
    cfg = result["config"]
    lines = [f"# notify-outbox stalled relay {result['run_id']}", ""]
    lines += environment_lines(result)
    env_bits = ", ".join(f"{k}={v}" for k, v in cfg.get("relay_env", {}).items())
    lines += [
        f"- {cfg['relays']} relay processes (default settings"
        + (f", {env_bits}" if env_bits else "")
        + f") on one database and topic; writers at {cfg['rate']:g} ev/s, open loop, "
        f"single-row transactions; {cfg.get('warmup', 0):g} s warm-up (in no phase), "
        f"{cfg['baseline']:g} s baseline, then {cfg['freezes']} "
        f"times one relay frozen with SIGSTOP for {cfg['freeze']:g} s and continued, "
        f"{cfg['gap']:g} s apart, then {cfg['recovery']:g} s of recovery; the relay frozen: "
        + (
            "the one holding the awake marker's current epoch (else its latest), else in turn"
            if cfg["pick"] == "marker"
            else "in turn"
        )
        + f"; {cfg['repeat']} round(s), fresh database and topic per cell, medians over rounds",
        "",
        "Events go into phases by their commit ack: **baseline** (from the end of the warm-up "
        "to 1 s before the first freeze: an event committed just before a SIGSTOP may be in the "
        "claim it freezes), **freezes** (from the SIGSTOP to the SIGCONT), **between** freezes, "
        "**recovery** (after the last). Latency is commit ack -> consumer receipt (ms). "
        "**Keys held** are the keys whose claim bucket the frozen relay held in an open claim "
        "transaction (`pg_locks`, looked at 0.08 s after the SIGSTOP): per-key order makes them "
        "wait for it, until the other relay's pulse ends the claim (frozen_relay_timeout, 0.15 s) "
        "or PostgreSQL does (claim_idle_timeout, 2 s); "
        "**keys free** are the others. **Rate %** is the producers' commits as a share of the "
        "offered rate.",
    ]
    lines += targets_section(summary, "the stalled-relay issue: p99 <= 100 ms during the freezes")
    lines += ["", "## Latency per phase (medians over rounds)", ""]
    lines += table(
        (
            "notify mode | keys | rounds | baseline p50 / p99 / max | freezes p50 / p99 / max | "
            "freezes, keys free p99 / max | freezes, keys held p99 (share of events %) | "
            "between p99 | recovery p99 | rate % baseline / freezes / all | lost"
        ),
        [
            [
                r["notify_mode"],
                f"{r['keys']:,}",
                str(r["rounds"]),
                " / ".join(num(r[f"baseline_{k}"], 1) for k in ("p50", "p99", "max")),
                " / ".join(num(r[f"freeze_{k}"], 1) for k in ("p50", "p99", "max")),
                f"{num(r['freeze_free_p99'], 1)} / {num(r['freeze_free_max'], 1)}",
                f"{num(r['freeze_held_p99'], 1)} ({num(percent(r['freeze_held_share']), 1)})",
                num(r["between_p99"], 1),
                num(r["recovery_p99"], 1),
                " / ".join(
                    share(r[k]) for k in ("baseline_rate_share", "freeze_rate_share", "rate_share")
                ),
                str(r["lost"]),
            ]
            for r in summary["rows"]
        ],
    )
    lines += [
        "",
        "## The frozen relay and the awake marker",
        "",
        "Who held the current epoch's awake marker (migration 0006), from a look at `pg_locks` "
        "every 0.1 s, as a share of the looks during the freezes (medians over freezes): the "
        "frozen relay, the other relay, nobody (producers notify). **Kept** is the latest look "
        "at which the frozen relay still held it, after the SIGSTOP (max over freezes, and in "
        "how many freezes it held it at all). **Claim open** counts the freezes in which the "
        "frozen relay was stopped inside a transaction; **held keys** is the median number of "
        "the writers' keys in the claim buckets it held.",
        "",
    ]
    lines += table(
        (
            "notify mode | keys | picked by | marker: frozen / other / nobody % | "
            "kept (s), freezes | baseline: marker held % | claim open | held keys"
        ),
        [
            [
                r["notify_mode"],
                f"{r['keys']:,}",
                ", ".join(f"{k} x{v}" for k, v in r["picked_by"].items()),
                " / ".join(share(r[f"marker_{k}"]) for k in ("frozen", "other", "nobody")),
                f"{num(r['marker_kept_max_s'])}, {r['marker_kept_freezes']} of {r['freezes']}",
                share(r["baseline_awake"]),
                f"{r['claim_open']} of {r['freezes']}",
                num(r["held_keys_median"], 0),
            ]
            for r in summary["rows"]
        ],
    )
    freezes = [(c, f) for c in result.get("cells", []) if "phases" in c for f in c["freezes"]]
    if freezes:
        lines += ["", "## Every freeze", ""]
        lines += table(
            (
                "mode | keys | round | # | relay | picked by | p50 / p99 / max | keys free p99 | "
                "keys held (events) | rate % | in transaction (oldest, s) | buckets held | "
                "marker kept (s)"
            ),
            [
                [
                    c["notify_mode"],
                    f"{c['keys']:,}",
                    str(c["round"] + 1),
                    str(f["n"]),
                    str(f["relay"] + 1),
                    f["picked_by"],
                    " / ".join(num(f["latency"][k], 1) for k in ("p50", "p99", "max")),
                    num(f["free_keys_latency"]["p99"], 1),
                    f"{len(f['frozen'].get('held_keys', []))} ({f['held_keys_latency']['count']})",
                    share(f["rate_share"]),
                    f"{f['frozen'].get('in_transaction', '-')} "
                    f"({num(f['frozen'].get('oldest_xact_s'))})",
                    str(len(f["frozen"].get("claim_buckets", []))),
                    num(f["marker"].get("frozen_held_until_s"), 3),
                ]
                for c, f in freezes
            ],
        )
    lines += modes_section(result)
    return finish(lines, result, plots, problems(result))


def plot(result: dict[str, Any], summary: dict[str, Any], path: Path) -> bool:
    """Per cell, ack -> receive p99 of the baseline, the freezes and the freezes' free keys."""
    from bench.plots import bar_figure, save_bar_chart  # matplotlib only when plotting

    rows, cfg = summary["rows"], result["config"]
    if not rows:
        return False
    bars = (
        ("baseline_p99", "baseline"),
        ("freeze_p99", "during the freezes"),
        ("freeze_free_p99", "during the freezes, keys the frozen relay did not hold"),
    )
    fig, ax = bar_figure(max(7.0, 1.8 * len(rows)))
    width = 0.8 / len(bars)
    for i, (key, label) in enumerate(bars):
        xs = [j + i * width for j in range(len(rows))]
        ax.bar(xs, [max(r[key] or 0.0, 0.1) for r in rows], width, label=label)
    ax.set_xticks([j + width * (len(bars) - 1) / 2 for j in range(len(rows))])
    ax.set_xticklabels([f"{r['notify_mode']}\n{r['keys']:,} keys" for r in rows])
    ax.set_yscale("log")
    ax.axhline(100, color="grey", linewidth=0.8)
    ax.set_ylabel("commit ack -> receive p99 (ms), median of rounds")
    ax.set_title(
        f"Stalled relay: {cfg['relays']} relays, {cfg['rate']:g} ev/s, {cfg['freezes']} "
        f"freezes of {cfg['freeze']:g} s"
    )
    return save_bar_chart(fig, ax, path)


REGIME = Regime.of(__name__, _StalledRelay.main, "## Targets", "## Latency per phase")
