"""The outage-recovery phase (``python -m bench recovery``): how soon after Kafka (or
PostgreSQL) comes back does the relay deliver again, and how loud is its log meanwhile? It
restarts the services, so it needs its own devstack stack or ``--stack-dir``. Method:
``bench/README.md``, "Outage recovery"."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import socket
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg

from bench.analysis import median
from bench.arrays import load_arrays
from bench.config import (
    Mode,
    PhaseConfig,
    add_options,
    common_options,
    from_args,
    phase_options,
    writers_for,
)
from bench.fmt import environment_lines, finish, grid, num, percent, targets_section
from bench.loadgen import LoadConfig
from bench.phase import PhaseRun
from bench.procs import BenchError, Child
from bench.regimes import QUERY_ERRORS, Looker, Regime, RegimeRun, received_at, target
from bench.services import Services, check_loopback, connection, open_services, set_notify
from devstack.relayproc import create_topics

_SERVICE_TIMEOUT = 180.0  # a stop or start of Kafka or PostgreSQL on a busy machine
_SAMPLE_S = 0.1
_POLL_S = 0.02
_TS = re.compile(rb"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")
_XACT_SAMPLE_S = 0.05
_XACT_CLEAR_TIMEOUT = 60.0  # after the restart: until no transaction of the outage is open
# The relay's worker sessions in a transaction: when it began (the identity of a transaction,
# with the pid), how long it has been open, and whether it holds a transaction id.
_WORKER_XACTS = """
SELECT pid, extract(epoch FROM xact_start)::float8 AS began,
       extract(epoch FROM clock_timestamp() - xact_start)::float8 AS age,
       backend_xid IS NOT NULL AS has_xid
FROM pg_stat_activity
WHERE datname = current_database()
  AND (application_name = 'notify-outbox-worker' OR application_name LIKE 'notify-outbox-worker/%')
  AND xact_start IS NOT NULL
"""
_DIGITS = re.compile(r"\d+")


@dataclass
class RecoveryConfig(PhaseConfig):
    """Everything one recovery run does; recorded in the result JSON."""

    services: list[str] = field(default_factory=lambda: ["kafka", "postgres"])
    repeat: int = 5  # restarts per service
    pause: float = 2.0  # seconds between the stop and the start
    rate: float = 200.0  # events per second, the whole run
    keys: int = 1000
    settle: float = 5.0  # steady seconds before every stop and after the last restart
    recover_timeout: float = 90.0  # per restart: from "accepting connections" to caught up
    drain_timeout: float = 60.0  # at the end: until every committed event arrived
    stack_dir: str | None = None


HELP = "outage recovery: Kafka and PostgreSQL restarts"


def arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m bench recovery``."""
    add_options(
        p,
        RecoveryConfig,
        repeat="restarts per service (default 5)",
        services=("what to restart, in this order", {"choices": ["kafka", "postgres"]}),
        pause="seconds between stop and start",
        rate="writers' events/s (keyed)",
        settle="steady seconds between restarts",
        recover_timeout="per restart, seconds to catch up",
    )
    p.add_argument(
        "--stack-dir",
        type=Path,
        help="restart this running devstack stack (DIR/postgres, DIR/kafka) instead of "
        "starting one",
    )
    phase_options(p)


def configure(args: argparse.Namespace) -> RecoveryConfig:
    """The config of ``python -m bench recovery ...``."""
    stack_dir = str(args.stack_dir.resolve()) if args.stack_dir else None
    return from_args(RecoveryConfig, args, stack_dir=stack_dir, **common_options(args))


@dataclass
class _Handles:
    postgres: Any = None  # devstack.PostgresServer
    kafka: Any = None  # devstack.KafkaBroker


class _LogCounter:
    """Samples the relay's log every 0.1 s: (monotonic ns, lines so far, bytes so far)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.samples: list[tuple[int, int, int]] = []
        self._lines = 0
        self._offset = 0

    def sample(self) -> None:
        """Count the lines written since the last sample."""
        with contextlib.suppress(OSError), self.path.open("rb") as fh:
            fh.seek(self._offset)
            data = fh.read()
            # Only whole lines: a half-written one is counted next time.
            end = data.rfind(b"\n") + 1
            self._lines += data.count(b"\n", 0, end)
            self._offset += end
        self.samples.append((time.monotonic_ns(), self._lines, self._offset))

    async def run(self) -> None:
        """Sample until cancelled."""
        while True:
            self.sample()
            await asyncio.sleep(_SAMPLE_S)

    def at(self, t_ns: int) -> tuple[int, int]:
        """(lines, bytes) of the last sample at or before ``t_ns``."""
        best = (0, 0)
        for t, lines, offset in self.samples:
            if t > t_ns:
                break
            best = (lines, offset)
        return best

    def shapes(self, start: int, end: int, top: int = 6) -> list[tuple[str, int]]:
        """The most frequent kinds of line in bytes [start, end): logger and message with
        digits blanked."""
        try:
            with self.path.open("rb") as fh:
                fh.seek(start)
                data = fh.read(max(0, end - start))
        except OSError:
            return []
        kinds: Counter[str] = Counter()
        for raw in data.splitlines():
            stamp = _TS.match(raw)
            text = raw[stamp.end() :] if stamp else raw
            kinds[_DIGITS.sub("N", text.decode(errors="replace"))[:120]] += 1
        return kinds.most_common(top)


@dataclass
class _Xact:
    pid: int
    began: float  # xact_start, epoch seconds (with the pid: which transaction)
    age: float  # seconds open at the sample
    has_xid: bool


class _XactSampler(Looker):
    """Every 50 ms, from just before a Kafka stop until every transaction begun before
    Kafka came back has ended: the relay's worker sessions in a transaction (a claim waiting
    for Kafka holds the vacuum horizon and its rows' locks)."""

    def __init__(self, dsn: str) -> None:
        super().__init__(dsn, _XACT_SAMPLE_S, "bench-xact-sampler")
        self.samples: list[tuple[int, list[_Xact]]] = []  # (monotonic ns, open transactions)
        self.up_at: int | None = None  # the service accepts connections again (monotonic ns)
        self.clear = asyncio.Event()  # set once no transaction begun before up_at is open

    async def look(self) -> None:
        t0 = time.monotonic_ns()
        rows = await self.fetch(_WORKER_XACTS, within=5)
        if rows is None:
            return
        t = (t0 + time.monotonic_ns()) // 2
        xacts = [_Xact(r["pid"], r["began"], r["age"], bool(r["has_xid"])) for r in rows]
        self.samples.append((t, xacts))
        if self.up_at is not None and t >= self.up_at and not _outage_xacts(xacts, t, self.up_at):
            self.clear.set()

    async def wait_clear(self, up_at: int, within: float) -> bool:
        """Wait (bounded) until a sample after ``up_at`` shows no transaction begun before it."""
        self.up_at = up_at
        try:
            await asyncio.wait_for(self.clear.wait(), within)
            return True
        except TimeoutError:
            return False


def _outage_xacts(xacts: list[_Xact], t: int, up_at: int) -> list[_Xact]:
    """The transactions of a sample taken at ``t`` that began before ``up_at``."""
    return [x for x in xacts if t - int(x.age * 1e9) < up_at]


def xact_record(
    samples: list[tuple[int, list[_Xact]]], t_stop: int, t_up: int, errors: list[str]
) -> dict[str, Any]:
    """The relay's transactions around one outage: the oldest's age and any xid while
    the service was down; how long each begun before it came back stayed open; and when the
    last of those ended (None if one still was at the end of the sampling)."""
    down = [(t, xs) for t, xs in samples if t_stop <= t <= t_up]
    longest: dict[tuple[int, float], float] = {}
    last_open: int | None = None
    for k, (t, xs) in enumerate(samples):
        outage = _outage_xacts(xs, t, t_up)
        for x in outage:
            key = (x.pid, x.began)
            longest[key] = max(longest.get(key, 0.0), x.age)
        if outage:
            last_open = k
    if last_open is None:
        clear_at: int | None = samples[0][0] if samples else None
    elif last_open + 1 < len(samples):
        clear_at = samples[last_open + 1][0]
    else:
        clear_at = None
    first = samples[0][1] if samples else []
    return {
        "samples": len(samples),
        "down_samples": len(down),
        "interval_s": _XACT_SAMPLE_S,
        "open_at_stop": len(first),
        "oldest_at_stop_s": max((x.age for x in first), default=None),
        "max_age_down_s": max((x.age for _, xs in down for x in xs), default=0.0),
        "xid_down": any(x.has_xid for _, xs in down for x in xs),
        "open_share_down": (sum(1 for _, xs in down if xs) / len(down)) if down else None,
        "outage_xacts": len(longest),
        "longest_outage_xact_s": max(longest.values(), default=0.0),
        "clear_after_stop_s": (clear_at - t_stop) / 1e9 if clear_at is not None else None,
        "clear_after_up_s": (clear_at - t_up) / 1e9 if clear_at is not None else None,
        # Per sample: ms after the stop, transactions open, the oldest's age (ms), any xid.
        "timeline": [
            [
                round((t - t_stop) / 1e6, 1),
                len(xs),
                round(1000 * max((x.age for x in xs), default=0.0), 1),
                any(x.has_xid for x in xs),
            ]
            for t, xs in samples
        ],
        "errors": errors,
    }


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


async def _pg_accepts(dsn: str) -> bool:
    try:
        conn = await asyncpg.connect(dsn, timeout=1.0)
    except QUERY_ERRORS:
        return False
    try:
        await conn.fetchval("SELECT 1", timeout=1.0)
        return True
    except QUERY_ERRORS:
        return False
    finally:
        with contextlib.suppress(Exception):
            await conn.close(timeout=1)


class _Recovery(RegimeRun):
    name = "recovery"
    cfg: RecoveryConfig

    def __init__(self, cfg: RecoveryConfig, run: PhaseRun) -> None:
        super().__init__(cfg, run)
        self.handles = _Handles()
        self.restarts: list[dict[str, Any]] = []
        run.result["restarts"] = self.restarts
        self.mode = Mode(
            "relay",
            "relay",
            "one notify-outbox relay process, default settings"
            + (f"; relay code from {cfg.alt_relay}" if cfg.alt_relay else ""),
            cwd=cfg.alt_relay,
        )
        run.result["mode"] = self.mode.to_json()
        run.progress.total = len(cfg.services) * cfg.repeat

    def intro(self) -> str:
        cfg = self.cfg
        return (
            f"recovery: {cfg.repeat} restart(s) of {' and '.join(cfg.services)}, pause "
            f"{cfg.pause:g}s, writers at {cfg.rate:g} ev/s"
        )

    async def open_services(self, work: Path) -> Services:
        """The services of a recovery run: the bench's own stack, or an existing devstack stack
        directory; never services it cannot restart."""
        if self.cfg.stack_dir is None:
            services = await open_services(work)
            if services.own_stack is None:
                raise BenchError(
                    "recovery restarts PostgreSQL and Kafka, so it needs the bench's own stack "
                    "(unset NOTIFY_OUTBOX_DSN / NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS) or "
                    "--stack-dir of a devstack stack"
                )
            self.handles.postgres = services.own_stack.postgres
            self.handles.kafka = services.own_stack.kafka
            return services
        from devstack import KAFKA_VERSION, KafkaBroker, PostgresServer

        base = Path(self.cfg.stack_dir)  # made absolute by the command line
        probe = PostgresServer(base / "postgres")
        if not probe.is_running():
            raise BenchError(f"--stack-dir {base}: no running PostgreSQL in {base / 'postgres'}")
        kafka = KafkaBroker(base / "kafka")
        if not kafka.is_running():
            raise BenchError(f"--stack-dir {base}: no running Kafka in {base / 'kafka'}")
        check_loopback(probe.dsn, kafka.bootstrap_servers)
        async with connection(probe.dsn) as conn:
            fsync = await conn.fetchval("SHOW fsync")
        # devstack rewrites its settings file on every start: restart it as it was.
        self.handles.postgres = PostgresServer(base / "postgres", durable=fsync == "on")
        self.handles.kafka = kafka
        return Services(probe.dsn, kafka.bootstrap_servers, work, kafka_version=KAFKA_VERSION)

    async def body(self, services: Services) -> None:
        run, cfg = self.run, self.cfg
        name = f"bench_recovery_{run.run_id.lower()}"
        topic = f"bench-recovery-{run.run_id.lower()}"
        run.progress.status("set-up: database and topic")
        tree = Path(cfg.alt_relay) if cfg.alt_relay else None
        dsn = await services.create_database(name, src=tree)
        await create_topics(services.bootstrap, [topic], partitions=cfg.partitions)
        run.result["database_setup"] = await set_notify(dsn, "shipped")
        consumer = await run.start_consumer(services.bootstrap, topic, name="consumer")
        relay: Child | None = None
        gen: Child | None = None
        counter: asyncio.Task[None] | None = None
        gen_path, got_path = run.array_paths("recovery")
        try:
            relay = await run.start(services, self.mode, dsn, name="relay", extra_env=cfg.relay_env)
            log = _LogCounter(relay.log_path)
            counter = asyncio.create_task(log.run())
            # The schedule is as long as the run's deadline; it is stopped (stdin) when done.
            deadline = cfg.settle * 2 + len(cfg.services) * cfg.repeat * (
                cfg.settle + cfg.pause + 2 * _SERVICE_TIMEOUT + cfg.recover_timeout
            )
            lc = LoadConfig(
                dsn=dsn,
                topic=topic,
                cell=1,
                rate=cfg.rate,
                warmup=0.0,
                duration=deadline,
                writers=writers_for(cfg.rate),
                out=str(gen_path),
                keys=cfg.keys,
                reconnect=True,
                stop_on_input=True,
            )
            gen = await run.start_loadgen(lc, name="writers")
            run.progress.status(f"steady traffic at {cfg.rate:g} ev/s for {cfg.settle:g}s")
            await asyncio.sleep(cfg.settle)
            for service in cfg.services:
                for i in range(cfg.repeat):
                    self.restarts.append(await self._restart(service, i, dsn))
                    if not relay.running():
                        raise BenchError(
                            f"the relay exited ({relay.proc.returncode}):\n{relay.tail()}"
                        )
                    await asyncio.sleep(cfg.settle)
            if not gen.running():
                raise BenchError(f"the writers exited ({gen.proc.returncode}):\n{gen.tail()}")
            summary = await run.stop_writers(gen)
            run.result["writers"] = summary
            run.result["consumer"] = await run.collect_writers(
                consumer, summary, label="recovery", within=cfg.drain_timeout, out=got_path
            )
            counter.cancel()
            log.sample()
            self._analyse(load_arrays(gen_path), load_arrays(got_path), log)
        finally:
            if counter is not None:
                counter.cancel()
            if gen is not None:
                await gen.stop(10)
            if relay is not None:
                run.result["relay_exit"] = await run.stop(relay)
                run.result["relay_log_lines"] = relay.log_lines()
            await run.quit_consumer(consumer)
            for p in (gen_path, got_path):
                p.unlink(missing_ok=True)

    async def _restart(self, service: str, i: int, dsn: str) -> dict[str, Any]:
        label = f"{service} restart {i + 1}/{self.cfg.repeat}"
        # While Kafka is away the relay's transactions are watched (PostgreSQL's stop ends
        # every session, and there is nothing to look at while it is down).
        sampler = _XactSampler(dsn) if service == "kafka" else None
        try:
            if sampler is not None:
                await sampler.start()
            return await self._restart_with(service, i, dsn, label, sampler)
        finally:
            if sampler is not None:
                await sampler.stop()

    async def _restart_with(
        self, service: str, i: int, dsn: str, label: str, sampler: _XactSampler | None
    ) -> dict[str, Any]:
        run, cfg = self.run, self.cfg
        h = self.handles
        run.progress.status(f"{label}: stopping")
        t_stop = time.monotonic_ns()
        if service == "kafka":
            await asyncio.wait_for(asyncio.to_thread(h.kafka.stop), _SERVICE_TIMEOUT)
        else:
            await asyncio.wait_for(asyncio.to_thread(h.postgres.stop, "fast"), _SERVICE_TIMEOUT)
        t_stopped = time.monotonic_ns()
        await asyncio.sleep(cfg.pause)
        run.progress.status(f"{label}: starting")
        t_start = time.monotonic_ns()
        starting = asyncio.ensure_future(
            asyncio.wait_for(
                asyncio.to_thread(h.kafka.start if service == "kafka" else h.postgres.start),
                _SERVICE_TIMEOUT,
            )
        )
        # "Accepting connections": Kafka's port takes a TCP connection; PostgreSQL lets a
        # client log in and run a query (its port opens earlier, while it still refuses
        # logins with "the database system is starting up").
        t_up: int | None = None
        limit = time.monotonic() + _SERVICE_TIMEOUT
        while t_up is None and time.monotonic() < limit:
            if service == "kafka":
                ok = await asyncio.to_thread(_port_open, h.kafka.port)
            else:
                ok = await _pg_accepts(dsn)
            if ok:
                t_up = time.monotonic_ns()
                break
            if starting.done() and starting.exception() is not None:
                break
            await asyncio.sleep(_POLL_S)
        await starting  # raises a failed start
        t_started = time.monotonic_ns()
        if t_up is None:
            raise BenchError(f"{label}: the service never accepted connections")
        run.progress.status(f"{label}: up; waiting for the relay to catch up")
        caught_up = await self._caught_up(dsn, cfg.recover_timeout)
        t_caught_up = time.monotonic_ns()
        xact: dict[str, Any] | None = None
        if sampler is not None:
            run.progress.status(f"{label}: waiting for the outage's transactions to end")
            await sampler.wait_clear(t_up, _XACT_CLEAR_TIMEOUT)
            xact = xact_record(sampler.samples, t_stop, t_up, sampler.errors)
        record = {
            "service": service,
            "n": i + 1,
            "t_stop_ns": t_stop,
            "t_stopped_ns": t_stopped,
            "t_start_ns": t_start,
            "t_up_ns": t_up,
            "t_started_ns": t_started,
            "t_caught_up_ns": t_caught_up,
            "caught_up": caught_up,
            "stop_s": (t_stopped - t_stop) / 1e9,
            "up_after_stop_s": (t_up - t_stop) / 1e9,
            "ready_after_up_s": (t_started - t_up) / 1e9,
            "xact": xact,
        }
        run.progress.line(
            f"{label}: stopped in {record['stop_s']:.1f}s, accepting connections "
            f"{record['up_after_stop_s']:.1f}s after the stop"
            + ("" if caught_up else "; the relay did NOT catch up in time")
            + (
                f"; relay transactions: oldest {xact['max_age_down_s']:.2f}s while down"
                f"{' (with an xid)' if xact['xid_down'] else ''}, none open "
                + (
                    f"{xact['clear_after_stop_s']:.2f}s after the stop"
                    if xact["clear_after_stop_s"] is not None
                    else "never seen"
                )
                if xact is not None
                else ""
            ),
            cell=True,
        )
        return record

    async def _caught_up(self, dsn: str, within: float) -> bool:
        """Wait (bounded) until the outbox holds no more than a second of traffic: only paces
        the run (the figures come from the consumer's arrays afterwards)."""
        limit = time.monotonic() + within
        while time.monotonic() < limit:
            with contextlib.suppress(*QUERY_ERRORS):
                async with connection(dsn, within=5) as conn:
                    left = int(await conn.fetchval("SELECT count(*) FROM outbox", timeout=5))
                if left <= max(10, int(self.cfg.rate)):
                    return True
            await asyncio.sleep(0.2)
        return False

    def _analyse(self, gen: dict[str, Any], got: dict[str, Any], log: _LogCounter) -> None:
        send, ack = gen["send"], gen["ack"]
        recv_of = received_at(got)
        acked = [i for i in range(len(ack)) if ack[i]]
        missing = [i for i in acked if i not in recv_of]
        self.run.result["events"] = {
            "acked": len(acked),
            "received": len(recv_of),
            "missing": len(missing),
            "first_missing": missing[:20],
        }
        for k, r in enumerate(self.restarts):
            t_stop, t_up = r["t_stop_ns"], r["t_up_ns"]
            # "Committed after the outage began": Kafka: the INSERT began after the broker
            # was stopped; PostgreSQL: after it accepted connections again.
            since = t_stop if r["service"] == "kafka" else t_up
            firsts = [
                recv_of[i]
                for i in range(len(send))
                if send[i] >= since and ack[i] and i in recv_of and recv_of[i] >= t_up
            ]
            t_first = min(firsts) if firsts else None
            nxt = self.restarts[k + 1]["t_stop_ns"] if k + 1 < len(self.restarts) else None
            lo = t_stop - 1_000_000_000
            hi = (nxt - 1_000_000_000) if nxt is not None else None
            lat = [
                (recv_of[i] - ack[i]) / 1e6
                for i in acked
                if ack[i] >= lo and (hi is None or ack[i] < hi) and i in recv_of
            ]
            lost = sum(1 for i in missing if ack[i] >= lo and (hi is None or ack[i] < hi))
            end = t_first if t_first is not None else r["t_caught_up_ns"]
            lines0, off0 = log.at(t_stop)
            lines1, off1 = log.at(end)
            outage_s = (end - t_stop) / 1e9
            r.update(
                {
                    "first_delivery_after_up_s": (t_first - t_up) / 1e9 if t_first else None,
                    "first_delivery_after_stop_s": (t_first - t_stop) / 1e9 if t_first else None,
                    "max_latency_ms": max(lat) if lat else None,
                    "events_in_slot": len(lat),
                    "missing_in_slot": lost,
                    "log_lines": lines1 - lines0,
                    "log_lines_per_s": (lines1 - lines0) / outage_s if outage_s > 0 else None,
                    "log_kinds": log.shapes(off0, off1),
                }
            )


def problems(result: dict[str, Any]) -> list[str]:
    """What makes a recovery result wrong (not slow): lost events, a restart after which
    nothing was delivered, a relay that did not stop cleanly."""
    problems = []
    ev = result.get("events")
    if ev is None:
        problems.append("no analysis (the run did not finish)")
    elif ev["missing"]:
        problems.append(f"{ev['missing']} committed events never arrived")
    for r in result.get("restarts", []):
        if r.get("first_delivery_after_up_s") is None:
            problems.append(f"{r['service']} restart {r['n']}: no delivery after it came back")
    return problems


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Medians and maxima per service, and the targets of issue 10 (recovery <= 1 s, about
    one log line per second of outage)."""
    out: dict[str, Any] = {"services": {}, "targets": []}
    for service in result["config"]["services"]:
        rs = [r for r in result.get("restarts", []) if r["service"] == service]
        rec = [r["first_delivery_after_up_s"] for r in rs if r.get("first_delivery_after_up_s")]
        lps = [r["log_lines_per_s"] for r in rs if r.get("log_lines_per_s") is not None]
        lat = [r["max_latency_ms"] for r in rs if r.get("max_latency_ms") is not None]
        row = {
            "restarts": len(rs),
            "recovery_median_s": median(rec),
            "recovery_max_s": max(rec) if rec else None,
            "up_after_stop_median_s": (median(r["up_after_stop_s"] for r in rs)),
            "max_latency_ms": max(lat) if lat else None,
            "log_lines_per_s_median": median(lps),
            "log_lines_per_s_max": max(lps) if lps else None,
        }
        xs = [r["xact"] for r in rs if r.get("xact")]
        if xs:
            clear = [x["clear_after_stop_s"] for x in xs if x["clear_after_stop_s"] is not None]
            row["xact"] = {
                "max_age_down_s": max(x["max_age_down_s"] for x in xs),
                "longest_outage_xact_s": max(x["longest_outage_xact_s"] for x in xs),
                "xid_restarts": sum(1 for x in xs if x["xid_down"]),
                "clear_after_stop_median_s": median(clear),
                "clear_after_stop_max_s": max(clear) if clear else None,
                "never_clear": len(xs) - len(clear),
            }
        out["services"][service] = row
        if row["recovery_median_s"] is not None:
            v = row["recovery_median_s"]
            out["targets"].append(
                target(
                    f"{service}: delivery resumes <= 1 s after it accepts connections (median)",
                    f"{v:.2f} s (max {row['recovery_max_s']:.2f} s)",
                    v <= 1.0,
                )
            )
        if row["log_lines_per_s_max"] is not None:
            v = row["log_lines_per_s_max"]
            out["targets"].append(
                target(
                    f"{service} outage: <= ~1 relay log line per second",
                    f"max {v:.1f} lines/s (median {row['log_lines_per_s_median']:.1f})",
                    v <= 1.5,
                )
            )
    return out


def markdown(result: dict[str, Any], summary: dict[str, Any], plots: list[str]) -> str:
    cfg = result["config"]
    lines = [f"# notify-outbox outage recovery {result['run_id']}", ""]
    lines += environment_lines(result)
    ev = result.get("events", {})
    lines += [
        "- one relay process (default settings"
        + (
            ", " + ", ".join(f"{k}={v}" for k, v in cfg["relay_env"].items())
            if cfg["relay_env"]
            else ""
        )
        + f"), writers at {cfg['rate']:g} ev/s over {cfg['keys']} keys the whole run; "
        f"{cfg['repeat']} restart(s) per service, {cfg['pause']:g} s between stop and start, "
        f"{cfg['settle']:g} s of steady traffic between restarts",
        f"- events: {ev.get('acked', '-')} committed, {ev.get('received', '-')} received, "
        f"**{ev.get('missing', '-')} missing**; relay exit code {result.get('relay_exit')}, "
        f"{result.get('relay_log_lines', '-')} log lines in all",
        "",
        "**Recovery** is the time from the service accepting connections again (Kafka: its "
        "port takes a TCP connection; PostgreSQL: a login and `SELECT 1` work) to the consumer "
        "receiving the first event committed after the outage began (Kafka: INSERT begun after "
        "the SIGTERM; PostgreSQL: after it accepted connections again). Max latency is commit "
        "ack -> receive over the events committed from 1 s before the stop to 1 s before the "
        "next one. Log lines are the relay's, from the stop to that first delivery.",
        "",
        "## Per service (medians over restarts)",
        "",
    ]
    lines += grid(
        [{"service": s, **r} for s, r in summary["services"].items()],
        ("service", lambda r: r["service"]),
        ("restarts", lambda r: str(r["restarts"])),
        ("accepting connections after the stop (s)", lambda r: num(r["up_after_stop_median_s"])),
        ("recovery median (s)", lambda r: num(r["recovery_median_s"])),
        ("recovery max (s)", lambda r: num(r["recovery_max_s"])),
        ("max latency (ms)", lambda r: num(r["max_latency_ms"], 0)),
        ("log lines/s median", lambda r: num(r["log_lines_per_s_median"], 1)),
        ("max", lambda r: num(r["log_lines_per_s_max"], 1)),
    )
    lines += targets_section(summary, "issue 10")
    lines += ["", "## Every restart", ""]
    lines += grid(
        result.get("restarts", []),
        ("service", lambda r: r["service"]),
        ("#", lambda r: str(r["n"])),
        ("stop took (s)", lambda r: num(r["stop_s"])),
        ("accepting after stop (s)", lambda r: num(r["up_after_stop_s"])),
        ("first delivery after accepting (s)", lambda r: num(r.get("first_delivery_after_up_s"))),
        ("after stop (s)", lambda r: num(r.get("first_delivery_after_stop_s"))),
        ("max latency (ms)", lambda r: num(r.get("max_latency_ms"), 0)),
        ("missing", lambda r: str(r.get("missing_in_slot", "-"))),
        ("log lines", lambda r: str(r.get("log_lines", "-"))),
        ("lines/s", lambda r: num(r.get("log_lines_per_s"), 1)),
    )
    lines += _xact_lines(result, summary)
    kinds = [
        (r["service"], r["n"], k)
        for r in result.get("restarts", [])
        for k in (r.get("log_kinds") or [])[:3]
    ]
    if kinds:
        lines += ["", "Most frequent relay log lines during each outage (digits as N):", ""]
        lines += [f"- {s} #{n}: {c} x `{text}`" for s, n, (text, c) in kinds]
    return finish(lines, result, plots, problems(result))


def _xact_lines(result: dict[str, Any], summary: dict[str, Any]) -> list[str]:
    """The relay's transactions while Kafka was down (restarts that sampled them)."""
    rs = [r for r in result.get("restarts", []) if r.get("xact")]
    if not rs:
        return []
    lines = [
        "",
        "## Relay transactions during the Kafka outages",
        "",
        "`pg_stat_activity` every 50 ms from just before the stop: the relay's worker sessions "
        "(`notify-outbox-worker`) in a transaction. **Oldest while down** is the age of the "
        "longest-open transaction seen from the stop until Kafka accepted connections, **xid** "
        "whether any of them held a transaction id (then it holds the database's horizon: "
        "vacuum keeps every tuple that dies meanwhile); **longest** how long the longest "
        "transaction begun before Kafka came back stayed open in all; **none open** the first "
        "look from which no such transaction was open any more, after the stop and after "
        "accepting connections (negative: before). PostgreSQL restarts are not sampled: the "
        "stop ends every session.",
        "",
    ]
    for service, row in summary["services"].items():
        x = row.get("xact")
        if x is not None:
            left = x["never_clear"]
            lines.append(
                f"- {service}: oldest while down max {num(x['max_age_down_s'])} s, longest "
                f"{num(x['longest_outage_xact_s'])} s, an xid held in {x['xid_restarts']} of "
                f"{row['restarts']} outages; none open {num(x['clear_after_stop_median_s'])} s "
                f"after the stop (median; max {num(x['clear_after_stop_max_s'])} s)"
                + (f"; one still open at the end of the looks in {left}" if left else "")
            )
    lines.append("")
    lines += grid(
        [{"service": r["service"], "n": r["n"], **r["xact"]} for r in rs],
        ("service", lambda x: x["service"]),
        ("#", lambda x: str(x["n"])),
        (
            "open at the stop (oldest, s)",
            lambda x: f"{x['open_at_stop']} ({num(x['oldest_at_stop_s'])})",
        ),
        ("oldest while down (s)", lambda x: num(x["max_age_down_s"])),
        ("xid", lambda x: "yes" if x["xid_down"] else "no"),
        ("looks with one open %", lambda x: num(percent(x["open_share_down"]), 0)),
        ("longest (s)", lambda x: num(x["longest_outage_xact_s"])),
        ("none open, s after stop", lambda x: num(x["clear_after_stop_s"])),
        ("after accepting", lambda x: num(x["clear_after_up_s"])),
        (
            "looks",
            lambda x: str(x["samples"]) + (f" ({len(x['errors'])} errors)" if x["errors"] else ""),
        ),
    )
    return lines


def plot(result: dict[str, Any], summary: dict[str, Any], path: Path) -> bool:
    from bench.plots import bar_figure, save_bar_chart  # matplotlib only when plotting

    rs = result.get("restarts", [])
    if not rs:
        return False
    fig, ax = bar_figure(max(6.0, 0.7 * len(rs)))
    labels = [f"{r['service']} {r['n']}" for r in rs]
    up = [r["up_after_stop_s"] for r in rs]
    rec = [r.get("first_delivery_after_up_s") or 0 for r in rs]
    ax.bar(labels, up, label="stop -> accepting connections", color="lightgrey")
    ax.bar(labels, rec, bottom=up, label="accepting -> first delivery (recovery)")
    ax.axhline(0, color="black", linewidth=0.5)
    ax.set_ylabel("seconds after the stop")
    ax.set_title("Outage recovery per restart")
    return save_bar_chart(fig, ax, path)


REGIME = Regime.of(__name__, _Recovery.main)
