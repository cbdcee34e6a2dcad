"""A PgBouncer in front of a PostgreSQL server, configured the way people deploy it.

The binary is Debian's ``pgbouncer`` package; when it is missing and we are
root, it is installed with apt-get (as the Kafka jars are fetched with Maven).
Each instance has its own directory, a free loopback port and one pool mode,
and runs as the same unprivileged account as the devstack PostgreSQL.
"""

from __future__ import annotations

import contextlib
import csv
import io
import logging
import os
import pwd
import shutil
import socket
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, get_args
from urllib.parse import quote

from devstack._common import (
    StackError,
    apt_install,
    cmdline,
    free_ports,
    grant_search,
    read_json,
    service_user,
)
from devstack._daemon import Daemon, NotReady, spawn

__all__ = [
    "INSTALL_COMMAND",
    "POOL_MODES",
    "PgBouncer",
    "PoolMode",
    "ensure_pgbouncer",
    "find_pgbouncer",
    "stop_packaged_service",
]

_log = logging.getLogger(__name__)

PoolMode = Literal["transaction", "session"]
POOL_MODES: tuple[PoolMode, ...] = get_args(PoolMode)
INSTALL_COMMAND = "apt-get update && apt-get install -y --no-install-recommends pgbouncer"
_APT_TIMEOUT_S = 900
_STATE_FILE = "devstack-pgbouncer.json"
_CONF_FILE = "pgbouncer.ini"
_AUTH_FILE = "userlist.txt"
# The Debian package's own instance: its config file and its default port.
_PACKAGED_CONF = "/etc/pgbouncer/pgbouncer.ini"
_PACKAGED_PORT = 6432
_ADMIN_DB = "pgbouncer"


def find_pgbouncer() -> Path | None:
    """Locate the pgbouncer binary on PATH or in /usr/sbin (Debian puts it there)."""
    on_path = shutil.which("pgbouncer")
    if on_path:
        return Path(on_path)
    sbin = Path("/usr/sbin/pgbouncer")
    return sbin if sbin.is_file() and os.access(sbin, os.X_OK) else None


def ensure_pgbouncer() -> Path:
    """Return the pgbouncer binary, installing Debian's package first if it is missing.

    Installing needs root; otherwise the StackError names the command to run.
    """
    found = find_pgbouncer()
    if found is not None:
        return found
    if os.geteuid() != 0:
        raise StackError(
            f"pgbouncer not found (looked on PATH and in /usr/sbin): install it as root "
            f"with `{INSTALL_COMMAND}`"
        )
    if shutil.which("apt-get") is None:
        raise StackError(
            "pgbouncer not found (looked on PATH and in /usr/sbin) and there is no apt-get "
            "to install Debian's package: install PgBouncer 1.18 or newer on PATH"
        )
    found = apt_install(
        "pgbouncer",
        find=find_pgbouncer,
        stop_service=stop_packaged_service,
        timeout=_APT_TIMEOUT_S,
    )
    if found is None:
        raise StackError("apt-get installed pgbouncer but no binary is on PATH or in /usr/sbin")
    return found


def _packaged_pids() -> list[int]:
    """Pids of pgbouncer processes running the package's own config."""
    pids: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        argv = cmdline(int(entry.name))
        if argv and Path(argv[0]).name == "pgbouncer" and _PACKAGED_CONF in argv:
            pids.append(int(entry.name))
    return pids


def _port_taken(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def stop_packaged_service(timeout: float = 30.0) -> None:
    """Stop the pgbouncer service the Debian package may have started.

    Our instances use their own config and free ports; the packaged one would
    only hold port 6432 and a pool nobody configured. It is stopped, not
    disabled: the machine's boot configuration is the administrator's call.
    """
    if not _packaged_pids():
        return
    if Path("/run/systemd/system").is_dir() and shutil.which("systemctl"):
        argv = ["systemctl", "stop", "pgbouncer.service"]
    else:
        argv = ["service", "pgbouncer", "stop"]
    _log.warning("stopping the pgbouncer service the package started: %s", " ".join(argv))
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        subprocess.run(argv, capture_output=True, timeout=timeout, check=False)
    deadline = time.monotonic() + timeout
    while (pids := _packaged_pids()) and time.monotonic() < deadline:
        time.sleep(0.1)
    if pids:
        raise StackError(
            f"the pgbouncer service of the Debian package still runs (pids {pids}) after "
            f"`{' '.join(argv)}`; stop it by hand"
        )
    if _port_taken(_PACKAGED_PORT):
        _log.warning(
            "port %d is still in use after stopping the packaged pgbouncer", _PACKAGED_PORT
        )


def _quote_auth(value: str) -> str:
    # auth_file syntax: "name" "secret", a double quote doubled inside.
    return '"' + value.replace('"', '""') + '"'


def _check_value(name: str, value: str) -> str:
    # pgbouncer.ini has no quoting for plain values; reject what would break a line.
    if not value or any(ch in value for ch in "\n\r;#"):
        raise ValueError(f"{name} {value!r} cannot be written to pgbouncer.ini")
    return value


class PgBouncer(Daemon):
    """One PgBouncer under ``base_dir`` on 127.0.0.1, pooling one PostgreSQL server.

    Every database is reachable through the ``*`` fallback entry, so the
    tests' per-test databases need no configuration. Clients authenticate
    with ``auth_type = trust`` (loopback, throwaway); the users in ``users``
    (name -> password, None for a role PostgreSQL trusts) go to the
    ``auth_file``, which trust still requires and which supplies the
    password PgBouncer logs in to PostgreSQL with. The first user is also
    the admin of the ``pgbouncer`` console database.

    Only ``extra_float_digits`` is in ``ignore_startup_parameters``, as in
    common deployments: any other startup parameter PgBouncer does not track
    itself (``application_name`` is tracked) makes it refuse the connection.

    ``base_dir`` holds ``pgbouncer.ini``, ``userlist.txt``, ``pgbouncer.log``
    and a JSON file pinning the port and pid, so another process constructing
    an instance on the same directory controls the same PgBouncer.
    """

    def __init__(
        self,
        base_dir: Path,
        *,
        postgres_port: int,
        postgres_host: str = "127.0.0.1",
        pool_mode: PoolMode = "transaction",
        users: Mapping[str, str | None] | None = None,
        port: int | None = None,
        extra_config: Mapping[str, str] | None = None,
    ) -> None:
        if pool_mode not in POOL_MODES:
            raise ValueError(f"pool_mode must be one of {POOL_MODES}, not {pool_mode!r}")
        self.base_dir = Path(base_dir).resolve()
        self.config_path = self.base_dir / _CONF_FILE
        self.auth_file = self.base_dir / _AUTH_FILE
        self.log_path = self.base_dir / "pgbouncer.log"
        self.postgres_host = _check_value("postgres_host", postgres_host)
        self.postgres_port = postgres_port
        self.pool_mode: PoolMode = pool_mode
        self.users: dict[str, str | None] = dict(users) if users is not None else {"postgres": None}
        if not self.users:
            raise ValueError("users must name at least one role")
        self.extra_config: dict[str, str] = dict(extra_config or {})
        state_path = self._state_path = self.base_dir / _STATE_FILE
        self._proc = None
        saved = read_json(state_path).get("port")
        if port is not None:
            self.port = port
        elif isinstance(saved, int):
            self.port = saved
        else:
            self.port = free_ports(1, avoid=[postgres_port])[0]

    def __repr__(self) -> str:
        return (
            f"PgBouncer(base_dir={str(self.base_dir)!r}, port={self.port}, "
            f"pool_mode={self.pool_mode!r})"
        )

    @property
    def admin_user(self) -> str:
        """The role allowed on the admin console (``SHOW POOLS``...)."""
        return next(iter(self.users))

    def dsn_for(self, database: str, user: str | None = None) -> str:
        """DSN of ``database`` through this pooler (no password: clients are trusted)."""
        role = user if user is not None else self.admin_user
        return (
            f"postgresql://{quote(role, safe='')}@127.0.0.1:{self.port}/{quote(database, safe='')}"
        )

    @property
    def admin_dsn(self) -> str:
        """DSN of the admin console; it speaks the simple query protocol only (use psql)."""
        return self.dsn_for(_ADMIN_DB)

    def _owns(self, argv: list[str]) -> bool:
        # Only our pgbouncer has our config path.
        return bool(argv) and Path(argv[0]).name == "pgbouncer" and str(self.config_path) in argv

    @property
    def is_running(self) -> bool:
        """Whether the pgbouncer process is alive (not necessarily accepting yet)."""
        return self.pid is not None

    def start(self, timeout: float = 30.0) -> None:
        """Start pgbouncer and wait until it accepts connections on its port."""
        if self.is_running:
            return
        binary = ensure_pgbouncer()
        user = service_user("pgbouncer")
        self._write_files(user)
        started = time.monotonic()
        # No logfile in the config: its log goes to stderr, which also catches
        # errors from before its logging is set up.
        with self.log_path.open("ab") as log:
            self._proc = spawn(
                [str(binary), str(self.config_path)], cwd=self.base_dir, stdout=log, user=user
            )
        self._save_state(pid=self._proc.pid)
        try:
            self._wait_ready(started + timeout, timeout, interval=0.05)
        except BaseException:
            self.stop(timeout=5.0)
            raise

    def stop(self, timeout: float = 15.0) -> None:
        """Stop pgbouncer at once (SIGTERM: clients are cut), SIGKILL after ``timeout``."""
        # SIGINT would wait for every client to leave; a test pooler must not.
        self._terminate(timeout)

    def add_user(self, name: str, password: str | None) -> None:
        """Let another role through (it logs in to PostgreSQL with ``password``)."""
        self.users[name] = password
        if self.is_running:
            self._write_auth_file(service_user("pgbouncer"))
            # RELOAD on the console returns once the auth_file is re-read;
            # SIGHUP would leave the next login racing the reload.
            self.admin("RELOAD")

    def admin(self, command: str, timeout: float = 10.0) -> list[dict[str, str]]:
        """Run a console command (``SHOW POOLS``...) and return its rows.

        The console speaks only the simple query protocol, which asyncpg does
        not use for queries with results, so this runs psql.
        """
        argv = [
            str(_find_psql()),
            "-X",
            "--csv",
            "-v",
            "ON_ERROR_STOP=1",
            "-c",
            command,
            self.admin_dsn,
        ]
        try:
            result = subprocess.run(
                argv, capture_output=True, text=True, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired:
            raise StackError(f"pgbouncer console: {command!r} timed out") from None
        if result.returncode != 0:
            raise StackError(f"pgbouncer console: {command!r} failed: {result.stderr.strip()}")
        return list(csv.DictReader(io.StringIO(result.stdout)))

    # -- internals ---------------------------------------------------------

    def config(self) -> dict[str, str]:
        """The ``[pgbouncer]`` section written on every start."""
        settings = {
            "listen_addr": "127.0.0.1",
            "listen_port": str(self.port),
            # No unix socket: nothing to clash with other instances or the package's.
            "unix_socket_dir": "",
            "auth_type": "trust",
            "auth_file": str(self.auth_file),
            "admin_users": self.admin_user,
            "stats_users": self.admin_user,
            "pool_mode": self.pool_mode,
            "max_client_conn": "200",
            "default_pool_size": "20",
            # As deployed: JDBC's extra_float_digits is the classic entry, the
            # relay's own parameters are not listed.
            "ignore_startup_parameters": "extra_float_digits",
            # server_reset_query stays at its default (DISCARD ALL, session mode only).
        }
        settings.update(self.extra_config)
        return settings

    def _write_files(self, owner: pwd.struct_passwd | None) -> None:
        self.base_dir.mkdir(parents=True, exist_ok=True)
        if owner is not None:
            os.chown(self.base_dir, owner.pw_uid, owner.pw_gid)
            grant_search(self.base_dir, owner, self.config_path)
        self.base_dir.chmod(0o700)
        lines = [
            "; Written by devstack on every start; use extra_config to change it.",
            "[databases]",
            f"* = host={self.postgres_host} port={self.postgres_port}",
            "",
            "[pgbouncer]",
        ]
        lines.extend(f"{key} = {value}" for key, value in self.config().items())
        self._write_owned(self.config_path, "\n".join(lines) + "\n", owner)
        self._write_auth_file(owner)

    def _write_auth_file(self, owner: pwd.struct_passwd | None) -> None:
        lines = [
            f"{_quote_auth(name)} {_quote_auth(password or '')}"
            for name, password in self.users.items()
        ]
        self._write_owned(self.auth_file, "\n".join(lines) + "\n", owner)

    @staticmethod
    def _write_owned(path: Path, text: str, owner: pwd.struct_passwd | None) -> None:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text)
        tmp.chmod(0o600)
        if owner is not None:
            os.chown(tmp, owner.pw_uid, owner.pw_gid)
        # Atomic, so a SIGHUP reload never reads half a file.
        os.replace(tmp, path)

    def _state(self) -> dict[str, Any]:
        return {"port": self.port, "pool_mode": self.pool_mode}

    def _not_started(self, failure: NotReady, timeout: float) -> str:
        if failure.code is not None:
            return (
                f"pgbouncer exited with code {failure.code} while starting on 127.0.0.1:{self.port}"
            )
        return (
            f"pgbouncer did not accept connections on 127.0.0.1:{self.port} within "
            f"{timeout:.0f}s ({failure.last_error})"
        )

    def _probe(self) -> str | None:
        assert self._proc is not None
        # Our own process must hold the listening socket: with the port taken,
        # pgbouncer logs a warning first and exits a moment later, while the
        # other listener would answer the probe.
        if not _listens(self._proc.pid, self.port):
            return "not listening yet"
        try:
            if _answers_ssl_request(self.port):
                return None
        except OSError as exc:
            return f"{type(exc).__name__}: {exc}"
        return "the port answers, but not as PgBouncer without TLS would"


def _answers_ssl_request(port: int, timeout: float = 2.0) -> bool:
    """Send PostgreSQL's SSLRequest; a PgBouncer without TLS answers ``N``.

    This proves a PostgreSQL-protocol listener is up without logging in
    (which would open a server connection and count in the pool).
    """
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall((8).to_bytes(4, "big") + (80877103).to_bytes(4, "big"))
        return sock.recv(1) == b"N"


def _listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds a socket listening on 127.0.0.1:``port``."""
    inodes: set[str] = set()
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[len("socket:[") : -1])
    if not inodes:
        return False
    local = f"0100007F:{port:04X}"  # 127.0.0.1 as /proc/net/tcp writes it
    try:
        lines = Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return False
    for line in lines:
        fields = line.split()
        # fields: sl, local_address, rem_address, st (0A = LISTEN), ..., inode at 9
        if len(fields) > 9 and fields[1] == local and fields[3] == "0A" and fields[9] in inodes:
            return True
    return False


def _find_psql() -> Path:
    # Not find_pg_bindir(): the bundles of other versions carry no psql, and
    # any psql talks to the console.
    on_path = shutil.which("psql")
    if on_path:
        return Path(on_path)
    installed = list(Path("/usr/lib/postgresql").glob("*/bin/psql"))
    if installed:
        return installed[0]
    raise StackError(
        "psql not found: install postgresql-client (apt-get install postgresql-client)"
    )
