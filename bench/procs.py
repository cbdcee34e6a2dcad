"""Child processes of the bench: start, readiness, CPU time and a bounded stop (their
environment comes from ``devstack.relayproc``, shared with the tests and the demo).

Every child gets ``PR_SET_PDEATHSIG`` (SIGTERM), so nothing outlives a bench that was killed,
and every wait here has a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import re
import signal
import sys
import time
from collections.abc import Coroutine, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, TypeVar

_T = TypeVar("_T")

ROOT = Path(__file__).resolve().parent.parent
_PR_SET_PDEATHSIG = 1
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class BenchError(RuntimeError):
    """The bench itself failed (not a slow relay): the message says what and where."""


def _die_with_parent() -> None:  # pragma: no cover - runs in the forked child
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except OSError:
        pass


def run_async(coro: Coroutine[Any, Any, _T]) -> _T:
    """Run ``coro`` on uvloop where it exists (as the relay's CLI does), else on asyncio."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop comes with notify-outbox
        return asyncio.run(coro)
    result: _T = uvloop.run(coro)
    return result


def python_argv(*args: str) -> list[str]:
    """``python <args>`` with the interpreter running the bench."""
    return [sys.executable, *args]


def _stat(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (None if it is gone): the
    state (field 3 of proc(5)) is index 0, the parent pid index 1, utime and stime 11 and 12,
    the reaped children's cutime and cstime 13 and 14."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (0.0 if it is gone)."""
    fields = _stat(pid)
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK if fields else 0.0


def parent_pid(pid: int) -> int | None:
    """The parent of a process (None if it is gone or not visible here)."""
    fields = _stat(pid)
    return int(fields[1]) if fields else None


def cluster_cpu_seconds(root: int) -> float | None:
    """User + system CPU seconds of a process tree one level deep, such as a PostgreSQL
    cluster: the postmaster ``root``, every live child (backends and background processes),
    and the children it has already reaped (its cutime and cstime), so the sum never drops
    when a backend exits. None if ``root`` is gone."""
    fields = _stat(root)
    if fields is None:
        return None
    ticks = sum(int(fields[i]) for i in (11, 12, 13, 14))
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        child = _stat(entry.name)
        if child is not None and child[1] == str(root):
            ticks += int(child[11]) + int(child[12])
    return ticks / _CLK_TCK


def tcp_ports(pid: int) -> set[int]:
    """The local ports of the TCP sockets process ``pid`` has open (IPv4 and IPv6), from
    ``/proc``: a client's port is what ``pg_stat_activity.client_port`` shows for its session.
    Empty if the process is gone or not visible here."""
    inodes: set[str] = set()
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return set()
    for fd in fds:
        with contextlib.suppress(OSError):
            link = os.readlink(fd)
            if link.startswith("socket:["):
                inodes.add(link[len("socket:[") : -1])
    ports: set[int] = set()
    for table in ("tcp", "tcp6"):
        try:
            rows = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()  # sl, local address:port (hex), remote, state, ..., inode (10th)
            if len(f) > 9 and f[9] in inodes:
                ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return ports


class Child:
    """One child process with its stderr (and, unless piped, stdout) in ``log_path``."""

    def __init__(self, name: str, proc: asyncio.subprocess.Process, log_path: Path) -> None:
        self.name = name
        self.proc = proc
        self.log_path = log_path

    @classmethod
    async def start(
        cls,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        log_path: Path,
        pipes: bool = False,
        cwd: Path | None = None,
    ) -> Child:
        """Start ``argv``; with ``pipes`` its stdin and stdout are pipes (a line protocol)."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log: IO[bytes] = log_path.open("ab")
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                env=dict(env),
                cwd=str(cwd or ROOT),
                stdin=asyncio.subprocess.PIPE if pipes else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE if pipes else log,
                stderr=log,
                preexec_fn=_die_with_parent,
            )
        finally:
            log.close()
        return cls(name, proc, log_path)

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self.proc.pid

    def running(self) -> bool:
        """Whether the child has not exited yet."""
        return self.proc.returncode is None

    def cpu(self) -> float:
        """CPU seconds used so far."""
        return cpu_seconds(self.proc.pid)

    def log_lines(self) -> int:
        """The lines written to the process's log so far (0 if it cannot be read)."""
        try:
            with self.log_path.open("rb") as fh:
                return sum(1 for _ in fh)
        except OSError:
            return 0

    def tail(self, lines: int = 25) -> str:
        """The last lines of the child's log."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    async def wait_for_log(self, pattern: str, within: float) -> None:
        """Wait until a line of the log matches ``pattern``; BenchError on exit or timeout."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + within
        while True:
            with contextlib.suppress(OSError):
                if regex.search(self.log_path.read_text(errors="replace")):
                    return
            if not self.running():
                raise BenchError(
                    f"{self.name} exited ({self.proc.returncode}) before logging {pattern!r}; "
                    f"{self.log_path}:\n{self.tail()}"
                )
            if time.monotonic() > deadline:
                raise BenchError(
                    f"{self.name} did not log {pattern!r} within {within:.0f}s; "
                    f"{self.log_path}:\n{self.tail()}"
                )
            await asyncio.sleep(0.05)

    async def send_line(self, line: str) -> None:
        """Write one line to the child's stdin (``pipes=True``)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        await self.proc.stdin.drain()

    async def read_line(self, within: float) -> str:
        """Read one line of the child's stdout (``pipes=True``); BenchError on EOF/timeout."""
        assert self.proc.stdout is not None
        try:
            raw = await asyncio.wait_for(self.proc.stdout.readline(), within)
        except TimeoutError:
            raise BenchError(
                f"{self.name} did not answer within {within:.0f}s; {self.log_path}:\n{self.tail()}"
            ) from None
        if not raw:
            await self.wait(5.0)
            raise BenchError(
                f"{self.name} exited ({self.proc.returncode}); {self.log_path}:\n{self.tail()}"
            )
        return raw.decode().strip()

    async def wait(self, within: float) -> int | None:
        """Wait for the exit; the exit code, or None if it is still running at the deadline."""
        try:
            return await asyncio.wait_for(self.proc.wait(), within)
        except TimeoutError:
            return None

    async def stop(self, grace: float = 30.0) -> int | None:
        """SIGTERM, wait up to ``grace`` seconds, then SIGKILL. Returns the exit code."""
        if self.running():
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            code = await self.wait(grace)
            if code is not None:
                return code
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            await self.wait(10.0)
        return self.proc.returncode
