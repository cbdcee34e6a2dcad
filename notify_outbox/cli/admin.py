"""The operators' part of the command line: ``dead-letters list|show|requeue|purge`` and
``replay``. The work is done by ``pg/deadletters.py`` and ``ops/replay.py``; this module
parses, prints and picks exit codes (those of ``app.py``: 0 done, 1 something was not done,
2 bad usage).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

import asyncpg

from notify_outbox.core.errors import ConfigurationError, NotifyOutboxError
from notify_outbox.core.names import OutboxNames
from notify_outbox.core.settings import DatabaseSettings, OutboxSettings
from notify_outbox.core.timespec import format_duration, parse_duration, parse_time
from notify_outbox.ops.replay import NothingToReplay, ReplayReport, replay
from notify_outbox.pg.deadletters import (
    DeadLetter,
    DeadLetterFilter,
    count_dead_letters,
    get_dead_letter,
    list_dead_letters,
    purge,
    requeue,
)
from notify_outbox.pg.sqlfiles import Queries

from .each import for_names, for_outboxes
from .flags import add_all_schemas_flag, add_db_flags, load_settings_from_flags

__all__ = [
    "add_admin_commands",
    "print_requeue",
    "print_status",
    "run_admin_command",
    "wants_admin",
]

Connect = Callable[[DatabaseSettings], Awaitable[asyncpg.Connection]]
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
_COMMANDS = ("dead-letters", "replay")
_COUNT_LIMIT = 100_000
_ERROR_WIDTH = 60


def _filter_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--topic", help="only dead letters of this topic")
    p.add_argument("--key", help="only dead letters with this key (exact)")
    p.add_argument("--error", help="only dead letters whose error contains this text (any case)")
    p.add_argument("--since", help="dead-lettered at or after: ISO-8601 time, or 2h / 7d ago")
    p.add_argument("--until", help="dead-lettered before: ISO-8601 time, or 2h / 7d ago")


def add_admin_commands(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """Register ``dead-letters`` (with its actions) and ``replay``."""
    p = sub.add_parser(
        "dead-letters", parents=[common], help="list, show, requeue or purge dead letters"
    )
    actions = p.add_subparsers(dest="dl_action", required=True, metavar="ACTION")

    a = actions.add_parser(
        "list", parents=[common], help="dead letters in id order, as a table or JSON lines"
    )
    add_db_flags(a, channel=False)
    add_all_schemas_flag(a)
    _filter_flags(a)
    a.add_argument("--after-id", type=int, default=0, help="only ids after this (paging)")
    a.add_argument("--limit", type=int, default=50, help="at most this many (0: all; 50)")
    a.add_argument(
        "--format", choices=["table", "json"], default="table", help="json: one object a line"
    )

    a = actions.add_parser("show", parents=[common], help="one dead letter in full")
    add_db_flags(a, channel=False)
    a.add_argument("id", type=int, help="dead-letter id (as `list` shows it)")
    a.add_argument(
        "--format", choices=["text", "json"], default="text", help="json: one JSON object"
    )

    a = actions.add_parser(
        "requeue",
        parents=[common],
        help="move dead letters back into the outbox, each at the end of its key's order",
    )
    add_db_flags(a, channel=False)
    a.add_argument("ids", nargs="*", type=int, help="dead-letter ids (or use filters)")
    add_all_schemas_flag(a)
    _filter_flags(a)
    a.add_argument("--all", action="store_true", help="every dead letter (no id or filter)")
    a.add_argument("--dry-run", action="store_true", help="print what would move, move nothing")

    a = actions.add_parser("purge", parents=[common], help="delete old dead letters for good")
    add_db_flags(a, channel=False)
    a.add_argument(
        "--older-than", required=True, help="dead-lettered longer ago than: 30d, 12h, P7D"
    )
    add_all_schemas_flag(a)
    _filter_flags(a)
    a.add_argument("--dry-run", action="store_true", help="count what would go, delete nothing")

    p = sub.add_parser(
        "replay",
        parents=[common],
        help="send kept published rows of a topic to Kafka again (keep_published)",
    )
    add_db_flags(p, channel=False)
    add_all_schemas_flag(p)
    p.add_argument("--kafka-bootstrap-servers", help="[NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS]")
    p.add_argument("--topic", required=True, help="the topic to replay")
    p.add_argument(
        "--since", required=True, help="published at or after: ISO-8601 time, or 2h / 7d ago"
    )
    p.add_argument("--until", help="published before: ISO-8601 time, or 2h / 7d ago (now)")
    p.add_argument("--batch-size", type=int, help="rows per send [NOTIFY_OUTBOX_BATCH_SIZE]")
    p.add_argument("--dry-run", action="store_true", help="count what would be sent, send nothing")


def wants_admin(args: argparse.Namespace) -> bool:
    """Whether the parsed command is one of this module's."""
    return bool(args.command in _COMMANDS)


def _time(flag: str, value: str | None) -> datetime | None:
    if value is None:
        return None
    try:
        return parse_time(value)
    except ValueError as e:
        raise ConfigurationError(f"{flag}: {e}") from None


def _filter(args: argparse.Namespace) -> DeadLetterFilter:
    older = getattr(args, "older_than", None)
    try:
        older_than = None if older is None else parse_duration(older)
    except ValueError as e:
        raise ConfigurationError(f"--older-than: {e}") from None
    ids = getattr(args, "ids", None) or None
    return DeadLetterFilter(
        ids=ids,
        topic=args.topic,
        key=args.key,
        error=args.error,
        since=_time("--since", args.since),
        until=_time("--until", args.until),
        older_than=older_than,
    )


def run_admin_command(args: argparse.Namespace, connect: Connect) -> int:
    """Run a ``dead-letters`` or ``replay`` command; returns the exit code. Raises
    ConfigurationError (exit 2) on bad usage or settings."""
    db_overrides = {
        "dsn": args.dsn,
        "db_schema": args.db_schema,
        "table": args.table,
        "connect_timeout": args.connect_timeout,
    }
    if args.command == "replay":
        since = _time("--since", args.since)
        until = _time("--until", args.until)
        assert since is not None
        if until is not None and until <= since:
            raise ConfigurationError("--until must be after --since")
        settings = load_settings_from_flags(
            OutboxSettings,
            **db_overrides,
            kafka_bootstrap_servers=args.kafka_bootstrap_servers,
            batch_size=args.batch_size,
        )
        all_schemas = bool(getattr(args, "all_schemas", False))

        async def replay_one(_: asyncpg.Connection, names: OutboxNames) -> int:
            # A replay opens its own connection (and producer) per outbox.
            return await _replay(
                for_names(settings, names),
                connect,
                args.topic,
                since,
                until,
                args.dry_run,
                nothing_fails=False,
            )

        if not all_schemas:
            return asyncio.run(_replay(settings, connect, args.topic, since, until, args.dry_run))
        return asyncio.run(for_outboxes(connect, settings, True, replay_one))
    action = args.dl_action
    if action in ("list", "requeue", "purge"):
        where = _filter(args)  # bad times are usage errors: before connecting
    if action == "list" and args.limit < 0:
        raise ConfigurationError("--limit must be 0 (all) or more")
    if action == "requeue" and where.empty and not args.all:
        raise ConfigurationError(
            "requeue what? give dead-letter ids, a filter (--topic, --key, --error, --since, "
            "--until) or --all"
        )
    if action == "requeue" and args.all and not where.empty:
        raise ConfigurationError("--all cannot be combined with ids or filters")
    db = load_settings_from_flags(DatabaseSettings, **db_overrides)

    async def one(conn: asyncpg.Connection, names: OutboxNames) -> int:
        if action == "list":
            return await _list(conn, names, where, args.after_id, args.limit, args.format)
        if action == "show":
            return await _show(conn, db, args.id, args.format)
        if action == "requeue":
            return await print_requeue(conn, names, where, dry_run=args.dry_run)
        return await _purge(conn, names, where, args.dry_run)

    return asyncio.run(for_outboxes(connect, db, bool(getattr(args, "all_schemas", False)), one))


# --- status and dead letters ------------------------------------------------------------------


async def print_status(conn: asyncpg.Connection, names: OutboxNames, limit: int) -> int:
    """``status``: one JSON object of counts, each counted up to ``limit`` (bounded work on
    any table); ``capped`` names the counts that reached it (there are at least that many)."""
    row = await conn.fetchrow(Queries(names)["stats"], limit)
    doc: dict[str, object] = dict(row) if row is not None else {}
    counts = ("pending", "retrying", "held_back", "published_kept", "dead_lettered")
    doc["count_limit"] = limit
    doc["capped"] = [k for k in counts if isinstance(doc.get(k), int) and doc[k] == limit]
    print(json.dumps(doc))
    return EXIT_OK


def _utc(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


def _clip(text: str | None, width: int) -> str:
    one_line = " ".join((text or "").split())
    return one_line if len(one_line) <= width else one_line[: width - 1] + "…"


def _table(rows: list[DeadLetter]) -> list[str]:
    header = ["ID", "DEAD-LETTERED (UTC)", "TOPIC", "KEY", "ATTEMPTS", "ERROR"]
    cells = [
        [
            str(d.id),
            _utc(d.dead_lettered_at),
            _clip(d.topic, 30),
            _clip(d.key if d.key is not None else "-", 24),
            str(d.attempts),
            _clip(d.error, _ERROR_WIDTH),
        ]
        for d in rows
    ]
    widths = [max(len(r[i]) for r in [header, *cells]) for i in range(len(header))]
    right = {0, 4}  # numbers line up on the right

    def line(r: list[str]) -> str:
        parts = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    return [line(header), *(line(r) for r in cells)]


async def _list(
    conn: asyncpg.Connection,
    names: OutboxNames,
    where: DeadLetterFilter,
    after_id: int,
    limit: int,
    fmt: str,
) -> int:
    # One more than asked says whether more match.
    want = None if limit == 0 else limit + 1
    rows = [d async for d in list_dead_letters(conn, names, where, after_id=after_id, limit=want)]
    more = want is not None and len(rows) > limit
    rows = rows[:limit] if more else rows
    if fmt == "json":
        for d in rows:
            print(json.dumps(d.to_json(), ensure_ascii=False))
        return EXIT_OK
    if not rows:
        print(
            "no dead letters match"
            if after_id == 0
            else f"no dead letters match after id {after_id}"
        )
        return EXIT_OK
    for text in _table(rows):
        print(text)
    total = await count_dead_letters(conn, names, where, limit=_COUNT_LIMIT)
    of = f"more than {_COUNT_LIMIT}" if total >= _COUNT_LIMIT else str(total)
    tail = f"; next page: --after-id {rows[-1].id}" if more else ""
    print(f"{len(rows)} shown of {of} matching{tail}")
    return EXIT_OK


def _show_text(d: DeadLetter) -> list[str]:
    lines = [
        f"dead letter {d.id}",
        f"  event id:         {d.event_id}",
        f"  topic:            {d.topic}",
        f"  key:              {d.key if d.key is not None else '(none)'}",
    ]
    for label, value in (
        ("event type", d.event_type),
        ("aggregate type", d.aggregate_type),
        ("aggregate id", d.aggregate_id),
        ("idempotency key", d.idempotency_key),
    ):
        if value is not None:
            lines.append(f"  {label + ':':<18}{value}")
    lines += [
        f"  created at:       {_utc(d.created_at)} UTC",
        f"  dead-lettered at: {_utc(d.dead_lettered_at)} UTC, after {d.attempts} attempt"
        + ("s" if d.attempts != 1 else ""),
        f"  error:            {d.error}",
        f"  headers:          {d.headers if d.headers is not None else '(none)'}",
    ]
    if d.payload_bytes is not None:
        lines.append(f"  payload:          {len(d.payload_bytes)} bytes (payload_bytes)")
    elif d.payload is not None:
        pretty = json.dumps(json.loads(d.payload), indent=2, ensure_ascii=False)
        lines.append("  payload:          " + pretty.replace("\n", "\n" + " " * 20))
    else:
        lines.append("  payload:          (none: a tombstone)")
    return lines


async def _show(conn: asyncpg.Connection, db: DatabaseSettings, dead_id: int, fmt: str) -> int:
    dead = await get_dead_letter(conn, db.names, dead_id)
    if dead is None:
        print(f"notify-outbox: no dead letter with id {dead_id}", file=sys.stderr)
        return EXIT_FAILED
    if fmt == "json":
        print(json.dumps(dead.to_json(), ensure_ascii=False, indent=2))
    else:
        print("\n".join(_show_text(dead)))
    return EXIT_OK


def _about(topic: str, key: str | None, event_id: str) -> str:
    return f"topic {topic}, key {key if key is not None else '(none)'}, event {event_id}"


async def print_requeue(
    conn: asyncpg.Connection, names: OutboxNames, where: DeadLetterFilter, *, dry_run: bool
) -> int:
    """Requeue (``requeue``), print a line per dead letter and a summary; the exit code."""
    results = await requeue(conn, names, where, dry_run=dry_run)
    moved = skipped = 0
    for r in results:
        if r.skipped is not None:
            skipped += 1
            print(f"skipped dead letter {r.dead_letter_id}: {r.skipped}")
        elif dry_run:
            moved += 1
            print(
                f"would requeue dead letter {r.dead_letter_id} "
                f"({_about(r.topic, r.key, r.event_id)})"
            )
        else:
            moved += 1
            print(
                f"requeued dead letter {r.dead_letter_id} as outbox row {r.outbox_id} "
                f"({_about(r.topic, r.key, r.event_id)})"
            )
    if not results:
        print("no dead letters match: nothing to requeue")
        return EXIT_OK
    noun = "dead letter" if moved == 1 else "dead letters"
    if dry_run:
        print(f"dry run: {moved} {noun} would be requeued; nothing changed")
    else:
        print(f"requeued {moved} {noun}" + (f"; {skipped} skipped" if skipped else ""))
    return EXIT_FAILED if skipped else EXIT_OK


async def _purge(
    conn: asyncpg.Connection,
    names: OutboxNames,
    where: DeadLetterFilter,
    dry_run: bool,
) -> int:
    assert where.older_than is not None
    n = await purge(conn, names, where, dry_run=dry_run)
    age = format_duration(where.older_than.total_seconds())
    noun = "dead letter" if n == 1 else "dead letters"
    if dry_run:
        print(
            f"dry run: {n} {noun} dead-lettered more than {age} ago would be purged; "
            "nothing changed"
        )
    else:
        print(f"purged {n} {noun} dead-lettered more than {age} ago")
    return EXIT_OK


# --- replay -----------------------------------------------------------------------------------


def _when(t: datetime) -> str:
    return t.astimezone(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


async def _replay(
    settings: OutboxSettings,
    connect: Connect,
    topic: str,
    since: datetime,
    until: datetime | None,
    dry_run: bool,
    *,
    nothing_fails: bool = True,
) -> int:
    """``replay``; with ``nothing_fails`` False (one outbox of several), an outbox with no
    row to replay says so and is not a failure."""
    conn = await connect(settings)
    try:
        try:
            report = await replay(
                conn,
                settings,
                topic=topic,
                since=since,
                until=until,
                dry_run=dry_run,
                progress=_Progress(),
            )
        except ValueError as e:
            raise ConfigurationError(str(e)) from None
        except NothingToReplay as e:
            if nothing_fails:
                print(f"notify-outbox: {e}", file=sys.stderr)
                return EXIT_FAILED
            print(e)
            return EXIT_OK
        except NotifyOutboxError as e:  # Kafka out of reach
            print(f"notify-outbox: {e}", file=sys.stderr)
            return EXIT_FAILED
    finally:
        await conn.close()
    return _replay_summary(report)


class _Progress:
    """A progress line on stderr (stdout holds the result only), at most one a second."""

    def __init__(self) -> None:
        self._last = time.monotonic()

    def __call__(self, report: ReplayReport) -> None:
        now = time.monotonic()
        if now - self._last >= 1.0:
            self._last = now
            print(f"  {report.sent} of {report.matched} rows sent", file=sys.stderr)


def _replay_summary(report: ReplayReport) -> int:
    what = (
        f"{report.matched} rows of topic {report.topic} published from {_when(report.since)} "
        f"to {_when(report.until)} (ids {report.first_id}..{report.last_id})"
    )
    if report.partial:
        print(f"notify-outbox: warning: {report.partial}", file=sys.stderr)
    if report.dry_run:
        print(f"dry run: {what} would be sent again; nothing sent")
        return EXIT_OK
    if report.failed:
        first_id, reason = report.failed[0]
        print(
            f"replay stopped: {report.sent} of {what} sent; row {first_id} was not: {reason}. "
            "Run it again once fixed (consumers drop repeats by event id)",
            file=sys.stderr,
        )
        return EXIT_FAILED
    gone = report.matched - report.sent
    note = f"; {gone} were deleted by retention meanwhile" if gone else ""
    print(f"replayed {report.sent} of {what}, with their event ids{note}")
    return EXIT_OK
