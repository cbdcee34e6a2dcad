"""A throwaway Redis server for the inbox's fast-path tests (``notify_outbox.inbox.RedisSeen``).

It runs Debian's ``redis-server`` binary, installing the package with apt when it is missing
and we are root. The package's own service is stopped (its server on :6379 belongs to nobody
here); each ``RedisServer`` runs its own instance on a free loopback port, without
persistence, as an unprivileged user (the same account as PostgreSQL when we are root).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from devstack._common import StackError, apt_install, free_ports, grant_search, service_user
from devstack._daemon import Daemon, NotReady, spawn

__all__ = ["RedisServer", "find_redis_server"]

_log = logging.getLogger(__name__)

REDIS_SERVER_ENV = "NOTIFY_OUTBOX_REDIS_SERVER"
_PACKAGE = "redis-server"
_PACKAGED_PORT = 6379
_START_TIMEOUT_S = 30.0
_APT_TIMEOUT_S = 600


def find_redis_server(*, install: bool = True) -> Path:
    """The ``redis-server`` binary: ``$NOTIFY_OUTBOX_REDIS_SERVER``, on PATH, or installed
    now from Debian's package (as root, when ``install``)."""
    override = os.environ.get(REDIS_SERVER_ENV)
    if override:
        if not Path(override).is_file():
            raise StackError(f"{REDIS_SERVER_ENV}={override} is not a file")
        return Path(override)
    found = _installed()
    if found is not None:
        return found
    if install and os.geteuid() == 0 and shutil.which("apt-get"):
        found = apt_install(
            _PACKAGE, find=_installed, stop_service=_stop_packaged_service, timeout=_APT_TIMEOUT_S
        )
        if found is not None:
            return found
    raise StackError(
        "redis-server not found: install Debian's package (apt-get install redis-server), "
        f"or set {REDIS_SERVER_ENV} to a redis-server binary"
    )


def _installed() -> Path | None:
    found = shutil.which("redis-server") or (
        "/usr/bin/redis-server" if Path("/usr/bin/redis-server").is_file() else None
    )
    return Path(found) if found else None


def _stop_packaged_service() -> None:
    # Where an init system runs, the package's postinst starts a server on :6379 and enables
    # it at boot. Tests never use it: stop and disable it, so no stray server lingers.
    for argv in (["service", _PACKAGE, "stop"], ["update-rc.d", _PACKAGE, "disable"]):
        if shutil.which(argv[0]):
            subprocess.run(argv, capture_output=True, timeout=60, check=False)
    if _ping("127.0.0.1", _PACKAGED_PORT):
        _log.warning(
            "a Redis server still answers on :%d after stopping the %s service; it is not "
            "ours and is left alone",
            _PACKAGED_PORT,
            _PACKAGE,
        )


def _ping(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer(Daemon):
    """One Redis instance on 127.0.0.1 under ``base_dir`` (log and working directory), without
    persistence: a restart starts empty, like a Redis that lost its data."""

    def __init__(self, base_dir: Path, *, port: int | None = None) -> None:
        self.base_dir = Path(base_dir).resolve()
        self.port = port if port is not None else free_ports(1)[0]
        self.log_path = self.base_dir / "redis.log"
        self._proc = None

    def __repr__(self) -> str:
        return f"RedisServer(base_dir={str(self.base_dir)!r}, port={self.port})"

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    def is_running(self) -> bool:
        """Whether the server process is alive."""
        return self.pid is not None

    def start(self) -> None:
        """Start the server and wait until it answers PING."""
        if self.is_running():
            return
        binary = find_redis_server()
        user = service_user("redis-server")
        self.base_dir.mkdir(parents=True, exist_ok=True)
        self.log_path.touch(exist_ok=True)
        if user is not None:
            for path in (self.base_dir, self.log_path):
                os.chown(path, user.pw_uid, user.pw_gid)
            grant_search(self.base_dir, user, self.base_dir)
        argv = [
            str(binary),
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--dir", str(self.base_dir),
            "--logfile", str(self.log_path),
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
        ]  # fmt: skip
        # Its log goes to --logfile; stdout and stderr are not needed.
        self._proc = spawn(argv, cwd=self.base_dir, stdout=subprocess.DEVNULL, user=user)
        try:
            self._wait_ready(time.monotonic() + _START_TIMEOUT_S, _START_TIMEOUT_S, interval=0.02)
        except BaseException:
            self.kill()
            raise

    def _probe(self) -> str | None:
        return None if _ping("127.0.0.1", self.port) else "no PONG"

    def _not_started(self, failure: NotReady, timeout: float) -> str:
        return f"Redis did not start on 127.0.0.1:{self.port}"

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s)."""
        self._terminate(10.0)

    def kill(self) -> None:
        """SIGKILL the server, as a crash: its data is gone."""
        super().kill()
