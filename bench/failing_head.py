"""The failing-head regime (``python -m bench failing-head``): do rows whose topic does not
exist hold back the healthy rows behind them, and what does the database pay while they wait
for their retries? Method: ``bench/README.md``, "Failing head"."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient

from bench.analysis import median
from bench.arrays import load_arrays
from bench.config import (
    Mode,
    PhaseConfig,
    add_options,
    common_options,
    from_args,
    phase_options,
    regime_options,
    writers_for,
)
from bench.fmt import (
    environment_lines,
    finish,
    grid,
    modes_section,
    ms,
    num,
    opt,
    targets_section,
    whole,
)
from bench.hist import Histogram
from bench.loadgen import LoadConfig
from bench.phase import PhaseRun
from bench.procs import BenchError, Child
from bench.regimes import (
    DEFAULT_REGIME_MODES,
    Cells,
    CpuMeter,
    Regime,
    cell_record,
    database_postmaster,
    latency_ms,
    received_at,
    regime_mode,
    regime_modes,
    target,
    unfinished,
)
from bench.services import (
    Services,
    connection,
    db_counters,
    statement_calls,
    statements_delta,
)

_QUERY_TIMEOUT = 300.0  # a 100,000-row insert or VACUUM on a busy 2-core machine
_POLL_S = 0.1
_TOP_STATEMENTS = 6
# The claim statements of the modes, to count claims (and the rows they returned) in the
# quiet window: the relay's claim function, the poller's SELECT ... FOR UPDATE SKIP LOCKED.
_CLAIM = re.compile(r"_claim\"?\(|FOR UPDATE SKIP LOCKED", re.I)
_COMMENT = re.compile(r"--[^\n]*")
# How the bench sees that a mode has tried the failing rows.
_RELAY_TRIED = """
SELECT count(DISTINCT key) FROM outbox
WHERE topic = $1 AND (attempts > 0 OR next_attempt_at IS NOT NULL)
"""
_POLLER_TRIED = """
SELECT count(*) FROM pg_stat_activity
WHERE datname = $1 AND application_name = 'bench-poller' AND backend_xid IS NOT NULL
"""


@dataclass
class FailingHeadConfig(PhaseConfig):
    """Everything one failing-head run does; recorded in the result JSON."""

    failing_rows: list[int] = field(default_factory=lambda: [5000, 100_000])
    failing_keys: int = 5
    healthy_rows: int = 300
    healthy_keys: int = 30
    healthy_rate: float = 100.0
    healthy_timeout: float = 60.0  # per healthy row: counted as arrived within this
    quiet: float = 20.0
    # Before the quiet window: PostgreSQL 15's backends report their transaction counts at
    # most once a second, and one that just reported and went idle holds its next counts up
    # to 10 s (PGSTAT_IDLE_INTERVAL): so the healthy rows' commits are not counted as quiet.
    quiet_settle: float = 11.0
    tried_timeout: float = 60.0
    modes: list[str] = field(default_factory=lambda: list(DEFAULT_REGIME_MODES))
    repeat: int = 1


HELP = "healthy rows behind thousands of rows whose topic does not exist"


def arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m bench failing-head``."""
    add_options(
        p,
        FailingHeadConfig,
        failing_rows="sizes of the failing head (default 5000 100000)",
        failing_keys="keys of the failing rows",
        healthy_rows="healthy rows (default 300)",
        healthy_keys="their keys (default 30)",
        healthy_rate="their events/s",
        healthy_timeout="seconds a healthy row may take",
        quiet="seconds of the quiet window",
        quiet_settle="seconds before the quiet window, for PostgreSQL's delayed statistics",
        tried_timeout="seconds to wait for the mode to try the failing rows",
    )
    regime_options(p)
    phase_options(p)


def configure(args: argparse.Namespace) -> FailingHeadConfig:
    """The config of ``python -m bench failing-head ...`` (a BenchError for a bad value)."""
    common = common_options(args)
    modes = regime_modes(args, common["alt_relay"])
    if min(args.failing_rows) < 1 or args.healthy_rows < 1 or args.healthy_rate <= 0:
        raise BenchError("--failing-rows, --healthy-rows and --healthy-rate must be positive")
    return from_args(FailingHeadConfig, args, modes=modes, **common)


async def topic_exists(bootstrap: str, topic: str) -> bool | None:
    """Whether Kafka has ``topic`` (None if it would not say)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10000)
    try:
        async with asyncio.timeout(30):
            await admin.start()
            return topic in set(await admin.list_topics())
    except Exception:  # a record, never a reason to fail the cell
        return None
    finally:
        with contextlib.suppress(Exception):
            await admin.close()


async def fill_failing(dsn: str, topic: str, rows: int, keys: int) -> dict[str, float]:
    """``rows`` committed rows of keys ``f0`` .. ``f<keys-1>`` (round robin) to ``topic``, in
    one transaction (few keys: the ordering trigger's advisory locks are few), then
    ``VACUUM ANALYZE``."""
    async with connection(dsn) as conn:
        t0 = time.monotonic()
        await conn.execute(
            "INSERT INTO outbox (topic, key, payload) "
            "SELECT $1, 'f' || (g % $2), jsonb_build_object('f', g) "
            "FROM generate_series(1, $3::int) AS g ORDER BY g",
            topic,
            keys,
            rows,
            timeout=_QUERY_TIMEOUT,
        )
        inserted = time.monotonic() - t0
        await conn.execute("VACUUM ANALYZE outbox", timeout=_QUERY_TIMEOUT)
    return {"insert_s": inserted, "vacuum_s": time.monotonic() - t0 - inserted}


def quiet_record(
    before: dict[str, Any],
    after: dict[str, Any],
    calls0: dict[int, tuple[str, int, int]],
    calls1: dict[int, tuple[str, int, int]],
    seconds: float,
) -> dict[str, Any]:
    """Commits/s, transactions/s, statements/s, claims and the statements run most."""
    deltas = []
    for qid, (text, calls, rows) in calls1.items():
        _, c0, r0 = calls0.get(qid, ("", 0, 0))
        if calls > c0:
            deltas.append((calls - c0, rows - r0, " ".join(_COMMENT.sub("", text).split())))
    deltas.sort(reverse=True)
    claims = [d for d in deltas if _CLAIM.search(d[2])]
    delta = statements_delta(before, after)
    statements = delta / seconds if delta is not None else None
    return {
        "seconds": round(seconds, 3),
        "commits_per_s": (after["commits"] - before["commits"]) / seconds,
        "xacts_per_s": (after["xacts"] - before["xacts"]) / seconds,
        "statements_per_s": statements,
        "claims_per_s": sum(c for c, _, _ in claims) / seconds if calls1 else None,
        "claimed_rows": sum(r for _, r, _ in claims) if calls1 else None,
        "top_statements": [
            {"calls": c, "rows": r, "query": q[:100]} for c, r, q in deltas[:_TOP_STATEMENTS]
        ],
    }


class _FailingHead(Cells[Mode]):
    name, short = "failing-head", "fhead"
    cfg: FailingHeadConfig

    def __init__(self, cfg: FailingHeadConfig, run: PhaseRun) -> None:
        super().__init__(cfg, run, [regime_mode(m, cfg.alt_relay) for m in cfg.modes])
        self.statements = False

    def intro(self) -> str:
        cfg = self.cfg
        return (
            f"failing-head: {' and '.join(f'{s:,}' for s in cfg.failing_rows)} failing rows of "
            f"{cfg.failing_keys} keys x {' '.join(cfg.modes)} x {cfg.repeat} round(s); then "
            f"{cfg.healthy_rows} rows of {cfg.healthy_keys} other keys at "
            f"{cfg.healthy_rate:g} ev/s, {cfg.quiet:g}s quiet window"
        )

    def grid(self) -> Iterator[tuple[dict[str, Any], str]]:
        for rnd in range(self.cfg.repeat):
            for size in self.cfg.failing_rows:
                for mode in self.modes:
                    identity = {"round": rnd, "failing_rows": size, "mode": mode}
                    yield identity, f"{size} failing, {mode}, round {rnd + 1}"

    async def prepare(self, services: Services) -> None:
        run = self.run
        env = run.result["environment"]
        self.statements = bool(env.get("pg_stat_statements"))
        auto = env["kafka"]["broker_configs"].get("auto.create.topics.enable")
        if auto == "true":
            raise BenchError(
                "the broker creates topics on first use (auto.create.topics.enable=true): a "
                "missing topic cannot fail there"
            )
        if auto is None:
            run.notes.append(
                "the broker's auto.create.topics.enable is unknown: each cell checks that the "
                "failing topic still does not exist afterwards"
            )
        self.postmaster = await database_postmaster(services, run)

    async def cell(
        self, services: Services, identity: dict[str, Any], label: str
    ) -> dict[str, Any]:
        run, cfg = self.run, self.cfg
        mode, size = self.modes[identity["mode"]], identity["failing_rows"]
        cell = cell_record(len(self.cells) + 1, **identity)
        name, topic = self.names(cell)
        missing = f"bench-fhead-missing-{run.run_id.lower()}-{cell['cell']}"
        cell["failing_topic"] = missing
        run.progress.status(f"{label}: database, topic, {size} failing rows")

        async def measure(dsn: str) -> None:
            cell["failing_topic_exists_before"] = await topic_exists(services.bootstrap, missing)
            cell.update(await fill_failing(dsn, missing, size, cfg.failing_keys))
            await self._measure(services, mode, dsn, name, topic, cell, label)
            cell["failing_topic_exists_after"] = await topic_exists(services.bootstrap, missing)

        await self.in_fresh_database(services, mode, cell, measure)
        h, q = cell["healthy"], cell["quiet"]
        run.progress.line(
            f"{label:<34} healthy rows: {h['within_1s']}/{h['acked']} within 1 s, "
            f"{h['within_timeout']} within {cfg.healthy_timeout:g} s, p50 {ms(h['p50'])}, "
            f"p99 {ms(h['p99'])}, max {ms(h['max'])} | quiet: "
            f"{q['commits_per_s']:.1f} commits/s, {opt(q['statements_per_s'], '.1f')} "
            f"statements/s, {opt(q['claims_per_s'], '.1f')} claims/s, mode CPU "
            f"{q['mode_cpu_percent']:.1f}%",
            cell=True,
        )
        return cell

    async def _measure(
        self,
        services: Services,
        mode: Mode,
        dsn: str,
        database: str,
        topic: str,
        cell: dict[str, Any],
        label: str,
    ) -> None:
        run, cfg = self.run, self.cfg
        gen_path, got_path = run.array_paths(f"fhead-{cell['cell']}")
        consumer = await run.start_consumer(services.bootstrap, topic, name=f"consumer-{label}")
        proc: Child | None = None
        gen: Child | None = None
        try:
            extra = cfg.relay_env if mode.kind == "relay" else {}
            t_start = time.monotonic_ns()
            proc = await run.start(
                services, mode, dsn, name=f"{mode.name}-{label}", extra_env=extra
            )
            t_ready = time.monotonic_ns()
            cell["ready_after_start_s"] = (t_ready - t_start) / 1e9
            run.progress.status(f"{label}: waiting until the mode has tried the failing rows")
            tried, tried_at = await self._tried(
                services, mode, dsn, database, cell["failing_topic"]
            )
            cell["tried"] = tried
            cell["tried_after_ready_s"] = (tried_at - t_ready) / 1e9 if tried else None
            if not tried:
                run.notes.append(
                    f"{label}: the mode had not tried the failing rows after "
                    f"{cfg.tried_timeout:g} s; the healthy rows were written anyway"
                )
            run.progress.status(f"{label}: {cfg.healthy_rows} healthy rows")
            lc = LoadConfig(
                dsn=dsn,
                topic=topic,
                cell=1,
                rate=cfg.healthy_rate,
                warmup=0.0,
                duration=cfg.healthy_rows / cfg.healthy_rate,
                writers=writers_for(cfg.healthy_rate),
                out=str(gen_path),
                keys=cfg.healthy_keys,
            )
            gen = await run.start_loadgen(lc, name=f"writers-{label}")
            writers = json.loads(await gen.read_line(lc.duration + lc.grace + 60))
            cell["writers"] = writers
            run.progress.status(
                f"{label}: waiting up to {cfg.healthy_timeout:g}s for the healthy rows"
            )
            cell["consumer"] = await run.collect(
                consumer,
                cell=1,
                expect=int(writers["acked"]),
                within=cfg.healthy_timeout + 1.0,
                out=got_path,
            )
            cell["healthy"] = self._healthy(load_arrays(gen_path), load_arrays(got_path))
            run.progress.status(f"{label}: quiet window, {cfg.quiet:g}s")
            cell["quiet"] = await self._quiet(services, proc, database)
            cell["end_state"] = await _end_state(dsn, cell["failing_topic"], topic)
        finally:
            await run.end_cell(
                cell, writers=gen, mode=proc, consumer=consumer, arrays=(gen_path, got_path)
            )

    async def _tried(
        self, services: Services, mode: Mode, dsn: str, database: str, failing_topic: str
    ) -> tuple[bool, int]:
        """Wait (bounded) until the mode has tried the failing rows: the relay recorded an
        attempt for every failing key; the poller's session holds row locks."""
        relay = mode.kind == "relay"
        async with connection(dsn if relay else services.dsn) as conn:
            deadline = time.monotonic() + self.cfg.tried_timeout
            while True:
                if relay:
                    got = await conn.fetchval(_RELAY_TRIED, failing_topic, timeout=30)
                    done = int(got) >= self.cfg.failing_keys
                else:
                    done = int(await conn.fetchval(_POLLER_TRIED, database, timeout=30)) > 0
                if done or time.monotonic() > deadline:
                    return done, time.monotonic_ns()
                await asyncio.sleep(_POLL_S)

    def _healthy(self, gen: dict[str, Any], got: dict[str, Any]) -> dict[str, Any]:
        """Per healthy row, commit ack -> receipt."""
        recv_of = received_at(got)
        ack = gen["ack"]
        acked = [i for i in range(len(ack)) if ack[i]]
        lat = [recv_of[i] - ack[i] for i in acked if i in recv_of]
        h = Histogram()
        h.record_ns(lat)
        limit = int(self.cfg.healthy_timeout * 1e9)
        last_ack = max((ack[i] for i in acked), default=0)
        complete = bool(acked) and len(lat) == len(acked)
        return {
            "acked": len(acked),
            "received": len(lat),
            "within_1s": sum(1 for v in lat if v <= 1_000_000_000),
            "within_timeout": sum(1 for v in lat if v <= limit),
            **{k: v for k, v in latency_ms(h).items() if k != "count"},
            "all_arrived_after_last_commit_s": (
                (max(recv_of[i] for i in acked) - last_ack) / 1e9 if complete else None
            ),
            "by_second": _by_second([ack[i] for i in acked if i in recv_of], lat),
        }

    async def _quiet(self, services: Services, proc: Child, database: str) -> dict[str, Any]:
        """``quiet`` seconds with no new row: the database's counters, the mode's CPU."""
        cfg = self.cfg
        await self._wait(cfg.quiet_settle, "settling before the quiet window")
        meter = CpuMeter([proc], self.postmaster)
        lines0 = proc.log_lines()
        before = (await db_counters(services.dsn, [database], statements=self.statements))[database]
        calls0 = await statement_calls(services.dsn, database) if self.statements else {}
        cpu0, db0 = meter.read()
        seconds = await self._wait(cfg.quiet, "quiet window")
        cpu1, db1 = meter.read()
        after = (await db_counters(services.dsn, [database], statements=self.statements))[database]
        calls1 = await statement_calls(services.dsn, database) if self.statements else {}
        out = quiet_record(before, after, calls0, calls1, seconds)
        out["mode_cpu_percent"] = 100 * (cpu1 - cpu0) / seconds
        out["db_cpu_percent"] = (
            100 * (db1 - db0) / seconds if db0 is not None and db1 is not None else None
        )
        out["mode_log_lines"] = proc.log_lines() - lines0
        return out

    async def _wait(self, seconds: float, what: str) -> float:
        """Let ``seconds`` pass (a measurement window, nothing to wait for); the time passed."""
        t0 = time.monotonic_ns()
        await self.run.pace(t0 + int(seconds * 1e9), lambda left: f"{what}: {left:.0f}s left")
        return (time.monotonic_ns() - t0) / 1e9


def _by_second(acks: list[int], lat: list[int]) -> list[list[float]]:
    """Per second of commits from the first: [second, rows, p50 ms, max ms] (where in the
    run the slow rows were: while the failing rows were being set aside, or after)."""
    if not acks:
        return []
    first = min(acks)
    slots: dict[int, list[int]] = {}
    for a, v in zip(acks, lat, strict=True):
        slots.setdefault((a - first) // 1_000_000_000, []).append(v)
    out: list[list[float]] = []
    for sec in sorted(slots):
        vals = sorted(slots[sec])
        out.append([sec, len(vals), round(vals[len(vals) // 2] / 1e6, 1), round(vals[-1] / 1e6, 1)])
    return out


async def _end_state(dsn: str, failing_topic: str, topic: str) -> dict[str, Any]:
    """Where the failing rows are after the quiet window, and the healthy rows left."""
    async with connection(dsn) as conn:
        row = await conn.fetchrow(
            "SELECT count(*) FILTER (WHERE topic = $1) AS failing_left, "
            "count(*) FILTER (WHERE topic = $1 AND attempts > 0) AS failing_tried, "
            "coalesce(max(attempts) FILTER (WHERE topic = $1), 0) AS max_attempts, "
            "count(*) FILTER (WHERE topic = $2 AND published_at IS NULL) AS healthy_pending "
            "FROM outbox",
            failing_topic,
            topic,
            timeout=_QUERY_TIMEOUT,
        )
        dead = await conn.fetchval("SELECT count(*) FROM outbox_dead_letter", timeout=30)
    assert row is not None
    return {**dict(row), "dead_letters": int(dead)}


def _empty_claims(quiet: dict[str, Any]) -> int | None:
    """Claims of a quiet window that returned no row (see summarize)."""
    rate, rows, seconds = quiet.get("claims_per_s"), quiet.get("claimed_rows"), quiet["seconds"]
    if rate is None or rows is None:
        return None
    calls = round(float(rate) * float(seconds))
    return max(0, calls - (int(rows) - calls))


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Medians over rounds per (size, mode), and the relay modes' targets (issue 17): every
    healthy row within 1 s; no empty claims while the failing rows wait for their retries."""
    cfg = result["config"]
    rows: list[dict[str, Any]] = []
    targets: list[dict[str, Any]] = []
    for size in cfg["failing_rows"]:
        for mode in cfg["modes"]:
            cells = [
                c
                for c in result.get("cells", [])
                if c["failing_rows"] == size and c["mode"] == mode and "quiet" in c
            ]
            if not cells:
                continue
            h = [c["healthy"] for c in cells]
            q = [c["quiet"] for c in cells]
            row = {
                "failing_rows": size,
                "mode": mode,
                "rounds": len(cells),
                "healthy_rows": median(x["acked"] for x in h),
                **{
                    k: median(x[k] for x in h)
                    for k in (
                        "within_1s",
                        "within_timeout",
                        "received",
                        "p50",
                        "p99",
                        "max",
                        "all_arrived_after_last_commit_s",
                    )
                },
                "all_arrived_rounds": sum(
                    x["all_arrived_after_last_commit_s"] is not None for x in h
                ),
                **{
                    k: median(x.get(k) for x in q)
                    for k in (
                        "commits_per_s",
                        "xacts_per_s",
                        "statements_per_s",
                        "claims_per_s",
                        "mode_cpu_percent",
                        "db_cpu_percent",
                        "mode_log_lines",
                    )
                },
                # Claims in the quiet window that got no row, in the worst round: a claim
                # returns its rows and one last row (the next low-water mark), and a retry
                # is claimed alone, so a claim without a row is calls - (rows - calls).
                "empty_claims": max(
                    (e for e in map(_empty_claims, q) if e is not None), default=None
                ),
                "tried_after_ready_s": median(c.get("tried_after_ready_s") for c in cells),
                "tried_rounds": sum(bool(c.get("tried")) for c in cells),
            }
            rows.append(row)
            if not mode.startswith("notify"):
                continue
            n, within = row["healthy_rows"], row["within_1s"]
            if n is not None and within is not None:
                targets.append(
                    target(
                        f"{mode}, {size:,} failing rows: every healthy row within 1 s",
                        f"{within:.0f} of {n:.0f} (p99 {ms(row['p99'])}, max {ms(row['max'])})",
                        within >= n,
                    )
                )
            empty = row["empty_claims"]
            if empty is not None:
                targets.append(
                    target(
                        f"{mode}, {size:,} failing rows waiting for retries: no empty "
                        "claims (every claim in the quiet window got a row: a retry due)",
                        f"{empty} empty in the worst round; "
                        f"{opt(row['claims_per_s'], '.1f')} claims/s, "
                        f"{opt(row['statements_per_s'], '.1f')} statements/s, "
                        f"{row['commits_per_s']:.1f} commits/s",
                        empty == 0,
                    )
                )
    return {"rows": rows, "targets": targets}


def problems(result: dict[str, Any]) -> list[str]:
    """What makes a failing-head result wrong: a cell that failed, a failing topic that
    came to exist. Healthy rows the poller never delivers are its result, not a problem."""
    problems = []
    for c in result.get("cells", []):
        where = (
            f"cell {c['cell']} ({c['failing_rows']} failing, {c['mode']}, round {c['round'] + 1})"
        )
        problems += unfinished(c, where, "quiet")
        if c.get("failing_topic_exists_after"):
            problems.append(f"{where}: the failing topic exists in Kafka")
    return problems


def markdown(result: dict[str, Any], summary: dict[str, Any], plots: list[str]) -> str:
    cfg = result["config"]
    lines = [f"# notify-outbox failing head {result['run_id']}", ""]
    lines += environment_lines(result)
    auto = result.get("environment", {}).get("kafka", {}).get("broker_configs", {})
    lines += [
        f"- {' and '.join(f'{n:,}' for n in cfg['failing_rows'])} rows of "
        f"{cfg['failing_keys']} keys to a topic that does not exist (broker "
        f"auto.create.topics.enable={auto.get('auto.create.topics.enable', 'unknown')}), "
        "inserted with the mode stopped; the mode starts and tries them; then "
        f"{cfg['healthy_rows']} rows of {cfg['healthy_keys']} other keys to a healthy topic at "
        f"{cfg['healthy_rate']:g} ev/s, each timed from its commit ack to the consumer (up to "
        f"{cfg['healthy_timeout']:g} s); then a {cfg['quiet']:g} s quiet window with no new "
        f"rows; {cfg['repeat']} round(s), fresh database and topic per cell, medians over rounds",
    ]
    lines += targets_section(summary, "design/benchmarks.md")
    t = f"{cfg['healthy_timeout']:g}"
    lines += ["", "## Healthy rows behind the failing head (medians over rounds)", ""]
    lines += grid(
        summary["rows"],
        ("failing rows", lambda r: f"{r['failing_rows']:,}"),
        ("mode", lambda r: r["mode"]),
        ("within 1 s", lambda r: f"{whole(r['within_1s'])} of {whole(r['healthy_rows'])}"),
        (f"within {t} s", lambda r: f"{whole(r['within_timeout'])} of {whole(r['healthy_rows'])}"),
        ("p50 (ms)", lambda r: num(r["p50"], 1)),
        ("p99 (ms)", lambda r: num(r["p99"], 1)),
        ("max (ms)", lambda r: num(r["max"], 1)),
        (
            "all arrived, s after the last commit",
            lambda r: (
                num(r["all_arrived_after_last_commit_s"])
                + (
                    ""
                    if r["all_arrived_rounds"] == r["rounds"]
                    else f" (not all within {t} s in "
                    f"{r['rounds'] - r['all_arrived_rounds']} round(s))"
                )
            ),
        ),
        (
            "mode tried the failing rows, s after ready",
            lambda r: (
                num(r["tried_after_ready_s"])
                + ("" if r["tried_rounds"] == r["rounds"] else " (not in every round)")
            ),
        ),
    )
    lines += [
        "",
        f"## Quiet window ({cfg['quiet']:g} s, no new rows, the failing rows waiting)",
        "",
        "Commits/s from `pg_stat_database` (PostgreSQL 15 reports a backend's counts up to a "
        "second late, or ten for a backend that went idle: the window starts "
        f"{cfg.get('quiet_settle', 0):g} s after the healthy rows arrived or timed out), "
        "statements/s and claims/s (calls of the mode's claim statement) from "
        "`pg_stat_statements` (counted at once), of the mode's own database; CPU of the mode's "
        "process and of the whole PostgreSQL cluster.",
        "",
    ]
    lines += grid(
        summary["rows"],
        ("failing rows", lambda r: f"{r['failing_rows']:,}"),
        ("mode", lambda r: r["mode"]),
        ("commits/s", lambda r: num(r["commits_per_s"], 1)),
        ("transactions/s (with rollbacks)", lambda r: num(r["xacts_per_s"], 1)),
        ("statements/s", lambda r: num(r["statements_per_s"], 1)),
        ("claims/s", lambda r: num(r["claims_per_s"], 1)),
        ("mode CPU %", lambda r: num(r["mode_cpu_percent"], 1)),
        ("db CPU %", lambda r: num(r["db_cpu_percent"], 1)),
        ("mode log lines", lambda r: whole(r["mode_log_lines"])),
    )
    tops = [c for c in result.get("cells", []) if c.get("round") == 0 and "quiet" in c]
    if tops:
        lines += ["", "Statements run most in the quiet window (first round; calls, rows):", ""]
        for c in tops:
            lines.append(f"- {c['failing_rows']:,} failing, {c['mode']}:")
            lines += [
                f"  - {s['calls']} x, {s['rows']} rows: `{s['query']}`"
                for s in c["quiet"]["top_statements"][:3]
            ]
    lines += modes_section(result)
    return finish(lines, result, plots, problems(result))


def plot(result: dict[str, Any], summary: dict[str, Any], path: Path) -> bool:
    """Per failing-head size and mode: healthy rows that arrived within 1 s and within the
    timeout, and the quiet window's commits/s and statements/s (log scale)."""
    from bench.plots import mode_colors, plt  # matplotlib only when plotting

    rows, cfg = summary["rows"], result["config"]
    if not rows:
        return False
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    sizes = list(dict.fromkeys(r["failing_rows"] for r in rows))
    by = {(r["failing_rows"], r["mode"]): r for r in rows}
    colors = mode_colors(modes)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    width = 0.8 / max(1, len(modes))
    for i, mode in enumerate(modes):
        xs = [j + i * width for j in range(len(sizes))]
        got = [by.get((s, mode), {}) for s in sizes]
        axes[0].bar(
            xs,
            [g.get("within_timeout") or 0 for g in got],
            width,
            color=colors[mode],
            alpha=0.35,
            label=f"{mode}: within {cfg['healthy_timeout']:g} s",
        )
        axes[0].bar(
            xs,
            [g.get("within_1s") or 0 for g in got],
            width,
            color=colors[mode],
            label=f"{mode}: within 1 s",
        )
        for k, (key, hatch) in enumerate((("commits_per_s", ""), ("statements_per_s", "//"))):
            axes[1].bar(
                [x + k * width / 2 for x in xs],
                [max(g.get(key) or 0.0, 0.01) for g in got],
                width / 2,
                color=colors[mode],
                hatch=hatch,
                edgecolor="white",
                label=f"{mode}: {key.replace('_per_s', '/s')}",
            )
    for ax in axes:
        ax.set_xticks([j + width * (len(modes) - 1) / 2 for j in range(len(sizes))])
        ax.set_xticklabels([f"{s:,} failing rows" for s in sizes])
        ax.legend(fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].axhline(cfg["healthy_rows"], color="grey", linewidth=0.8)
    axes[0].set_ylabel(f"healthy rows arrived (of {cfg['healthy_rows']})")
    axes[1].set_yscale("log")
    axes[1].set_ylabel(f"per second, {cfg['quiet']:g} s quiet window")
    fig.suptitle("Failing head: healthy rows behind it, and the database's work meanwhile")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


REGIME = Regime.of(__name__, _FailingHead.main, "## Targets", "## Healthy rows", "## Quiet window")
