"""The lifecycle shared by devstack's server processes (Kafka, PgBouncer, Redis, Prometheus).

A ``Daemon`` is a server started in its own session (a Ctrl-C aimed at the tests must not
reach it), possibly as another OS user, whose pid may be kept in a JSON state file so that
another process constructing the same service controls the same server. Stopping is SIGTERM,
then SIGKILL after a timeout; killing is SIGKILL, as a crash would.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, ClassVar, TypedDict

from devstack._common import StackError, cmdline, pid_alive, read_json, tail, write_json

__all__ = ["Daemon", "NotReady", "RunAs", "alive", "run_as", "spawn", "wait_ready"]

# After SIGKILL (or when stop gives up on SIGTERM), how long to wait for the exit.
_KILL_WAIT_S = 10.0


class RunAs(TypedDict):
    """The ``subprocess`` arguments that run a program as ``user`` (or as ourselves)."""

    user: int | None
    group: int | None
    extra_groups: list[int] | None


def run_as(user: pwd.struct_passwd | None) -> RunAs:
    """``user=``/``group=``/``extra_groups=`` for ``subprocess``: ``user`` and only its group."""
    if user is None:
        return RunAs(user=None, group=None, extra_groups=None)
    return RunAs(user=user.pw_uid, group=user.pw_gid, extra_groups=[])


def spawn(
    argv: Sequence[str],
    *,
    cwd: Path,
    stdout: IO[Any] | int,
    user: pwd.struct_passwd | None = None,
) -> subprocess.Popen[bytes]:
    """Start a server in its own session with stdin closed and stdout+stderr to ``stdout``.

    StackError (naming the program) if it cannot be executed.
    """
    try:
        return subprocess.Popen(
            argv,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=subprocess.STDOUT,
            # Own session: a Ctrl-C or a signal to the test's process group must
            # not take the server down behind the fixture's back.
            start_new_session=True,
            **run_as(user),
        )
    except OSError as exc:
        raise StackError(f"could not run {argv[0]}: {exc}") from exc


@dataclass(frozen=True)
class NotReady:
    """Why ``wait_ready`` gave up: the process exited (``code``) or the deadline passed."""

    code: int | None
    last_error: str


def wait_ready(
    proc: subprocess.Popen[bytes],
    probe: Callable[[], str | None],
    *,
    deadline: float,
    interval: float,
) -> NotReady | None:
    """Poll ``probe`` (None: ready, else what is still missing) until ``deadline``.

    Returns None once ready, or why not: the process exited, or time ran out.
    """
    last_error = "no answer yet"
    while True:
        code = proc.poll()
        if code is not None:
            return NotReady(code, last_error)
        problem = probe()
        if problem is None:
            return None
        last_error = problem
        if time.monotonic() >= deadline:
            return NotReady(None, last_error)
        time.sleep(interval)


def alive(pid: int) -> bool:
    """Like pid_alive, but also true while any thread of the process still runs.

    A multithreaded server (pgbouncer with c-ares, a JVM) can have a zombie main
    thread while the process still holds its listening socket.
    """
    if pid_alive(pid):
        return True
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return False
    for task in tasks:
        with contextlib.suppress(OSError):
            if (task / "stat").read_text().rsplit(")", 1)[-1].split()[0] not in ("Z", "X"):
                return True
    return False


class Daemon:
    """Base of a server process: its pid, SIGTERM/SIGKILL and the wait for its exit.

    A subclass with a state file sets ``_state_path`` and overrides ``_state``
    (what is saved besides the pid) and ``_owns`` (whether a pid read back from
    the file still runs our server: pids are reused). Without a state file only
    the process this object started is known. ``_wait_ready`` needs ``_probe``
    (is it serving yet?) and ``_not_started`` (the first half of the error).
    """

    log_path: Path
    _proc: subprocess.Popen[bytes] | None = None
    _state_path: Path | None = None
    # How often to look whether a process that is not our child has exited.
    _exit_poll_s: ClassVar[float] = 0.05

    @property
    def pid(self) -> int | None:
        """Pid of the running server (started by any process, if it has a state file), or None."""
        if self._proc is not None:
            if self._proc.poll() is None:
                return self._proc.pid
            self._proc = None
        if self._state_path is None:
            return None
        pid = read_json(self._state_path).get("pid")
        if not isinstance(pid, int) or not pid_alive(pid):
            return None
        return pid if self._owns(cmdline(pid)) else None

    def kill(self) -> None:
        """Kill the server with SIGKILL, as a crash would."""
        pid = self.pid
        if pid is None:
            return
        self._signal(pid, signal.SIGKILL)
        self._wait_exit(pid, _KILL_WAIT_S)
        self._forget()

    def _terminate(self, timeout: float) -> None:
        """SIGTERM, then SIGKILL if the server is still there after ``timeout`` seconds."""
        pid = self.pid
        if pid is None:
            return
        self._signal(pid, signal.SIGTERM)
        if not self._wait_exit(pid, timeout):
            self._signal(pid, signal.SIGKILL)
            self._wait_exit(pid, _KILL_WAIT_S)
        self._forget()

    def _wait_ready(self, deadline: float, timeout: float, interval: float) -> None:
        """Wait until ``_probe`` says ready; else StackError with ``_not_started`` and the log."""
        assert self._proc is not None
        failure = wait_ready(self._proc, self._probe, deadline=deadline, interval=interval)
        if failure is not None:
            raise StackError(
                f"{self._not_started(failure, timeout)}, see {self.log_path} "
                f"(last lines:\n{tail(self.log_path)})"
            )

    def _probe(self) -> str | None:
        """None once the server serves, else what is still missing."""
        raise NotImplementedError

    def _not_started(self, failure: NotReady, timeout: float) -> str:
        """What went wrong at start, for the error that ``_wait_ready`` raises."""
        raise NotImplementedError

    def _forget(self) -> None:
        self._proc = None
        if self._state_path is not None:
            self._save_state(pid=None)

    def _owns(self, argv: list[str]) -> bool:
        """Whether the process with this argv is our server."""
        return False

    def _state(self) -> dict[str, Any]:
        """What the state file keeps besides the pid (ports, ids...)."""
        return {}

    def _save_state(self, *, pid: int | None) -> None:
        assert self._state_path is not None
        self._state_path.parent.mkdir(parents=True, exist_ok=True)
        write_json(self._state_path, {**self._state(), "pid": pid})

    def _signal(self, pid: int, sig: signal.Signals) -> None:
        # Gone already is fine. A server running as another user is still ours to
        # signal: we are root then (that is why it runs as another user).
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)

    def _wait_exit(self, pid: int, timeout: float) -> bool:
        if self._proc is not None and self._proc.pid == pid:
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                return False
            return True
        deadline = time.monotonic() + timeout
        # Not our child (started by another process): poll until it is gone.
        while alive(pid):
            if time.monotonic() >= deadline:
                return False
            time.sleep(self._exit_poll_s)
        return True
