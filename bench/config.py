"""What the bench runs: the relay modes, the trigger variants of the producer-overhead cells,
the presets (full run, ``--quick``, smoke), and the command-line options the regimes share
(each regime's own are in its module)."""

from __future__ import annotations

import argparse
import math
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal, TypeVar, cast

from bench.procs import ROOT, BenchError


class JsonRecord:
    """A dataclass recorded in the result JSON as it is: ``to_json`` gives its fields."""

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready copy."""
        return asdict(cast(Any, self))


@dataclass
class PhaseConfig(JsonRecord):
    """What the configs of the regimes that run the relay share (``phase_options``)."""

    relay_env: dict[str, str] = field(default_factory=dict)
    alt_relay: str | None = None
    alt_revision: dict[str, str] | None = None  # --compare-rev: what alt_relay holds
    partitions: int = 3
    fsync_test_seconds: int = 0


@dataclass(frozen=True)
class Mode(JsonRecord):
    """One way of moving the outbox to Kafka: ``kind`` "relay" (``python -m notify_outbox
    run`` with ``args``), "poller" (the bench's plain poller) or "floor" (no process, no
    database: the load generator sends straight to Kafka). ``notify``: the NOTIFY trigger in its
    database: "shipped", "disabled", or a ``notify_mode`` of migration 0002."""

    name: str
    kind: Literal["relay", "poller", "floor"]
    description: str
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    notify: str = "shipped"
    interval: float = 0.0  # the poll interval, for the report
    cwd: str | None = None  # run from another source tree (``--alt-relay``) instead of ours
    # The process's NOTIFY_OUTBOX_DSN goes through the run's transaction-pooling PgBouncer
    # (bench/pooler.py); with ``listen_direct`` its NOTIFY_OUTBOX_LISTEN_DSN is the direct DSN.
    pgbouncer: bool = False
    listen_direct: bool = False
    # The outbox's delivery mode (migration 0007), set in its database with the relay's.
    delivery: str = "at-least-once"

    def from_tree(self, tree: str, name: str | None = None) -> Mode:
        """This mode run from another source tree (``--alt-relay``), named ``name`` (default:
        ``<name>-alt``)."""
        return replace(
            self,
            name=name or f"{self.name}-alt",
            description=f"{self.description}; relay code from {tree}",
            cwd=tree,
        )


MODES: dict[str, Mode] = {
    m.name: m
    for m in (
        Mode(
            "floor",
            "floor",
            "Kafka floor, no database: the load generator's schedule, keys and payloads, each "
            "event sent straight to the topic with the relay's producer settings (aiokafka, "
            "acks=all, idempotent, linger 0); its commit ack is the hand-over to send()",
            notify="none",
        ),
        Mode(
            "notify",
            "relay",
            "notify-outbox relay, default settings (LISTEN/NOTIFY, fallback poll 5 s)",
        ),
        Mode(
            "notify-eos",
            "relay",
            "notify-outbox relay, default settings, exactly-once delivery (Kafka transactions "
            "and a marker per batch; the consumer reads read_committed)",
            env=(("NOTIFY_OUTBOX_DELIVERY", "exactly-once"),),
            delivery="exactly-once",
        ),
        *(
            Mode(
                f"notify-eos-w{n}",
                "relay",
                f"notify-outbox relay, exactly-once delivery, {n} worker(s) (slots served at once)",
                env=(("NOTIFY_OUTBOX_DELIVERY", "exactly-once"), ("NOTIFY_OUTBOX_WORKERS", str(n))),
                delivery="exactly-once",
            )
            for n in (1, 2)
        ),
        Mode(
            "notify-pgbouncer",
            "relay",
            "notify-outbox relay, default settings, workers through a transaction-pooling "
            "PgBouncer (no statement cache), the listening connection direct "
            "(NOTIFY_OUTBOX_LISTEN_DSN)",
            pgbouncer=True,
            listen_direct=True,
        ),
        Mode(
            "notify-tuned",
            "relay",
            "notify-outbox relay, 8 workers, batch 500",
            args=("--workers", "8", "--batch-size", "500"),
        ),
        Mode(
            "notify-always",
            "relay",
            "notify-outbox relay, default settings, trigger NOTIFYs on every insert "
            "(notify_mode 'always'; needs migration 0002)",
            notify="always",
        ),
        Mode(
            "relay-poll",
            "relay",
            "notify-outbox relay in poll-only mode, --poll-interval 0.1 (notify_mode 'off', as "
            "the docs advise for poll-only deployments)",
            args=("--poll-only", "--poll-interval", "0.1"),
            notify="off",
            interval=0.1,
        ),
        Mode(
            "relay-poll-pgbouncer",
            "relay",
            "notify-outbox relay in poll-only mode, --poll-interval 0.1, notify_mode 'off', "
            "through a transaction-pooling PgBouncer (no statement cache)",
            args=("--poll-only", "--poll-interval", "0.1"),
            notify="off",
            interval=0.1,
            pgbouncer=True,
        ),
        Mode(
            "relay-poll-fast",
            "relay",
            "notify-outbox relay in poll-only mode, --poll-interval 0.002 (looks as often as "
            "an awake gated relay lingering; notify_mode 'off')",
            args=("--poll-only", "--poll-interval", "0.002"),
            notify="off",
            interval=0.002,
        ),
        Mode(
            "poll-100ms",
            "poller",
            "plain polling publisher: every 100 ms, SKIP LOCKED, batch 100, delete",
            args=("--interval", "0.1", "--batch", "100"),
            notify="disabled",
            interval=0.1,
        ),
        Mode(
            "poll-1s",
            "poller",
            "plain polling publisher: every 1 s, SKIP LOCKED, batch 100, delete",
            args=("--interval", "1.0", "--batch", "100"),
            notify="disabled",
            interval=1.0,
        ),
    )
}
DEFAULT_MODES = ("notify", "notify-always", "relay-poll", "poll-100ms", "poll-1s")
# The plain poller of the drain phase and the production-condition regimes (``poller``).
POLLER = Mode(
    "poller",
    "poller",
    "plain poller of the outbox literature: one connection, SELECT ... WHERE "
    "published_at IS NULL ORDER BY id LIMIT 200 FOR UPDATE SKIP LOCKED, pipelined "
    "idempotent acks=all sends, UPDATE ... SET published_at = now(), commit; claims "
    "again at once while batches come back full (NOTIFY trigger disabled)",
    args=("--interval", "0.1", "--batch", "200", "--mark", "update"),
    notify="disabled",
)


def add_alt_modes(tree: str) -> list[str]:
    """Register ``<mode>-alt`` for every relay mode, run from the checkout ``tree``
    (A/B runs in one run); returns the new names."""
    added = []
    for mode in [m for m in MODES.values() if m.kind == "relay" and m.cwd is None]:
        alt = mode.from_tree(tree)
        MODES[alt.name] = alt
        added.append(alt.name)
    return added


@dataclass(frozen=True)
class TriggerVariant(JsonRecord):
    """A producer-overhead setting: the NOTIFY trigger (as ``Mode.notify``) and the
    mode, if any, draining meanwhile; one entry of ``VARIANTS`` (``--variants``)."""

    name: str
    description: str
    notify: str
    drain_mode: str | None
    # Hold the gated notify's awake marker on a side connection (no relay): the trigger's
    # own cost when producers skip their NOTIFY, without any draining competing for the CPU.
    hold_awake: bool = False


VARIANTS: dict[str, TriggerVariant] = {
    v.name: v
    for v in (
        TriggerVariant("no-trigger", "NOTIFY trigger disabled, nothing draining", "disabled", None),
        TriggerVariant(
            "no-trigger+relay",
            "NOTIFY trigger disabled, relay in poll-only mode (0.1 s) draining",
            "disabled",
            "relay-poll",
        ),
        TriggerVariant(
            "no-trigger+fast-relay",
            "NOTIFY trigger disabled, relay in poll-only mode (2 ms) draining",
            "disabled",
            "relay-poll-fast",
        ),
        TriggerVariant(
            "shipped+relay", "trigger as migrated, notify relay running", "shipped", "notify"
        ),
        TriggerVariant("shipped-idle", "trigger as migrated, no relay", "shipped", None),
        TriggerVariant(
            "always+relay",
            "trigger NOTIFYs every insert (notify_mode 'always'), notify relay running",
            "always",
            "notify",
        ),
        TriggerVariant(
            "gated-awake",
            "gated NOTIFY with the awake marker held and nothing draining: the trigger's own "
            "cost while a relay is awake",
            "gated",
            None,
            hold_awake=True,
        ),
        TriggerVariant(
            "gated+relay",
            "gated NOTIFY (notify_mode 'gated'), notify relay running",
            "gated",
            "notify",
        ),
    )
}
DEFAULT_VARIANTS = (
    "no-trigger",
    "always+relay",
    "gated+relay",
    "gated-awake",
    "no-trigger+relay",
    "no-trigger+fast-relay",
    "shipped-idle",
)


def writers_for(rate: float) -> int:
    """Writer connections for an offered rate (Little's law): enough in flight for commits
    that take up to ~8 ms on a busy 2-core machine (1 per 125 ev/s, 2 to 64)."""
    return max(2, min(64, math.ceil(rate / 125)))


@dataclass
class RunConfig(JsonRecord):
    """Everything one run does; recorded in the result JSON."""

    preset: str = "full"
    modes: list[str] = field(default_factory=lambda: list(DEFAULT_MODES))
    loads: list[float] = field(default_factory=lambda: [100, 1000, 2000, 5000, 10000])
    extend_loads: bool = True  # after the list, keep raising the load (x1.5) until saturation
    max_load: float = 40000
    duration: float = 10.0
    warmup: float = 2.0
    repeat: int = 3
    drain_timeout: float = 20.0
    idle_seconds: float = 60.0
    producer_writers: list[int] = field(default_factory=lambda: [1, 4, 16])
    producer_seconds: float = 5.0
    producer_repeat: int = 3
    variants: list[str] = field(default_factory=lambda: list(DEFAULT_VARIANTS))
    # Extra latency cells at one load: Poisson arrivals, and the Python enqueue API.
    variant_load: float = 1000
    variant_modes: list[str] = field(default_factory=lambda: ["notify"])
    keys: int = 1000
    partitions: int = 3
    writers: int | None = None  # None: writers_for(rate)
    tx_events: int = 1  # latency cells: up to this many already-due events per transaction
    fsync_test_seconds: int = 2  # pg_test_fsync -s N; 0: only the short fdatasync probe
    profile: bool = False  # run the notify relay under py-spy at the variant load
    stages: bool = False  # relay modes write a stage log (NOTIFY_OUTBOX_STAGE_LOG), joined per cell
    # After each round's modes, the same writers at each load into an outbox no relay serves:
    # the database's CPU without a relay (what the relay adds is the difference).
    db_baseline: bool = True
    alt_relay: str | None = None  # the tree of the *-alt modes (--alt-relay, --compare-rev)
    alt_revision: dict[str, str] | None = None  # --compare-rev: what alt_relay holds
    skip: list[str] = field(default_factory=list)  # phases left out: idle, latency, producer
    extra: dict[str, Any] = field(default_factory=dict)


def full_config() -> RunConfig:
    """The full run: fits in about 20 minutes on a 2-core machine."""
    return RunConfig()


def quick_config() -> RunConfig:
    """``--quick``: every phase, small: a couple of minutes."""
    return RunConfig(
        preset="quick",
        loads=[100, 1000, 3000],
        extend_loads=False,
        duration=4.0,
        warmup=1.0,
        repeat=1,
        drain_timeout=15.0,
        idle_seconds=10.0,
        producer_writers=[1, 16],
        producer_seconds=2.0,
        producer_repeat=1,
        fsync_test_seconds=0,
    )


def smoke_config() -> RunConfig:
    """``smoke``: a few seconds per phase, to prove the bench works end to end."""
    return RunConfig(
        preset="smoke",
        # Plus the pooled modes (a few seconds each): proves the PgBouncer path works; and
        # the Kafka floor (the generator's own Kafka sink).
        modes=["floor", *DEFAULT_MODES, "notify-pgbouncer", "relay-poll-pgbouncer"],
        loads=[200],
        extend_loads=False,
        max_load=200,
        duration=1.5,
        warmup=0.5,
        repeat=1,
        drain_timeout=15.0,
        idle_seconds=3.0,
        producer_writers=[1, 4],
        producer_seconds=1.0,
        producer_repeat=1,
        variants=["no-trigger", "always+relay", "gated+relay", "gated-awake"],
        variant_load=200,
        fsync_test_seconds=0,
        stages=True,  # costs a read of each relay's stage log per cell
    )


# --- the command line: options the regimes share ---------------------------------------------

DEFAULT_OUT = ROOT / "bench" / "results"
_C = TypeVar("_C")


def output_options(p: argparse.ArgumentParser) -> None:
    """Where the result goes: ``--out``, ``--keep-work-dir``, ``--no-plots``."""
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default: {DEFAULT_OUT}")
    p.add_argument("--keep-work-dir", action="store_true", help="keep logs and the stack dir")
    p.add_argument("--no-plots", action="store_true")


def compare_rev_option(group: argparse._MutuallyExclusiveGroup) -> None:
    """``--compare-rev REV`` (besides ``--alt-relay`` in ``group``)."""
    group.add_argument(
        "--compare-rev",
        metavar="REV",
        help="a git revision (main, HEAD~1, a hash): checked out as a detached worktree for "
        "this run and run as --alt-relay runs a tree; adds the -alt counterpart of every "
        "selected relay mode unless an -alt mode is named. recovery and stalled-relay have no "
        "-alt mode: there the relay itself runs REV (compare with a run without the option)",
    )


def phase_options(p: argparse.ArgumentParser) -> None:
    """The options of every regime that runs the relay: its settings, another tree or
    revision of it, pg_test_fsync, and the output options."""
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
    compare_rev_option(alt)
    p.add_argument("--fsync-seconds", type=int, default=0, help="pg_test_fsync -s N (0: skip)")
    output_options(p)


def add_options(p: argparse.ArgumentParser, config: type, **helps: str | tuple[str, Any]) -> None:
    """An option ``--name-with-dashes`` per field of ``config`` named in ``helps`` (its
    help, or (help, more ``add_argument`` keywords)), with the field's default and type."""
    defaults = {
        f.name: f.default_factory() if f.default_factory is not MISSING else f.default
        for f in fields(config)
    }
    for name, h in helps.items():
        text, more = (h, {}) if isinstance(h, str) else h
        default = defaults[name]
        kw: dict[str, Any] = {"default": default, "help": text}
        if isinstance(default, list):
            kw |= {"nargs": "+", "type": type(default[0])}
        elif isinstance(default, bool):
            kw["action"] = "store_true"
        elif default is not None:
            kw["type"] = type(default)
        p.add_argument("--" + name.replace("_", "-"), **kw | more)


def regime_options(p: argparse.ArgumentParser) -> None:
    """The options the held-snapshot and failing-head regimes share."""
    p.add_argument(
        "--modes",
        nargs="+",
        default=["notify", "poller"],
        help="notify, notify-alt (with --alt-relay), poller (default: notify poller)",
    )
    p.add_argument("--repeat", type=int, default=1, help="rounds (modes interleaved; medians)")


def parse_relay_env(items: list[str]) -> dict[str, str]:
    """``KEY=VALUE`` settings for relay processes; ``workers=8`` means
    ``NOTIFY_OUTBOX_WORKERS=8``. The DSN and bootstrap servers are the bench's own."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise BenchError(f"--relay-env {item!r}: expected KEY=VALUE")
        key = key.strip().upper().replace("-", "_")
        if not key.startswith("NOTIFY_OUTBOX_"):
            key = f"NOTIFY_OUTBOX_{key}"
        if key in (
            "NOTIFY_OUTBOX_DSN",
            "NOTIFY_OUTBOX_LISTEN_DSN",
            "NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS",
        ):
            raise BenchError(f"--relay-env cannot set {key}: the bench sets it")
        out[key] = value
    return out


def alt_tree(path: Path | None) -> str | None:
    """The source tree of ``--alt-relay`` (checked: it holds a ``notify_outbox`` package)."""
    if path is None:
        return None
    tree = path.resolve()
    if not (tree / "notify_outbox" / "__main__.py").is_file():
        raise BenchError(f"relay tree {tree}: no notify_outbox/ package there")
    return str(tree)


def common_options(args: argparse.Namespace) -> dict[str, Any]:
    """The config fields that ``phase_options`` give, from the command line (none for a
    regime without them)."""
    if not hasattr(args, "relay_env"):
        return {}
    return {
        "relay_env": parse_relay_env(args.relay_env),
        "alt_relay": alt_tree(args.alt_relay),
        "alt_revision": args.alt_revision,
        "fsync_test_seconds": args.fsync_seconds,
    }


def from_args(cls: type[_C], args: argparse.Namespace, **given: Any) -> _C:
    """A regime's config from its command line: ``given``, then every field of ``cls`` that
    is an option of the same name (a list without repeats, in its order)."""
    values: dict[str, Any] = {}
    for f in fields(cls):  # type: ignore[arg-type]
        if f.name in given:
            values[f.name] = given[f.name]
        elif hasattr(args, f.name):
            v = getattr(args, f.name)
            values[f.name] = list(dict.fromkeys(v)) if isinstance(v, list) else v
    return cls(**values)
