"""The exactly-once frozen-relay regime (``python -m bench eos-freeze``, issue #35): two
exactly-once relays under steady writers, one of them frozen (SIGSTOP) with a Kafka transaction
open, and what that costs read_committed consumers: per partition the lag of the last stable
offset (LSO) behind the high watermark, and how long it stays put, for each transaction timeout
and lease. Method: ``bench/README.md``, "Exactly-once: a relay frozen mid-transaction"."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from bench.analysis import median
from bench.arrays import load_arrays
from bench.config import (
    MODES,
    Mode,
    PhaseConfig,
    add_options,
    common_options,
    from_args,
    phase_options,
)
from bench.fmt import environment_lines, finish, modes_section, num, table, targets_section
from bench.freezer import _state as process_state
from bench.hist import Histogram
from bench.phase import PhaseRun, loadavg
from bench.procs import BenchError, Child
from bench.regimes import (
    Cells,
    Regime,
    acked_events,
    cell_record,
    event_counts,
    latency_ms,
    received_at,
    target,
    unfinished,
)
from bench.services import Services

WINDOWS = ("before", "frozen", "after")
# Where the frozen relay stops itself: its batch's records acked, the commit not yet asked
# (the transaction is open and holds the LSO of every partition it wrote to).
STOP_POINT = "eos_before_commit"
# Kafka's transaction.abort.timed.out.transaction.cleanup.interval.ms (broker default, and
# devstack's): the coordinator looks for expired transactions only this often, so a
# transaction is aborted between its timeout and its timeout plus this.
BROKER_ABORT_CHECK_S = 10.0
_POLL_INTERVAL_S = 5.0  # the relay's default poll_interval: its tick is min(this, lease / 3)
_SLACK_S = 1.0  # the fence's and the abort markers' own time, and the looks' resolution
_FREEZER_TIMEOUT = 10.0
_FIRST_LOOK_NS = 250_000_000  # the first look after the stop comes within this
_STALLED_NS = 500_000_000
_GUARD_NS = 1_000_000_000
MARKER_TOPIC = "notify_outbox.eos_markers"  # the relay's default marker topic


@dataclass
class EosFreezeConfig(PhaseConfig):
    """Everything one eos-freeze run does; recorded in the result JSON."""

    rate: float = 100.0
    keys: int = 1000
    # "TIMEOUT/LEASE" in seconds: NOTIFY_OUTBOX_EOS_TRANSACTION_TIMEOUT and _EOS_LEASE.
    settings: list[str] = field(default_factory=lambda: ["10/10", "3/10", "3/3"])
    warmup: float = 3.0
    baseline: float = 10.0
    freeze: float = 30.0
    after: float = 15.0
    arm_timeout: float = 30.0  # how long the armed relay may take to reach a commit
    repeat: int = 1
    look_every: float = 0.05
    drain_timeout: float = 120.0

    def cell_seconds(self) -> float:
        """The length of a cell's load (the wait for the stop left out)."""
        return self.warmup + self.baseline + self.freeze + self.after


HELP = "two exactly-once relays, one frozen mid-transaction: the LSO lag of read_committed"


def arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m bench eos-freeze``."""
    add_options(
        p,
        EosFreezeConfig,
        rate="writers' events/s (default 100)",
        keys="distinct keys (default 1000)",
        settings="TIMEOUT/LEASE pairs in seconds, a cell each (default 10/10 3/10 3/3)",
        warmup="seconds of load before the baseline",
        baseline="seconds of baseline before the freeze is armed",
        freeze="seconds the relay stays frozen",
        after="seconds of load after it is continued",
        arm_timeout="seconds the armed relay may take to reach a commit",
        repeat="rounds (cells interleaved)",
        drain_timeout="after the load, seconds to wait for every committed event",
    )
    phase_options(p)


def parse_setting(text: str) -> tuple[float, float]:
    """``"TIMEOUT/LEASE"`` -> (transaction timeout, lease) in seconds."""
    try:
        timeout, lease = (float(x) for x in text.split("/"))
    except ValueError:
        raise BenchError(f"--settings: {text!r} is not TIMEOUT/LEASE (seconds)") from None
    if timeout < 1 or lease <= 0:
        raise BenchError(f"--settings: {text!r}: the timeout must be >= 1 s, the lease > 0")
    return timeout, lease


def configure(args: argparse.Namespace) -> EosFreezeConfig:
    """The config of ``python -m bench eos-freeze ...`` (a BenchError for a bad value)."""
    for s in args.settings:
        parse_setting(s)
    if args.repeat < 1 or args.keys < 1 or min(args.rate, args.freeze, args.baseline) <= 0:
        raise BenchError("--repeat and --keys must be >= 1; --rate, --freeze, --baseline > 0")
    return from_args(EosFreezeConfig, args, **common_options(args))


def expected_bound(timeout: float, lease: float) -> dict[str, float]:
    """When, after the freeze, the frozen transaction must have ended (seconds): the broker
    aborts it at its timeout (looking every ``BROKER_ABORT_CHECK_S``); the other relay's tick
    (every min(poll interval, lease / 3)) finds the slot's lease expired and fences it. The
    lease was renewed by the step just before the batch, so it expires ``lease`` after the
    freeze."""
    by_broker = timeout + BROKER_ABORT_CHECK_S
    by_takeover = lease + min(_POLL_INTERVAL_S, lease / 3)
    return {
        "by_broker_s": by_broker,
        "by_takeover_s": by_takeover,
        "bound_s": min(by_broker, by_takeover) + _SLACK_S,
    }


@dataclass(frozen=True)
class Stall:
    """A time the LSO of a partition stayed at one offset below the high watermark."""

    start_ns: int  # the first look that saw it below the high watermark at this offset
    end_ns: int  # the first look that saw it moved on (or the last look, if it never did)
    lso: int
    max_lag: int  # the most offsets between it and the high watermark meanwhile
    ended: bool

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def stalls(samples: Sequence[tuple[int, int, int]]) -> list[Stall]:
    """The stalls of one partition's looks ``(t ns, high watermark, LSO)``, in time order.
    A transaction open for a few milliseconds makes a stall of one look or none; a frozen
    one keeps the LSO at its first offset while the high watermark grows past it."""
    out: list[Stall] = []
    cur: tuple[int, int, int] | None = None  # (start, lso, max lag)
    for t, hw, lso in samples:
        if cur is not None:
            start, at, lag = cur
            if lso == at and hw > lso:
                cur = (start, at, max(lag, hw - lso))
                continue
            out.append(Stall(start, t, at, lag, True))
            cur = None
        if hw > lso:
            cur = (t, lso, hw - lso)
    if cur is not None:
        out.append(Stall(cur[0], samples[-1][0], cur[1], cur[2], False))
    return out


def freeze_stall(found: list[Stall], t_stop: int, within_ns: int) -> Stall | None:
    """The stall the frozen transaction made, if it wrote to this partition: one that began
    by the stop (or the first look after it, ``within_ns``: its records were acked just
    before the stop) and lasted past it. A partition it did not write to has only the short
    stalls of the other relay's transactions."""
    during = [s for s in found if s.start_ns <= t_stop + within_ns and s.end_ns > t_stop]
    return max(during, key=lambda s: s.end_ns - s.start_ns, default=None)


class _LsoWatch:
    """Looks at the end offsets of the event topic's and the marker topic's partitions every
    ``every`` seconds: read_committed (the LSO), then read_uncommitted (the high watermark),
    from the bench process, so that a look never waits for the relays."""

    def __init__(self, bootstrap: str, every: float) -> None:
        self.bootstrap = bootstrap
        self.every = every
        self.series: dict[str, list[tuple[int, int, int]]] = {}
        self.errors: list[str] = []
        self._consumers: list[AIOKafkaConsumer] = []
        self._task: asyncio.Task[None] | None = None

    async def start(self, topics: list[str]) -> None:
        for level in ("read_committed", "read_uncommitted"):
            c = AIOKafkaConsumer(
                bootstrap_servers=self.bootstrap,
                isolation_level=level,
                enable_auto_commit=False,
                client_id=f"bench-lso-{level}",
            )
            self._consumers.append(c)
            async with asyncio.timeout(30):
                await c.start()
        tps: list[TopicPartition] = []
        for topic in topics:
            async with asyncio.timeout(30):
                while not (parts := self._consumers[0].partitions_for_topic(topic)):
                    await self._consumers[0]._client.force_metadata_update()
                    await asyncio.sleep(0.2)
            tps += [TopicPartition(topic, p) for p in sorted(parts)]
        self.series = {f"{tp.topic}[{tp.partition}]": [] for tp in tps}
        self._task = asyncio.create_task(self._loop(tps))

    async def _loop(self, tps: list[TopicPartition]) -> None:
        committed, uncommitted = self._consumers
        due = time.monotonic()
        while True:
            due += self.every
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            try:
                # The LSO first: a record acked between the two asks can only raise the high
                # watermark, never make it look lower than the LSO.
                lso = await committed.end_offsets(tps)
                hw = await uncommitted.end_offsets(tps)
            except Exception as e:  # a look that fails is recorded and skipped
                if len(self.errors) < 5:
                    self.errors.append(f"{type(e).__name__}: {e}")
                continue
            t = time.monotonic_ns()
            for tp in tps:
                self.series[f"{tp.topic}[{tp.partition}]"].append((t, hw[tp], lso[tp]))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for c in self._consumers:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(10):
                    await c.stop()
        self._consumers = []


def changes(samples: list[tuple[int, int, int]], t0: int) -> list[list[int]]:
    """A series as stored: ``[ms after t0, high watermark, LSO]`` at each look whose offsets
    differ from the look before (the stalls come out the same from it), and the last look."""
    out: list[list[int]] = []
    last: tuple[int, int] | None = None
    for k, (t, hw, lso) in enumerate(samples):
        if (hw, lso) != last or k == len(samples) - 1:
            out.append([(t - t0) // 1_000_000, hw, lso])
            last = (hw, lso)
    return out


def analyse_lso(
    series: dict[str, list[tuple[int, int, int]]], t_base: int, t_arm: int, t_stop: int
) -> dict[str, Any]:
    """Per partition: the frozen transaction's stall (from the stop: how long the LSO stayed,
    the most records behind), and the longest stall of the baseline for comparison."""
    parts: dict[str, Any] = {}
    for name, samples in series.items():
        found = stalls(samples)
        s = freeze_stall(found, t_stop, _FIRST_LOOK_NS)
        base = [x.seconds for x in found if t_base <= x.start_ns < t_arm]
        parts[name] = {
            "looks": len(samples),
            # Longer than any healthy transaction's stall (the baseline's: 0.1 s or less).
            "stalled": s is not None and s.end_ns - t_stop > _STALLED_NS,
            "held_s": round((s.end_ns - t_stop) / 1e9, 3) if s else None,
            "stall_s": round(s.seconds, 3) if s else None,
            "max_lag": s.max_lag if s else None,
            "ended": s.ended if s else None,
            "baseline_longest_s": round(max(base), 3) if base else 0.0,
            "baseline_stalls": len(base),
        }
    held = [p["held_s"] for p in parts.values() if p["stalled"]]
    return {"partitions": parts, "held_max_s": max(held) if held else None}


def analyse_latency(
    gen: dict[str, Any], got: dict[str, Any], bounds: dict[str, tuple[int, int]]
) -> dict[str, Any]:
    """Commit ack -> read_committed receipt per window (by commit ack)."""
    hist = {w: Histogram() for w in bounds}
    missing = dict.fromkeys(bounds, 0)
    recv_of = received_at(got)
    for _, a, r in acked_events(gen["ack"], recv_of):
        for w, (lo, hi) in bounds.items():
            if lo <= a < hi:
                if r is None:
                    missing[w] += 1
                else:
                    hist[w].record((r - a) // 1000)
    return {
        "windows": {w: {**latency_ms(hist[w]), "missing": missing[w]} for w in bounds},
        "events": event_counts(gen["ack"], recv_of),
    }


def _count_lines(path: Path, *needles: str) -> dict[str, int]:
    """How many lines of a relay's log hold each needle (its recoveries, slots lost...)."""
    counts = dict.fromkeys(needles, 0)
    with contextlib.suppress(OSError):
        for line in path.read_text(errors="replace").splitlines():
            for n in needles:
                counts[n] += n in line
    return counts


_LOG_NEEDLES = ("was in flight", "is no longer this relay's", "settling it from the markers")


class _EosFreeze(Cells[Mode]):
    name, short = "eos-freeze", "eosfz"
    cfg: EosFreezeConfig

    def __init__(self, cfg: EosFreezeConfig, run: PhaseRun) -> None:
        base = MODES["notify-eos"]
        if cfg.alt_relay:
            base = base.from_tree(cfg.alt_relay)
        super().__init__(cfg, run, [base])
        self.mode = base

    def intro(self) -> str:
        cfg = self.cfg
        return (
            f"eos-freeze: 2 exactly-once relays, settings (timeout/lease) "
            f"{' '.join(cfg.settings)}, {cfg.repeat} round(s): {cfg.rate:g} ev/s over "
            f"{cfg.keys} keys, baseline {cfg.baseline:g}s, one relay frozen mid-transaction "
            f"for {cfg.freeze:g}s, {cfg.after:g}s after (~{cfg.cell_seconds():.0f}s per cell)"
        )

    def grid(self) -> Iterator[tuple[dict[str, Any], str]]:
        for rnd in range(self.cfg.repeat):
            for s in self.cfg.settings:
                timeout, lease = parse_setting(s)
                identity = {"round": rnd, "timeout_s": timeout, "lease_s": lease}
                yield identity, f"timeout {timeout:g}s lease {lease:g}s round {rnd + 1}"

    async def cell(
        self, services: Services, identity: dict[str, Any], label: str
    ) -> dict[str, Any]:
        cell = cell_record(len(self.cells) + 1, **identity)
        topic = self.names(cell)[1]
        self.run.progress.status(f"{label}: database and topic")
        await self.in_fresh_database(
            services,
            self.mode,
            cell,
            lambda dsn: self._measure(services, dsn, topic, cell, label),
        )
        lso, lat = cell["lso"], cell["latency"]["windows"]
        self.run.progress.line(
            f"{label:<28} LSO held {num(lso['held_max_s'])} s after the freeze (bound "
            f"{num(cell['expected']['bound_s'])}); p99 before / frozen / after "
            f"{num(lat['before']['p99'], 1)} / {num(lat['frozen']['p99'], 1)} / "
            f"{num(lat['after']['p99'], 1)} ms; {cell['latency']['events']['missing']} missing",
            cell=True,
        )
        return cell

    async def _measure(
        self, services: Services, dsn: str, topic: str, cell: dict[str, Any], label: str
    ) -> None:
        run, cfg = self.run, self.cfg
        timeout, lease = float(cell["timeout_s"]), float(cell["lease_s"])
        cell["expected"] = expected_bound(timeout, lease)
        gen_path, got_path = run.array_paths(f"eosfz-{cell['cell']}")
        arm = gen_path.with_suffix(".arm")
        arm.unlink(missing_ok=True)
        env = {
            **cfg.relay_env,
            "NOTIFY_OUTBOX_EOS_TRANSACTION_TIMEOUT": f"{timeout:g}",
            "NOTIFY_OUTBOX_EOS_LEASE": f"{lease:g}",
        }
        # Relay 1 stops itself (SIGSTOP) at its first commit once the arm file exists.
        frozen_env = {
            **env,
            "NOTIFY_OUTBOX_TEST_STOP_AT": STOP_POINT,
            "NOTIFY_OUTBOX_TEST_STOP_ARMED": str(arm),
        }
        consumer = await run.start_consumer(services.bootstrap, topic, name=f"consumer-{label}")
        relays: list[Child] = []
        freezer: Child | None = None
        gen: Child | None = None
        watch = _LsoWatch(services.bootstrap, cfg.look_every)
        try:
            for k, e in enumerate((frozen_env, env)):
                relays.append(
                    await run.start(
                        services, self.mode, dsn, name=f"relay-{k + 1}-{label}", extra_env=e
                    )
                )
            # Only a safety net: it continues every relay when it exits, even if the bench dies.
            freezer = await run.start_helper(
                f"freezer-{label}", "_freezer", *(str(r.pid) for r in relays)
            )
            if not json.loads(await freezer.read_line(_FREEZER_TIMEOUT * 3)).get("ready"):
                raise BenchError(f"the freezer of {label} did not get ready")
            await watch.start([topic, MARKER_TOPIC])
            gen, t0 = await run.start_steady_writers(
                dsn,
                topic,
                rate=cfg.rate,
                keys=cfg.keys,
                seconds=cfg.cell_seconds() + cfg.arm_timeout,
                out=gen_path,
                name=f"writers-{label}",
            )
            t_base = t0 + int(cfg.warmup * 1e9)
            t_arm = t_base + int(cfg.baseline * 1e9)
            await self._until(label, "baseline", t_arm, relays, gen)
            arm.touch()
            t_stop = await self._wait_stopped(relays[0], cfg.arm_timeout)
            await self._until(label, "frozen", t_stop + int(cfg.freeze * 1e9), relays[1:], gen)
            relays[0].proc.send_signal(signal.SIGCONT)
            t_cont = time.monotonic_ns()
            await self._until(label, "after", t_cont + int(cfg.after * 1e9), relays, gen)
            t_end = time.monotonic_ns()
            cell["writers"] = await run.stop_writers(gen)
            cell["consumer"] = await run.collect_writers(
                consumer, cell["writers"], label=label, within=cfg.drain_timeout, out=got_path
            )
            await watch.stop()
            cell["lso"] = analyse_lso(watch.series, t_base, t_arm, t_stop)
            cell["lso"]["series"] = {k: changes(v, t_stop) for k, v in watch.series.items()}
            cell["lso"]["errors"] = watch.errors
            cell["latency"] = analyse_latency(
                load_arrays(gen_path),
                load_arrays(got_path),
                {
                    # The baseline ends a guard before the arming: a row committed just before
                    # it may be in the batch the relay freezes with (and wait for its end).
                    "before": (t_base, t_arm - min(_GUARD_NS, (t_arm - t_base) // 2)),
                    "frozen": (t_stop, t_cont),
                    "after": (t_cont, t_end),
                },
            )
            cell.update(
                {
                    "armed_s": round((t_arm - t0) / 1e9, 3),
                    "stopped_after_arm_s": round((t_stop - t_arm) / 1e9, 3),
                    "frozen_s": round((t_cont - t_stop) / 1e9, 3),
                    "seconds": round((t_end - t0) / 1e9, 3),
                    "load_average_end": loadavg(),
                }
            )
        finally:
            if freezer is not None:
                await freezer.stop(5)  # it continues every relay as it exits
            for r in relays:  # and in case it could not
                with contextlib.suppress(ProcessLookupError):
                    r.proc.send_signal(signal.SIGCONT)
            if gen is not None:
                await gen.stop(10)
            await watch.stop()
            cell["exit_codes"] = [await run.stop(r) for r in relays]
            cell["relay_logs"] = [_count_lines(r.log_path, *_LOG_NEEDLES) for r in relays]
            await run.quit_consumer(consumer)
            for p in (gen_path, got_path, arm):
                p.unlink(missing_ok=True)

    async def _wait_stopped(self, relay: Child, within: float) -> int:
        """Wait until the armed relay has stopped itself at its commit; when (monotonic ns)."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if process_state(relay.pid) in ("T", "t"):
                return time.monotonic_ns()
            if not relay.running():
                raise BenchError(f"{relay.name} exited:\n{relay.tail()}")
            await asyncio.sleep(0.002)
        raise BenchError(f"{relay.name} reached no commit within {within:g} s of the arming")

    async def _until(
        self, label: str, phase: str, t_ns: int, relays: list[Child], gen: Child
    ) -> None:
        await self.run.pace(
            t_ns,
            lambda left: f"{label}: {phase}, {left:.0f}s left",
            alive=[(gen, "the writers"), *((r, r.name) for r in relays)],
            step=0.5,
        )


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Per setting: the LSO held after the freeze (max over partitions, median and max over
    rounds), the latency windows (medians over rounds), and the target: the LSO is held no
    longer than min(timeout + the broker's check, lease + a tick) + 1 s."""
    rows: list[dict[str, Any]] = []
    targets: list[dict[str, Any]] = []
    for s in result["config"]["settings"]:
        timeout, lease = (float(x) for x in s.split("/"))
        cells = [
            c
            for c in result.get("cells", [])
            if c["timeout_s"] == timeout and c["lease_s"] == lease and "lso" in c
        ]
        if not cells:
            continue
        held = [c["lso"]["held_max_s"] for c in cells if c["lso"]["held_max_s"] is not None]
        row: dict[str, Any] = {
            "timeout_s": timeout,
            "lease_s": lease,
            "rounds": len(cells),
            "held_median_s": median(held),
            "held_max_s": max(held) if held else None,
            "stalled_partitions": median(
                sum(p["stalled"] for p in c["lso"]["partitions"].values()) for c in cells
            ),
            "max_lag": max(
                (p["max_lag"] or 0 for c in cells for p in c["lso"]["partitions"].values()),
                default=0,
            ),
            "baseline_longest_s": max(
                p["baseline_longest_s"] for c in cells for p in c["lso"]["partitions"].values()
            ),
            **cells[0]["expected"],
            "missing": sum(c["latency"]["events"]["missing"] for c in cells),
            "duplicates": sum(c["consumer"].get("duplicates", 0) for c in cells),
        }
        for w in WINDOWS:
            for k in ("p50", "p99", "max"):
                row[f"{w}_{k}"] = median(c["latency"]["windows"][w][k] for c in cells)
        rows.append(row)
        if row["held_max_s"] is not None:
            targets.append(
                target(
                    f"timeout {timeout:g} s, lease {lease:g} s: the LSO held at most "
                    f"min(timeout + {BROKER_ABORT_CHECK_S:g} s, lease + a tick) + 1 s "
                    f"= {row['bound_s']:.1f} s",
                    f"{row['held_max_s']:.2f} s (max of {len(cells)} round(s))",
                    row["held_max_s"] <= row["bound_s"],
                )
            )
    return {"rows": rows, "targets": targets}


def problems(result: dict[str, Any]) -> list[str]:
    """What makes an eos-freeze result wrong (not slow): a cell that failed, committed events
    that never arrived or arrived twice, a freeze that held no partition's LSO."""
    out = []
    for c in result.get("cells", []):
        where = f"cell {c['cell']} (timeout {c['timeout_s']:g}, lease {c['lease_s']:g})"
        if bad := unfinished(c, where, "latency"):
            out += bad
            continue
        if c["latency"]["events"]["missing"]:
            out.append(f"{where}: {c['latency']['events']['missing']} events never arrived")
        if c["consumer"].get("duplicates"):
            out.append(f"{where}: {c['consumer']['duplicates']} events arrived twice")
        if c["lso"]["held_max_s"] is None:
            out.append(f"{where}: the freeze held no partition's LSO (no transaction open?)")
    return out


def markdown(result: dict[str, Any], summary: dict[str, Any], plots: list[str]) -> str:
    cfg = result["config"]
    lines = [f"# notify-outbox exactly-once frozen relay {result['run_id']}", ""]
    lines += environment_lines(result)
    lines += [
        f"- 2 exactly-once relays (default settings but the transaction timeout and the lease "
        f"of each cell) on one database and topic ({cfg['partitions']} partitions); writers at "
        f"{cfg['rate']:g} ev/s over {cfg['keys']:,} keys, open loop, single-row transactions; "
        f"{cfg['warmup']:g} s warm-up, {cfg['baseline']:g} s baseline, then relay 1 stops "
        f"itself (SIGSTOP) at its next commit (`{STOP_POINT}`: its batch's records acked, the "
        f"transaction open), stays frozen {cfg['freeze']:g} s and is continued; "
        f"{cfg['after']:g} s after; {cfg['repeat']} round(s).",
        "",
        "Every partition of the topic and of the marker topic is looked at every "
        f"{cfg['look_every']:g} s from the bench: its end offset read_committed (the last "
        "stable offset, LSO) and read_uncommitted (the high watermark). A **stall** is a run "
        "of looks with the LSO at one offset below the high watermark; **held** is how long "
        "after the stop the frozen transaction's stall ended (max over partitions), **lag** "
        "the most offsets behind meanwhile (records and the transactions' commit markers, "
        "which take an offset each). The **bound** is when the transaction must have "
        f"ended: the broker aborts it at its timeout (checking every {BROKER_ABORT_CHECK_S:g} "
        "s: transaction.abort.timed.out.transaction.cleanup.interval.ms), or the other "
        "relay's tick (every min(5 s, lease / 3)) finds the slot's lease expired and fences "
        "it; the earlier of the two, plus 1 s. Latency is commit ack -> read_committed "
        "receipt (ms), by commit ack: **before** (the baseline, up to 1 s before the arming: a row "
        "committed just before it may be in the frozen batch; runs before 20:20 UTC on "
        "2026-11-28 had no such guard), **frozen** (the stop to the SIGCONT), **after**.",
    ]
    lines += targets_section(summary, "issue #35: the LSO stall bounded by the settings")
    lines += ["", "## LSO held per setting", ""]
    lines += table(
        (
            "timeout / lease (s) | rounds | held (s) median / max | partitions stalled | "
            "most offsets behind | by broker / by takeover (s) | baseline longest stall (s) | "
            "p50 / p99 / max before | frozen | after | missing / duplicates"
        ),
        [
            [
                f"{r['timeout_s']:g} / {r['lease_s']:g}",
                str(r["rounds"]),
                f"{num(r['held_median_s'])} / {num(r['held_max_s'])}",
                num(r["stalled_partitions"], 0),
                str(r["max_lag"]),
                f"{r['by_broker_s']:g} / {r['by_takeover_s']:.1f}",
                num(r["baseline_longest_s"]),
                *(
                    " / ".join(num(r[f"{w}_{k}"], 1) for k in ("p50", "p99", "max"))
                    for w in WINDOWS
                ),
                f"{r['missing']} / {r['duplicates']}",
            ]
            for r in summary["rows"]
        ],
    )
    cells = [c for c in result.get("cells", []) if "lso" in c]
    if cells:
        lines += ["", "## Every partition", ""]
        lines += table(
            (
                "timeout / lease | round | partition | stalled | held (s) | stall (s) | "
                "most behind | ended | baseline stalls, longest (s) | relay 2: recoveries | "
                "relay 1: slots lost"
            ),
            [
                [
                    f"{c['timeout_s']:g} / {c['lease_s']:g}",
                    str(c["round"] + 1),
                    name,
                    "yes" if p["stalled"] else "no",
                    num(p["held_s"]),
                    num(p["stall_s"]),
                    str(p["max_lag"] if p["max_lag"] is not None else "-"),
                    str(p["ended"] if p["ended"] is not None else "-"),
                    f"{p['baseline_stalls']}, {num(p['baseline_longest_s'])}",
                    str(c["relay_logs"][1]["was in flight"]),
                    str(c["relay_logs"][0]["is no longer this relay's"]),
                ]
                for c in cells
                for name, p in c["lso"]["partitions"].items()
            ],
        )
    lines += modes_section(result)
    return finish(lines, result, plots, problems(result))


def plot(result: dict[str, Any], summary: dict[str, Any], path: Path) -> bool:
    """Per cell, each partition's LSO lag (offsets behind the high watermark) against the
    seconds since the freeze."""
    from bench.plots import plt  # matplotlib only when plotting

    cells = [c for c in result.get("cells", []) if "lso" in c]
    if not cells:
        return False
    fig, axes = plt.subplots(len(cells), 1, figsize=(10, 2.6 * len(cells)), squeeze=False)
    for ax, c in zip(axes[:, 0], cells, strict=True):
        for name, pts in c["lso"]["series"].items():
            if not any(hw > lso for _, hw, lso in pts):
                continue
            ax.step(
                [t / 1000 for t, _, _ in pts],
                [hw - lso for _, hw, lso in pts],
                where="post",
                label=name,
                linewidth=1,
            )
        ax.axvline(0, color="grey", linewidth=0.8)
        ax.axvline(c["frozen_s"], color="grey", linewidth=0.8, linestyle="--")
        ax.axvline(c["expected"]["bound_s"], color="red", linewidth=0.8, linestyle=":")
        ax.set_title(
            f"timeout {c['timeout_s']:g} s, lease {c['lease_s']:g} s, round {c['round'] + 1}",
            fontsize=9,
        )
        ax.set_ylabel("offsets behind")
        ax.legend(fontsize=7)
        ax.grid(True, alpha=0.3)
    axes[-1, 0].set_xlabel("seconds since the relay stopped (dashed: SIGCONT; dotted: bound)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


REGIME = Regime.of(__name__, _EosFreeze.main, "## Targets", "## LSO held per setting")
