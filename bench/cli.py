"""The command line: ``python -m bench run | smoke | drain | recovery | held-snapshot |
failing-head | stalled-relay | inbox | report``.

Exit codes: 0 done; 1 the bench itself broke (a process failed, events went missing at a light
load, a smoke check failed); 2 bad usage.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any

from bench.config import (
    DEFAULT_MODES,
    MODES,
    VARIANTS,
    RunConfig,
    add_alt_modes,
    full_config,
    quick_config,
    smoke_config,
)
from bench.procs import ROOT, BenchError
from bench.revs import compare_tree, with_alt_modes

__all__ = ["main"]

DEFAULT_OUT = ROOT / "bench" / "results"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="Latency and throughput of notify-outbox vs plain polling, side by side.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("run", help="the full bench (about 20 minutes; --quick: a few)")
    p.add_argument("--quick", action="store_true", help="every phase, small and short")
    p.add_argument(
        "--modes",
        nargs="+",
        help=f"default: {' '.join(DEFAULT_MODES)}; all: {' '.join(MODES)} (and *-alt)",
    )
    alt = p.add_mutually_exclusive_group()
    alt.add_argument(
        "--alt-relay",
        type=Path,
        help="a copy of the source tree with a proposed relay change: adds the modes "
        "notify-alt, relay-poll-alt, ... (run from that tree) for A/B runs",
    )
    _compare_rev_option(alt)
    p.add_argument("--loads", nargs="+", type=float, help="offered loads, events/s")
    p.add_argument("--no-extend", action="store_true", help="do not raise loads past the list")
    p.add_argument("--duration", type=float, help="measured seconds per cell")
    p.add_argument("--warmup", type=float, help="warm-up seconds per cell")
    p.add_argument("--repeat", type=int, help="repetitions of every cell (medians reported)")
    p.add_argument("--writers", type=int, help="writer connections (default: by load)")
    p.add_argument(
        "--tx-events",
        type=int,
        help="latency cells: up to N already-due events per producing transaction "
        "(default 1: single-row transactions; more measures relay throughput past the "
        "machine's commit rate)",
    )
    p.add_argument("--idle-seconds", type=float, help="length of the idle measurement")
    p.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), help="trigger variants")
    p.add_argument("--producer-writers", nargs="+", type=int, help="e.g. 1 4 16")
    p.add_argument("--producer-seconds", type=float, help="seconds per producer cell")
    p.add_argument("--variant-load", type=float, help="load of the Poisson/enqueue cells")
    p.add_argument("--variant-modes", nargs="*", help="modes with those cells")
    p.add_argument("--fsync-seconds", type=int, help="pg_test_fsync -s N (0: skip)")
    p.add_argument("--profile", action="store_true", help="py-spy the relay at the variant load")
    p.add_argument(
        "--stages",
        action="store_true",
        help="relay modes write a stage log (NOTIFY_OUTBOX_STAGE_LOG); the report breaks each "
        "event's commit ack -> receipt into the relay's stages",
    )
    p.add_argument(
        "--skip",
        nargs="+",
        default=[],
        choices=["idle", "latency", "producer"],
        help="leave phases out (for development; a full result has all three)",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default: {DEFAULT_OUT}")
    p.add_argument("--keep-work-dir", action="store_true", help="keep logs and the stack dir")
    p.add_argument("--no-plots", action="store_true")

    p = sub.add_parser("smoke", help="a few seconds of every phase; fails only if the bench breaks")
    p.add_argument("--out", type=Path, help="default: a new temporary directory")
    p.add_argument("--keep-work-dir", action="store_true")

    p = sub.add_parser("drain", help="backlog drain: events/s emptying a pre-filled outbox")
    p.add_argument("--rows", type=int, default=100_000, help="rows per cell (default 100000)")
    p.add_argument("--mixes", nargs="+", help="key mixes (default: keys-1000 keys-100000 hot null)")
    p.add_argument(
        "--modes",
        nargs="+",
        help="relay-N (N relay processes), relay-N-alt (with --alt-relay), "
        "relay-N[-alt]-pgbouncer (through a transaction-pooling PgBouncer), poller "
        "(default: relay-1 relay-2 relay-4 poller)",
    )
    p.add_argument("--repeat", type=int, default=1, help="rounds (modes interleaved; medians)")
    _phase_options(p)
    p.add_argument("--cell-timeout", type=float, help="seconds (default 60 + rows/500)")
    p.add_argument(
        "--profile",
        action="store_true",
        help="py-spy the first process of each mode in the first round; the report lists "
        "the functions with the most own time",
    )

    p = sub.add_parser("recovery", help="outage recovery: Kafka and PostgreSQL restarts")
    p.add_argument("--repeat", type=int, default=5, help="restarts per service (default 5)")
    p.add_argument(
        "--services",
        nargs="+",
        choices=["kafka", "postgres"],
        default=["kafka", "postgres"],
        help="what to restart, in this order",
    )
    p.add_argument("--pause", type=float, default=2.0, help="seconds between stop and start")
    p.add_argument("--rate", type=float, default=200.0, help="writers' events/s (keyed)")
    p.add_argument("--settle", type=float, default=5.0, help="steady seconds between restarts")
    p.add_argument(
        "--recover-timeout", type=float, default=90.0, help="per restart, seconds to catch up"
    )
    p.add_argument(
        "--stack-dir",
        type=Path,
        help="restart this running devstack stack (DIR/postgres, DIR/kafka) instead of "
        "starting one",
    )
    _phase_options(p)

    p = sub.add_parser(
        "held-snapshot",
        help="steady load while another session holds a REPEATABLE READ snapshot open",
    )
    p.add_argument("--rate", type=float, default=800.0, help="writers' events/s (default 800)")
    p.add_argument("--keys", type=int, default=40, help="distinct keys (default 40)")
    p.add_argument("--baseline", type=float, default=60.0, help="seconds before the snapshot")
    p.add_argument(
        "--hold", type=float, default=600.0, help="seconds the snapshot is held (default 600)"
    )
    p.add_argument("--recovery", type=float, default=60.0, help="seconds after the rollback")
    p.add_argument("--window", type=float, default=30.0, help="seconds per report window")
    p.add_argument(
        "--warmup",
        type=float,
        default=60.0,
        help="seconds of unmeasured load through the relay before the first cell, so that no "
        "mode meets a cold stack (default 60; 0: none)",
    )
    _regime_options(p)
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=120.0,
        help="after the load, seconds to wait for every committed event",
    )
    _phase_options(p)

    p = sub.add_parser(
        "failing-head",
        help="healthy rows behind thousands of rows whose topic does not exist",
    )
    p.add_argument(
        "--failing-rows",
        nargs="+",
        type=int,
        default=[5000, 100_000],
        help="sizes of the failing head (default 5000 100000)",
    )
    p.add_argument("--failing-keys", type=int, default=5, help="keys of the failing rows")
    p.add_argument("--healthy-rows", type=int, default=300, help="healthy rows (default 300)")
    p.add_argument("--healthy-keys", type=int, default=30, help="their keys (default 30)")
    p.add_argument("--healthy-rate", type=float, default=100.0, help="their events/s")
    p.add_argument(
        "--healthy-timeout", type=float, default=60.0, help="seconds a healthy row may take"
    )
    p.add_argument("--quiet", type=float, default=20.0, help="seconds of the quiet window")
    p.add_argument(
        "--quiet-settle",
        type=float,
        default=11.0,
        help="seconds before the quiet window, for PostgreSQL's delayed statistics",
    )
    p.add_argument(
        "--tried-timeout",
        type=float,
        default=60.0,
        help="seconds to wait for the mode to try the failing rows",
    )
    _regime_options(p)
    _phase_options(p)

    p = sub.add_parser(
        "stalled-relay",
        help="two relays under steady load, one of them frozen (SIGSTOP) again and again",
    )
    p.add_argument("--rate", type=float, default=1200.0, help="writers' events/s (default 1200)")
    p.add_argument(
        "--keys",
        nargs="+",
        type=int,
        default=[20, 5000],
        help="key mixes: distinct keys (default 20 5000)",
    )
    p.add_argument(
        "--notify-modes",
        nargs="+",
        choices=["gated", "always"],
        default=["gated", "always"],
        help="the outbox's notify_mode per cell (default gated always)",
    )
    p.add_argument("--relays", type=int, default=2, help="relay processes (default 2)")
    p.add_argument(
        "--warmup", type=float, default=2.0, help="seconds of load before the baseline (default 2)"
    )
    p.add_argument("--baseline", type=float, default=20.0, help="seconds before the 1st freeze")
    p.add_argument("--freezes", type=int, default=6, help="freezes per cell (default 6)")
    p.add_argument("--freeze", type=float, default=6.0, help="seconds per freeze (default 6)")
    p.add_argument("--gap", type=float, default=6.0, help="seconds between freezes (default 6)")
    p.add_argument("--recovery", type=float, default=10.0, help="seconds after the last freeze")
    p.add_argument(
        "--pick",
        choices=["marker", "alternate"],
        default="marker",
        help="which relay to freeze: the one holding the awake marker (else in turn; default), "
        "or always in turn",
    )
    p.add_argument("--repeat", type=int, default=3, help="rounds (cells interleaved; medians)")
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=120.0,
        help="after the load, seconds to wait for every committed event",
    )
    _phase_options(p)

    p = sub.add_parser(
        "inbox",
        help="consumer side: a backlog drained through the inbox (per message, batch path, "
        "the simple batched baseline), msg/s",
    )
    p.add_argument("--messages", type=int, default=20_000, help="backlog size (default 20000)")
    p.add_argument("--partitions", type=int, default=4, help="topic partitions (default 4)")
    p.add_argument(
        "--modes",
        nargs="+",
        choices=["apply", "consume", "consume_batches", "consume_batches_parallel", "baseline"],
        help="default: all five (apply consume consume_batches consume_batches_parallel baseline)",
    )
    p.add_argument("--repeat", type=int, default=3, help="rounds (modes interleaved; medians)")
    p.add_argument("--max-records", type=int, default=500, help="getmany max_records")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default: {DEFAULT_OUT}")
    p.add_argument("--keep-work-dir", action="store_true", help="keep logs and the stack dir")
    p.add_argument("--no-plots", action="store_true")

    p = sub.add_parser("report", help="regenerate the markdown (and plots) of a result JSON")
    p.add_argument("json", type=Path)
    p.add_argument("--no-plots", action="store_true")
    return parser


def _phase_options(p: argparse.ArgumentParser) -> None:
    """The options the drain and recovery phases share."""
    p.add_argument(
        "--relay-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting of the relay processes, e.g. workers=8 or NOTIFY_OUTBOX_BATCH_SIZE=500 "
        "(repeatable)",
    )
    alt = p.add_mutually_exclusive_group()
    alt.add_argument(
        "--alt-relay",
        type=Path,
        help="a copy of the source tree with a proposed relay change (drain: modes "
        "relay-N-alt; held-snapshot, failing-head: notify-alt; recovery, stalled-relay: runs "
        "that relay instead)",
    )
    _compare_rev_option(alt)
    p.add_argument("--fsync-seconds", type=int, default=0, help="pg_test_fsync -s N (0: skip)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default: {DEFAULT_OUT}")
    p.add_argument("--keep-work-dir", action="store_true", help="keep logs and the stack dir")
    p.add_argument("--no-plots", action="store_true")


def _compare_rev_option(group: argparse._MutuallyExclusiveGroup) -> None:
    group.add_argument(
        "--compare-rev",
        metavar="REV",
        help="a git revision (main, HEAD~1, a hash): checked out as a detached worktree for "
        "this run and run as --alt-relay runs a tree; adds the -alt counterpart of every "
        "selected relay mode unless an -alt mode is named",
    )


def _regime_options(p: argparse.ArgumentParser) -> None:
    """The options the held-snapshot and failing-head regimes share."""
    p.add_argument(
        "--modes",
        nargs="+",
        default=["notify", "poller"],
        help="notify, notify-alt (with --alt-relay), poller (default: notify poller)",
    )
    p.add_argument("--repeat", type=int, default=1, help="rounds (modes interleaved; medians)")


def _alt_tree(path: Path | None) -> str | None:
    if path is None:
        return None
    tree = path.resolve()
    if not (tree / "notify_outbox" / "__main__.py").is_file():
        raise BenchError(f"relay tree {tree}: no notify_outbox/ package there")
    return str(tree)


def _run_phase(args: argparse.Namespace) -> int:
    """``drain``, ``recovery``, ``held-snapshot``, ``failing-head`` or ``stalled-relay``: run,
    write the report; exit 1 when a check failed (lost events, order violations, a timed-out
    cell, a cell that broke), not when the relay was merely slow."""
    from bench.catalog import REGIMES
    from bench.drain import (
        DEFAULT_MIXES,
        DEFAULT_MODES,
        MIXES,
        DrainConfig,
        alt_drain_mode,
        parse_mode,
        parse_relay_env,
        run_drain,
    )
    from bench.procs import run_async
    from bench.recovery import RecoveryConfig, run_recovery

    relay_env = parse_relay_env(args.relay_env)
    alt = _alt_tree(args.alt_relay)
    out: Path = args.out
    coro: Coroutine[Any, Any, Path]
    if args.command == "drain":
        mixes = list(dict.fromkeys(args.mixes or DEFAULT_MIXES))
        unknown = [m for m in mixes if m not in MIXES]
        if unknown:
            raise BenchError(f"unknown key mix(es) {unknown}; known: {sorted(MIXES)}")
        modes = list(dict.fromkeys(args.modes or DEFAULT_MODES))
        if args.alt_revision:
            modes = with_alt_modes(modes, alt_drain_mode)
        for m in modes:
            parse_mode(m, alt)  # fails early on a bad name
        if args.rows < 1 or args.repeat < 1:
            raise BenchError("--rows and --repeat must be at least 1")
        dcfg = DrainConfig(
            rows=args.rows,
            mixes=mixes,
            modes=modes,
            repeat=args.repeat,
            relay_env=relay_env,
            alt_relay=alt,
            alt_revision=args.alt_revision,
            cell_timeout=args.cell_timeout or 0.0,
            fsync_test_seconds=args.fsync_seconds,
            profile=args.profile,
        )
        coro = run_drain(dcfg, out, keep=args.keep_work_dir)
    elif args.command in ("held-snapshot", "failing-head"):
        coro = _regime(args, relay_env, alt)
    elif args.command == "stalled-relay":
        coro = _stalled(args, relay_env, alt)
    else:
        rcfg = RecoveryConfig(
            services=list(dict.fromkeys(args.services)),
            repeat=args.repeat,
            pause=args.pause,
            rate=args.rate,
            settle=args.settle,
            recover_timeout=args.recover_timeout,
            relay_env=relay_env,
            alt_relay=alt,
            alt_revision=args.alt_revision,
            stack_dir=str(args.stack_dir.resolve()) if args.stack_dir else None,
            fsync_test_seconds=args.fsync_seconds,
        )
        coro = run_recovery(rcfg, out, keep=args.keep_work_dir)
    regime = REGIMES[args.command]
    stem = regime.name
    started = time.time()
    try:
        run_async(coro)
    finally:
        # The run writes its JSON even when it fails half-way; only this run's counts.
        written = sorted(
            (p for p in out.glob(f"{stem}-*.json") if p.stat().st_mtime >= started - 1),
            key=lambda p: p.stat().st_mtime,
        )
        if written:
            md = regime.write_report(written[-1], plots=not args.no_plots)
            print(f"result: {written[-1]}\nreport: {md}", file=sys.stderr)
    problems = regime.problems(json.loads(written[-1].read_text())) if written else ["no result"]
    if written:
        for line in regime.terminal_lines(json.loads(written[-1].read_text())):
            print(line, file=sys.stderr)
    for p in problems:
        print(f"bench {stem}: {p}", file=sys.stderr)
    return 1 if problems else 0


def _regime(
    args: argparse.Namespace, relay_env: dict[str, str], alt: str | None
) -> Coroutine[Any, Any, Path]:
    """The run of ``held-snapshot`` or ``failing-head``."""
    from bench.failing_head import FailingHeadConfig, run_failing_head
    from bench.held_snapshot import HeldSnapshotConfig, run_held_snapshot
    from bench.regimes import regime_mode

    modes = list(dict.fromkeys(args.modes))
    if args.alt_revision:
        modes = with_alt_modes(modes, lambda m: "notify-alt" if m == "notify" else None)
    for m in modes:
        regime_mode(m, alt)  # fails early on a bad name
    if args.repeat < 1:
        raise BenchError("--repeat must be at least 1")
    common = {
        "modes": modes,
        "repeat": args.repeat,
        "relay_env": relay_env,
        "alt_relay": alt,
        "alt_revision": args.alt_revision,
        "fsync_test_seconds": args.fsync_seconds,
    }
    if args.command == "held-snapshot":
        if min(args.baseline, args.hold, args.recovery, args.window) <= 0 or args.rate <= 0:
            raise BenchError("--rate, --baseline, --hold, --recovery and --window must be > 0")
        if args.warmup < 0:
            raise BenchError("--warmup must be >= 0")
        hcfg = HeldSnapshotConfig(
            rate=args.rate,
            keys=args.keys,
            baseline=args.baseline,
            hold=args.hold,
            recovery=args.recovery,
            window=args.window,
            warmup=args.warmup,
            drain_timeout=args.drain_timeout,
            **common,
        )
        return run_held_snapshot(hcfg, args.out, keep=args.keep_work_dir)
    if min(args.failing_rows) < 1 or args.healthy_rows < 1 or args.healthy_rate <= 0:
        raise BenchError("--failing-rows, --healthy-rows and --healthy-rate must be positive")
    fcfg = FailingHeadConfig(
        failing_rows=list(dict.fromkeys(args.failing_rows)),
        failing_keys=args.failing_keys,
        healthy_rows=args.healthy_rows,
        healthy_keys=args.healthy_keys,
        healthy_rate=args.healthy_rate,
        healthy_timeout=args.healthy_timeout,
        quiet=args.quiet,
        quiet_settle=args.quiet_settle,
        tried_timeout=args.tried_timeout,
        **common,
    )
    return run_failing_head(fcfg, args.out, keep=args.keep_work_dir)


def _stalled(
    args: argparse.Namespace, relay_env: dict[str, str], alt: str | None
) -> Coroutine[Any, Any, Path]:
    """The run of ``stalled-relay``."""
    from bench.stalled_relay import StalledRelayConfig, run_stalled_relay

    if args.repeat < 1 or args.freezes < 1 or args.relays < 2 or min(args.keys) < 1:
        raise BenchError("--repeat, --freezes and --keys must be at least 1, --relays at least 2")
    if min(args.freeze, args.rate, args.baseline) <= 0:
        raise BenchError("--freeze, --baseline and --rate must be > 0")
    if min(args.warmup, args.gap, args.recovery) < 0:
        raise BenchError("--warmup, --gap and --recovery must be >= 0")
    scfg = StalledRelayConfig(
        rate=args.rate,
        keys=list(dict.fromkeys(args.keys)),
        notify_modes=list(dict.fromkeys(args.notify_modes)),
        relays=args.relays,
        warmup=args.warmup,
        baseline=args.baseline,
        freezes=args.freezes,
        freeze=args.freeze,
        gap=args.gap,
        recovery=args.recovery,
        pick=args.pick,
        repeat=args.repeat,
        drain_timeout=args.drain_timeout,
        relay_env=relay_env,
        alt_relay=alt,
        alt_revision=args.alt_revision,
        fsync_test_seconds=args.fsync_seconds,
    )
    return run_stalled_relay(scfg, args.out, keep=args.keep_work_dir)


def _run_inbox(args: argparse.Namespace) -> int:
    """``inbox``: run, write the report; exit 1 when a cell applied a message twice or
    missed one."""
    from bench.inbox import MODES as INBOX_MODES
    from bench.inbox import REGIME, InboxBenchConfig, run_inbox_bench
    from bench.procs import run_async

    if args.messages < 1 or args.repeat < 1 or args.partitions < 1 or args.max_records < 1:
        raise BenchError("--messages, --partitions, --repeat and --max-records must be >= 1")
    cfg = InboxBenchConfig(
        messages=args.messages,
        partitions=args.partitions,
        modes=list(dict.fromkeys(args.modes or INBOX_MODES)),
        repeat=args.repeat,
        max_records=args.max_records,
    )
    path = run_async(run_inbox_bench(cfg, args.out, keep=args.keep_work_dir))
    md = REGIME.write_report(path, plots=not args.no_plots)
    print(f"result: {path}\nreport: {md}", file=sys.stderr)
    problems = REGIME.problems(json.loads(path.read_text()))
    for p in problems:
        print(f"bench inbox: {p}", file=sys.stderr)
    return 1 if problems else 0


def _apply(cfg: RunConfig, args: argparse.Namespace) -> RunConfig:
    cfg.alt_relay = _alt_tree(args.alt_relay)
    cfg.alt_revision = args.alt_revision
    if cfg.alt_relay is not None:
        add_alt_modes(cfg.alt_relay)
    unknown = [m for m in args.modes or [] if m not in MODES]
    if unknown:
        raise BenchError(f"unknown mode(s) {unknown}; known: {sorted(MODES)}")
    if args.modes:
        cfg.modes = list(dict.fromkeys(args.modes))
    if args.loads:
        cfg.loads = sorted(args.loads)
    if args.no_extend:
        cfg.extend_loads = False
    for flag, attr in (
        ("duration", "duration"),
        ("warmup", "warmup"),
        ("repeat", "repeat"),
        ("writers", "writers"),
        ("tx_events", "tx_events"),
        ("idle_seconds", "idle_seconds"),
        ("producer_seconds", "producer_seconds"),
        ("variant_load", "variant_load"),
        ("fsync_seconds", "fsync_test_seconds"),
    ):
        value = getattr(args, flag)
        if value is not None:
            setattr(cfg, attr, value)
    if args.repeat is not None:
        cfg.producer_repeat = args.repeat
    if args.variants:
        cfg.variants = list(dict.fromkeys(args.variants))
    if args.producer_writers:
        cfg.producer_writers = args.producer_writers
    if args.variant_modes is not None:
        cfg.variant_modes = [m for m in args.variant_modes if m in cfg.modes]
    cfg.variant_modes = [m for m in cfg.variant_modes if m in cfg.modes]
    if cfg.alt_revision:
        # The compared revision beside every relay mode (and its variant cells), interleaved.
        def alt_of(m: str) -> str | None:
            return f"{m}-alt" if f"{m}-alt" in MODES else None

        cfg.modes = with_alt_modes(cfg.modes, alt_of)
        cfg.variant_modes = with_alt_modes(cfg.variant_modes, alt_of)
    cfg.profile = args.profile
    cfg.stages = args.stages
    cfg.skip = list(args.skip)
    return cfg


def _run(cfg: RunConfig, out: Path, *, keep: bool, plots: bool) -> Path:
    from bench.report import floor_lines, write_run_report
    from bench.runner import Runner

    runner = Runner(cfg, out, keep_work_dir=keep)
    try:
        path = asyncio.run(runner.run())
    finally:
        written = out / f"{runner.run_id}.json"
        if written.exists():
            md = write_run_report(written, plots=plots)
            for line in floor_lines(json.loads(written.read_text())):
                print(line, file=sys.stderr)
            print(f"result: {written}\nreport: {md}", file=sys.stderr)
    return path


def _check_smoke(path: Path, cfg: RunConfig) -> list[str]:
    """What a smoke run must have produced."""
    result = json.loads(path.read_text())
    problems = []
    for mode in cfg.modes:
        cells = [c for c in result["latency_cells"] if c["mode"] == mode]
        if not cells:
            problems.append(f"no latency cell for mode {mode}")
        for c in cells:
            if c["missing"] or c["unsent"] or c["failed"] or not c["events"]:
                problems.append(
                    f"mode {mode} cell {c['cell']}: {c['events']} events, {c['missing']} "
                    f"missing, {c['unsent']} unsent, {c['failed']} failed"
                )
            if cfg.stages and MODES[mode].kind == "relay" and "stage_log" not in c:
                problems.append(f"mode {mode} cell {c['cell']}: no stage-log record")
        if MODES[mode].kind != "floor" and not any(i["mode"] == mode for i in result["idle"]):
            problems.append(f"no idle measurement for mode {mode}")
    for v in cfg.variants:
        if not any(p["variant"] == v and p["commits"] > 0 for p in result["producer_cells"]):
            problems.append(f"no producer-overhead cell with commits for variant {v}")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m bench``; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # The bench's own child processes (not for people): dispatched before argparse.
    if argv and argv[0] == "_loadgen":
        from bench import loadgen

        return loadgen.main(argv[1:])
    if argv and argv[0] == "_consumer":
        from bench import consumer

        return consumer.main(argv[1:])
    if argv and argv[0] == "_poller":
        from bench import poller

        return poller.main(argv[1:])
    if argv and argv[0] == "_freezer":
        from bench import freezer

        return freezer.main(argv[1:])
    if argv and argv[0] == "_tally":
        from bench import tally

        return tally.main(argv[1:])
    args = _parser().parse_args(argv)
    try:
        if args.command == "report":
            from bench.catalog import write_report

            print(write_report(args.json, plots=not args.no_plots))
            return 0
        if args.command == "inbox":
            return _run_inbox(args)
        if args.command == "smoke":
            cfg = smoke_config()
            out = args.out or Path(tempfile.mkdtemp(prefix="notify-outbox-bench-smoke-"))
            path = _run(cfg, out, keep=args.keep_work_dir, plots=True)
            problems = _check_smoke(path, cfg)
            for p in problems:
                print(f"smoke: {p}", file=sys.stderr)
            return 1 if problems else 0
        with compare_tree(args.compare_rev) as alt:
            args.alt_revision = alt.to_json() if alt else None
            if alt is not None:
                args.alt_relay = alt.tree
                print(
                    f"bench: --compare-rev {alt.ref}: {alt.revision} “{alt.subject}” in {alt.tree}",
                    file=sys.stderr,
                )
            if args.command != "run":
                return _run_phase(args)
            cfg = _apply(quick_config() if args.quick else full_config(), args)
            _run(cfg, args.out, keep=args.keep_work_dir, plots=not args.no_plots)
            return 0
    except BenchError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
