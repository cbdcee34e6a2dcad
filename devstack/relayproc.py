"""The relay CLI as a child process, the environment its children get, and Kafka topics.

One copy for the demo (``scripts/demo.py``), the bench (``bench/``), the examples and the tests.
It starts ``python -m notify_outbox`` as a program, so it imports nothing of notify_outbox
itself; aiokafka (a dependency of notify-outbox) is imported only by ``create_topics``.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

__all__ = [
    "READY",
    "ROOT",
    "LoggedProcess",
    "RelayError",
    "RelayProcess",
    "child_env",
    "cli_argv",
    "create_topics",
    "relay_env",
]

ROOT = Path(__file__).resolve().parent.parent
# What the relay logs once its workers run (notify_outbox/cli/app.py).
READY = "relay running"
DSN_ENV = "NOTIFY_OUTBOX_DSN"
BOOTSTRAP_ENV = "NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS"
_PREFIX = "NOTIFY_OUTBOX_"
_TOPIC_ALREADY_EXISTS = 36  # Kafka's TOPIC_ALREADY_EXISTS error code


class RelayError(RuntimeError):
    """A relay child or a topic did not do what was awaited; the message says what and shows
    the relay's last log lines."""


def child_env(**overrides: str) -> dict[str, str]:
    """Our environment without any ``NOTIFY_OUTBOX_*`` variable, plus ``overrides``.

    Stripping the family means a table or schema setting in the caller's shell cannot send a
    producer and the relay to different tables. ``PYTHONPATH`` starts with the checkout, so
    ``python -m notify_outbox`` (or ``bench``) runs this tree's code from any directory.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(_PREFIX)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(overrides)
    return env


def relay_env(dsn: str, bootstrap: str | None = None, /, **overrides: str) -> dict[str, str]:
    """``child_env`` with ``NOTIFY_OUTBOX_DSN`` (and the Kafka bootstrap servers when given);
    ``overrides`` (full variable names, such as ``NOTIFY_OUTBOX_WORKERS``) come last."""
    settings = {DSN_ENV: dsn}
    if bootstrap is not None:
        settings[BOOTSTRAP_ENV] = bootstrap
    return child_env(**{**settings, **overrides})


def cli_argv(*args: str) -> list[str]:
    """``python -m notify_outbox ARGS`` with this interpreter."""
    return [sys.executable, "-m", "notify_outbox", *args]


async def create_topics(
    bootstrap: str,
    names: Sequence[str],
    *,
    partitions: int = 3,
    configs: Mapping[str, str] | None = None,
    exist_ok: bool = False,
    within: float = 30.0,
    client: Mapping[str, Any] | None = None,
) -> None:
    """Create topics (replication factor 1, broker-side ``configs`` if given) and return once
    every partition has a leader: a consumer or producer that starts in between sees errors.
    RelayError if Kafka refuses one (an existing topic counts only without ``exist_ok``) or
    the whole does not finish within ``within`` seconds. ``client``: more admin client
    arguments (TLS, SASL) for a secured broker."""
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic
    from aiokafka.errors import KafkaError

    topic_configs = dict(configs or {})
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, **(client or {}))
    try:
        async with asyncio.timeout(within):
            await admin.start()
            response = await admin.create_topics(
                [
                    NewTopic(n, partitions, replication_factor=1, topic_configs=topic_configs)
                    for n in names
                ]
            )
            for entry in response.topic_errors:
                name, code = entry[0], entry[1]
                if code and not (exist_ok and code == _TOPIC_ALREADY_EXISTS):
                    raise RelayError(f"Kafka refused to create topic {name!r}: error code {code}")
            # Metadata has no "wait until led": ask again until every partition has a leader.
            while True:
                if _all_led(await admin.describe_topics(list(names)), names):
                    break
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise RelayError(
            f"Kafka at {bootstrap} did not create topics {list(names)} (or elect their "
            f"partition leaders) within {within:.0f}s"
        ) from None
    except KafkaError as e:
        raise RelayError(f"Kafka at {bootstrap}: cannot create topics {list(names)}: {e}") from e
    finally:
        await admin.close()


def _all_led(described: list[dict[str, object]], names: Sequence[str]) -> bool:
    ok: set[object] = set()
    for topic in described:
        parts = topic.get("partitions")
        if (
            not topic.get("error_code")
            and isinstance(parts, list)
            and parts
            and all(not p["error_code"] and p["leader"] >= 0 for p in parts)
        ):
            ok.add(topic.get("topic"))
    return ok >= set(names)


class LoggedProcess:
    """A child process whose stderr (its log) a thread reads into ``lines`` as it comes, so
    that waiting on a log line is waiting on an event from the child, with a deadline, never
    a sleep. As a context manager, the process is gone on exit (SIGKILL if still running)."""

    def __init__(
        self, argv: Sequence[str], env: Mapping[str, str], *, name: str, cwd: Path = ROOT
    ) -> None:
        self.name = name
        self.lines: list[str] = []
        self._eof = False
        self._cond = threading.Condition()
        self.proc = subprocess.Popen(
            list(argv),
            env=dict(env),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
        )
        self._reader = threading.Thread(target=self._read, name=f"{name}-log", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        # At the end of the log, by the one thread that reads it: left open, the pipe is
        # closed by the garbage collector, with a ResourceWarning.
        self.proc.stderr.close()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def matching(self, pattern: str) -> list[str]:
        """Every log line so far that matches ``pattern`` (a regular expression)."""
        regex = re.compile(pattern)
        with self._cond:
            return [line for line in self.lines if regex.search(line)]

    def wait_for_line(self, pattern: str, timeout: float = 60.0, *, count: int = 1) -> str:
        """Wait until ``count`` log lines matched ``pattern``; returns the last of them.
        RelayError if the process exits first or ``timeout`` seconds pass."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        hits: list[str] = []
        seen = 0
        with self._cond:
            while True:
                hits += (line for line in self.lines[seen:] if regex.search(line))
                seen = len(self.lines)
                if len(hits) >= count:
                    return hits[count - 1]
                left = deadline - time.monotonic()
                if self._eof:
                    problem = f"exited ({self._exit_code()}) before it logged"
                elif left <= 0:
                    problem = f"did not log within {timeout:g}s"
                else:
                    self._cond.wait(left)
                    continue
                raise RelayError(
                    f"{self.name} {problem} {pattern!r} {count} time(s) ({len(hits)} so far):\n"
                    + self.output()
                )

    def signal(self, sig: int = signal.SIGTERM) -> None:
        """Send ``sig`` to the process."""
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 60.0) -> int:
        """Wait for the exit and the end of its log; ``subprocess.TimeoutExpired`` after
        ``timeout`` seconds."""
        code = self.proc.wait(timeout)
        self._reader.join(10)
        return code

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM and wait; returns the exit code. After ``timeout`` seconds: SIGKILL and
        RelayError."""
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
        try:
            return self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.close()
            raise RelayError(
                f"{self.name} did not exit within {timeout:g}s of SIGTERM (killed):\n"
                + self.output()
            ) from None

    def close(self) -> None:
        """Make sure the process is gone: SIGKILL if it still runs."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self._reader.join(10)

    def output(self, lines: int = 60) -> str:
        """The last ``lines`` lines of the log."""
        with self._cond:
            return "\n".join(self.lines[-lines:])

    def _exit_code(self) -> int | None:
        try:
            return self.proc.wait(10)
        except subprocess.TimeoutExpired:  # stderr closed, process still there
            return None

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class RelayProcess(LoggedProcess):
    """``python -m notify_outbox run ARGS`` as a child process; ``env`` adds to (or
    overrides) ``relay_env(dsn, bootstrap)``."""

    def __init__(
        self,
        dsn: str,
        bootstrap: str,
        *args: str,
        env: Mapping[str, str] | None = None,
        name: str = "relay",
        cwd: Path = ROOT,
    ) -> None:
        super().__init__(
            cli_argv("run", *args), relay_env(dsn, bootstrap, **(env or {})), name=name, cwd=cwd
        )

    def wait_ready(self, timeout: float = 60.0) -> str:
        """Wait until the relay logs that it runs; returns that line."""
        return self.wait_for_line(READY, timeout)
