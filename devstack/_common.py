"""Helpers shared by devstack's service wrappers."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import pwd
import shutil
import socket
import stat
import subprocess
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

CACHE_DIR_ENV = "NOTIFY_OUTBOX_CACHE_DIR"
# PostgreSQL and PgBouncer both refuse to run as root, so as root they run as this account.
SERVICE_USER = "postgres"

_log = logging.getLogger("devstack")


def cache_root() -> Path:
    """Root of devstack's persistent cache: $NOTIFY_OUTBOX_CACHE_DIR or ~/.cache/notify-outbox."""
    root = os.environ.get(CACHE_DIR_ENV)
    return Path(root) if root else Path.home() / ".cache" / "notify-outbox"


class StackError(RuntimeError):
    """A local service could not be set up; the message says what to do about it."""


def free_ports(count: int, *, avoid: Iterable[int] = ()) -> list[int]:
    """Return ``count`` distinct loopback ports that were free a moment ago."""
    # All sockets stay bound until every port is picked, so the kernel cannot
    # hand out the same port twice within one call.
    sockets: list[socket.socket] = []
    ports: list[int] = []
    skip = set(avoid)
    try:
        while len(ports) < count:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
            if port not in skip:
                ports.append(port)
    finally:
        for sock in sockets:
            sock.close()
    return ports


def read_json(path: Path) -> dict[str, Any]:
    """Read a JSON object, or return ``{}`` if the file is missing or unreadable."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write a JSON object atomically, so a concurrent reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def tail(path: Path, lines: int = 30) -> str:
    """Return the last ``lines`` lines of a text file (empty if it does not exist)."""
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 64 * 1024))
            data = fh.read()
    except OSError:
        return ""
    return "\n".join(data.decode("utf-8", "replace").splitlines()[-lines:])


def pid_alive(pid: int) -> bool:
    """Tell whether a process with this pid exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    # The state letter follows the parenthesised command name, which may
    # itself contain spaces or parentheses.
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def cmdline(pid: int) -> list[str]:
    """Return the argv of a running process, or ``[]`` if it cannot be read."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode("utf-8", "replace") for part in raw.split(b"\0") if part]


def service_user(program: str) -> pwd.struct_passwd | None:
    """The account ``program`` must run as: None (the current user) unless we are root."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam(SERVICE_USER)
    except KeyError:
        raise StackError(
            f"running as root, and {program} refuses to run as root, but there is no "
            f"{SERVICE_USER!r} user to run it as: create it (useradd --system {SERVICE_USER}) "
            "or run as an unprivileged user"
        ) from None


def grant_search(directory: Path, user: pwd.struct_passwd, target: Path) -> None:
    """Let ``user`` traverse ``directory`` and its parents on the way to ``target``."""
    # Root-owned private dirs (pytest's /tmp/pytest-of-root, mkdtemp results)
    # would keep the service user from reaching its files. Adding only the
    # search bit lets it traverse them without being able to list them.
    groups = set(os.getgrouplist(user.pw_name, user.pw_gid))
    for path in (directory, *directory.parents):
        st = path.stat()
        if st.st_uid == user.pw_uid:
            needed = stat.S_IXUSR
        elif st.st_gid in groups:
            needed = stat.S_IXGRP
        else:
            needed = stat.S_IXOTH
        if not st.st_mode & needed:
            _log.warning(
                "granting search permission on %s so the %s user can reach %s",
                path,
                user.pw_name,
                target,
            )
            os.chmod(path, stat.S_IMODE(st.st_mode) | needed)


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive flock on ``path`` (created with its parents if missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def run_logged(
    argv: Sequence[str],
    log: IO[Any],
    *,
    timeout: float,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[bytes]:
    """Run a tool to completion, stdin closed, its output into the open file ``log``.

    Its exit code is the caller's to check; ``subprocess.TimeoutExpired`` after ``timeout``.
    """
    return subprocess.run(
        argv,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        timeout=timeout,
        check=False,
    )


def apt_install(
    package: str,
    *,
    find: Callable[[], Path | None],
    stop_service: Callable[[], None],
    timeout: float,
) -> Path | None:
    """Install Debian's ``package`` with apt-get (as root), stop the service it started,
    and return ``find()``, the binary wanted from it.

    Serialised by a lock in the cache (two test sessions must not both run dpkg), and
    skipped if ``find()`` succeeds once the lock is held. Output goes to
    ``apt-<package>.log`` in the cache; a failure is a StackError showing its last lines.
    """
    home = cache_root()
    log_path = home / f"apt-{package}.log"
    with locked(home / f"{package}-install.lock"):
        found = find()
        if found is not None:
            return found
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        steps = [
            ["apt-get", "update"],
            [
                "apt-get",
                "install",
                "-y",
                "--no-install-recommends",
                # Another apt run (unattended upgrades) holds the lock for a while at most.
                "-o",
                "DPkg::Lock::Timeout=300",
                package,
            ],
        ]
        _log.warning("%s is missing: installing Debian's package (log: %s)", package, log_path)
        with log_path.open("w") as log:
            for argv in steps:
                try:
                    result = run_logged(argv, log, env=env, timeout=timeout)
                except subprocess.TimeoutExpired:
                    raise StackError(
                        f"`{' '.join(argv)}` did not finish within {timeout:.0f}s, see {log_path}"
                    ) from None
                except OSError as exc:
                    raise StackError(f"`{' '.join(argv)}` failed: {exc}") from exc
                if result.returncode != 0:
                    raise StackError(
                        f"`{' '.join(argv)}` failed (exit {result.returncode}) while installing "
                        f"{package}, see {log_path} (last lines:\n{tail(log_path)})"
                    )
        stop_service()
        return find()


def maven_copy(artifact: str, staging: Path, log_path: Path, *, what: str, timeout: float) -> Path:
    """Fetch one Maven Central ``artifact`` (``group:name:version[:type[:classifier]]``)
    into ``staging`` with ``mvn dependency:copy`` and return the file. ``what`` names it in
    the errors (a StackError that says what to install or where the log is)."""
    mvn = shutil.which("mvn")
    if mvn is None:
        raise StackError(
            f"mvn not found: install Maven 3 (apt-get install maven); it fetches {what} "
            f"({artifact}) from Maven Central once"
        )
    cmd = [mvn, "-q", "-B", "dependency:copy", f"-Dartifact={artifact}"]
    cmd.append(f"-DoutputDirectory={staging}")
    try:
        with log_path.open("w") as log:
            result = run_logged(cmd, log, cwd=staging, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise StackError(
            f"Maven did not fetch {what} within {timeout:.0f}s, see {log_path}"
        ) from None
    if result.returncode != 0:
        raise StackError(
            f"Maven could not fetch {what} ({artifact}, exit {result.returncode}); check the "
            f"version and access to Maven Central, see {log_path} (last lines:\n"
            f"{tail(log_path)})"
        )
    parts = artifact.split(":")
    name, version = parts[1], parts[2]
    kind = parts[3] if len(parts) > 3 else "jar"
    classifier = f"-{parts[4]}" if len(parts) > 4 else ""
    found = staging / f"{name}-{version}{classifier}.{kind}"
    if not found.is_file():
        raise StackError(f"Maven finished but {found} is missing, see {log_path}")
    return found
