"""A throwaway PostgreSQL server built from the locally installed binaries."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from urllib.parse import quote

from devstack._common import (
    StackError,
    cmdline,
    free_ports,
    grant_search,
    pid_alive,
    read_json,
    service_user,
    tail,
    write_json,
)
from devstack._daemon import run_as
from devstack.pgbundles import PG_VERSION_ENV, bundle_bindir

__all__ = ["PostgresServer", "PostgresStandby", "find_pg_bindir"]

PG_BINDIR_ENV = "NOTIFY_OUTBOX_PG_BINDIR"
_SUPERUSER = "postgres"
_STATE_FILE = "devstack-postgres.json"
_CONF_FILE = "devstack.conf"
# sockaddr_un.sun_path is 108 bytes including the terminating NUL.
_MAX_SOCKET_PATH = 107
_START_TIMEOUT_S = 120
_STOP_MODES = ("smart", "fast", "immediate")


def find_pg_bindir() -> Path:
    """Locate the directory holding ``initdb`` and ``pg_ctl``.

    ``NOTIFY_OUTBOX_PG_BINDIR`` names it outright; otherwise
    ``NOTIFY_OUTBOX_PG_VERSION`` picks a major version: the installed one if
    Debian's package is there, else a bundle from Maven Central (pgbundles).
    """
    candidates: list[Path] = []
    override = os.environ.get(PG_BINDIR_ENV)
    version = os.environ.get(PG_VERSION_ENV, "").strip()
    if version and not override:
        installed = Path("/usr/lib/postgresql") / version / "bin"
        if (installed / "initdb").is_file() and (installed / "pg_ctl").is_file():
            return installed
        return bundle_bindir(version)
    if override:
        candidates.append(Path(override))
    else:
        candidates.append(Path("/usr/lib/postgresql/15/bin"))
        candidates.extend(
            sorted(
                Path("/usr/lib/postgresql").glob("*/bin"),
                key=lambda p: _version_key(p.parent.name),
                reverse=True,
            )
        )
        on_path = shutil.which("pg_ctl")
        if on_path:
            candidates.append(Path(on_path).resolve().parent)
    for candidate in candidates:
        if (candidate / "initdb").is_file() and (candidate / "pg_ctl").is_file():
            return candidate
    looked = ", ".join(str(c) for c in candidates) or "(nowhere)"
    raise StackError(
        f"PostgreSQL binaries not found: looked in {looked}; "
        f"install postgresql-15 (apt-get install postgresql-15) or set {PG_BINDIR_ENV}"
    )


def _version_key(name: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in name.split("."))
    except ValueError:
        return (0,)


def _quote_conf(value: str) -> str:
    # Every GUC accepts a single-quoted value, whatever its type.
    return "'" + value.replace("'", "''") + "'"


class PostgresServer:
    """One PostgreSQL cluster under ``base_dir`` listening on 127.0.0.1 only.

    ``base_dir`` holds ``data/`` (the cluster), ``run/`` (the unix socket),
    ``postgres.log`` and a small JSON file that pins the port, so a second
    process constructing a server on the same directory controls the same
    cluster. The settings file is rewritten from the constructor's arguments
    on every start, so pass the same ``durable``/``extra_conf`` when
    restarting from another handle.
    """

    def __init__(
        self,
        base_dir: Path,
        *,
        port: int | None = None,
        durable: bool = True,
        extra_conf: Mapping[str, str] | None = None,
    ) -> None:
        self.base_dir = Path(base_dir).resolve()
        self.data_dir = self.base_dir / "data"
        self.socket_dir = self.base_dir / "run"
        self.log_path = self.base_dir / "postgres.log"
        self.durable = durable
        self.extra_conf: dict[str, str] = dict(extra_conf or {})
        self._state_path = self.base_dir / _STATE_FILE
        self._bindir: Path | None = None
        state = read_json(self._state_path)
        if port is not None:
            self.port = port
        elif isinstance(state.get("port"), int):
            self.port = int(state["port"])
        else:
            self.port = free_ports(1)[0]

    def __repr__(self) -> str:
        return f"PostgresServer(base_dir={str(self.base_dir)!r}, port={self.port})"

    @property
    def dsn(self) -> str:
        """DSN of the ``postgres`` database as the trusted superuser."""
        return self.dsn_for("postgres")

    def dsn_for(self, database: str, user: str = _SUPERUSER, password: str | None = None) -> str:
        """Build a TCP DSN for ``database``; roles other than postgres need a password."""
        auth = quote(user, safe="")
        if password is not None:
            auth += ":" + quote(password, safe="")
        return f"postgresql://{auth}@127.0.0.1:{self.port}/{quote(database, safe='')}"

    @property
    def pid(self) -> int | None:
        """Pid of the running postmaster, or None."""
        try:
            first = (self.data_dir / "postmaster.pid").read_text().splitlines()[0]
            pid = int(first.strip())
        except (OSError, ValueError, IndexError):
            return None
        if not pid_alive(pid):
            return None
        argv = cmdline(pid)
        # Guards against a stale pid file whose pid now belongs to another program.
        if argv and not Path(argv[0]).name.startswith(("postgres", "postmaster")):
            return None
        return pid

    def is_running(self) -> bool:
        """Tell whether the postmaster of this cluster is alive."""
        return self.pid is not None

    def start(self) -> None:
        """Start the server, running initdb first if the cluster does not exist yet."""
        if self.is_running():
            return
        self._bindir = find_pg_bindir()
        self._prepare_dirs()
        state = read_json(self._state_path)
        if not state.get("initialized") or not (self.data_dir / "PG_VERSION").is_file():
            self._initdb()
        self._write_conf()
        # The binaries are remembered so that a stop from another handle (or
        # without NOTIFY_OUTBOX_PG_VERSION) uses the same pg_ctl.
        write_json(
            self._state_path,
            {"port": self.port, "initialized": True, "bindir": str(self._bindir)},
        )
        result = self._run(
            [
                "pg_ctl",
                "start",
                "-w",
                "-t",
                str(_START_TIMEOUT_S),
                "-D",
                str(self.data_dir),
                "-l",
                str(self.log_path),
            ]
        )
        if result.returncode != 0 or not self.is_running():
            raise StackError(
                f"PostgreSQL did not start on 127.0.0.1:{self.port} "
                f"(pg_ctl exit {result.returncode}: {result.stdout.strip()}), "
                f"see {self.log_path} (last lines:\n{tail(self.log_path)})"
            )

    def stop(self, mode: str = "fast") -> None:
        """Stop the server; ``mode="immediate"`` skips the shutdown checkpoint like a crash."""
        if mode not in _STOP_MODES:
            raise ValueError(f"mode must be one of {_STOP_MODES}, not {mode!r}")
        if not self.is_running():
            return
        self._use_saved_bindir()
        result = self._run(
            [
                "pg_ctl",
                "stop",
                "-w",
                "-t",
                str(_START_TIMEOUT_S),
                "-m",
                mode,
                "-D",
                str(self.data_dir),
            ]
        )
        if result.returncode != 0 and self.is_running():
            raise StackError(
                f"PostgreSQL did not stop (pg_ctl exit {result.returncode}: "
                f"{result.stdout.strip()}), see {self.log_path}"
            )

    def restart(self) -> None:
        """Stop and start again on the same port with the same data."""
        self.stop()
        self.start()

    # -- internals ---------------------------------------------------------

    def _use_saved_bindir(self) -> None:
        """Control a running server with the binaries that started it (from another handle,
        or without NOTIFY_OUTBOX_PG_VERSION)."""
        saved = read_json(self._state_path).get("bindir")
        self._bindir = self._bindir or (Path(saved) if saved else None) or find_pg_bindir()

    def _os_user(self) -> pwd.struct_passwd | None:
        """The account the server runs as, or None to run as the current user."""
        return service_user("PostgreSQL")

    def _prepare_dirs(self) -> None:
        self.base_dir.mkdir(parents=True, exist_ok=True)
        socket_path = self.socket_dir / f".s.PGSQL.{self.port}"
        if len(str(socket_path)) > _MAX_SOCKET_PATH:
            raise StackError(
                f"unix socket path {socket_path} is longer than {_MAX_SOCKET_PATH} bytes; "
                "use a shorter base directory"
            )
        user = self._os_user()
        for path in (self.data_dir, self.socket_dir):
            path.mkdir(mode=0o700, exist_ok=True)
        self.log_path.touch(exist_ok=True)
        if user is None:
            return
        for path in (self.data_dir, self.socket_dir, self.log_path):
            os.chown(path, user.pw_uid, user.pw_gid)
        self._grant_search(user)

    def _grant_search(self, user: pwd.struct_passwd) -> None:
        grant_search(self.base_dir, user, self.data_dir)

    def _empty_data_dir(self) -> None:
        # A half-initialised data dir from an interrupted run would make initdb (or
        # pg_basebackup) refuse to proceed; it holds nothing worth keeping.
        for child in self.data_dir.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()

    def _initdb(self) -> None:
        self._empty_data_dir()
        cmd = [
            "initdb",
            "-D",
            str(self.data_dir),
            "-U",
            _SUPERUSER,
            "--auth=trust",
            "--encoding=UTF8",
            "--locale=C",
        ]
        if not self.durable:
            cmd.append("--no-sync")
        result = self._run(cmd)
        if result.returncode != 0:
            raise StackError(
                f"initdb failed (exit {result.returncode}) for {self.data_dir}:\n"
                f"{result.stdout.strip()[-4000:]}"
            )
        with (self.data_dir / "postgresql.conf").open("a") as fh:
            fh.write(f"\ninclude '{_CONF_FILE}'\n")
        hba = (
            "# Written by devstack. Only the superuser is trusted over TCP, so tests\n"
            "# of password handling for other roles are meaningful.\n"
            "local all all trust\n"
            f"host all {_SUPERUSER} 127.0.0.1/32 trust\n"
            "host all all 127.0.0.1/32 scram-sha-256\n"
            "# Streaming replicas (PostgresStandby) copy the cluster as the superuser.\n"
            f"host replication {_SUPERUSER} 127.0.0.1/32 trust\n"
        )
        self._write_owned(self.data_dir / "pg_hba.conf", hba)

    def _write_conf(self) -> None:
        settings: dict[str, str] = {
            "listen_addresses": "127.0.0.1",
            "port": str(self.port),
            "unix_socket_directories": str(self.socket_dir),
            "max_connections": "400",
            # Tests prove that an event of a PREPAREd transaction waits for COMMIT PREPARED.
            "max_prepared_transactions": "20",
            "shared_preload_libraries": "pg_stat_statements",
            "password_encryption": "scram-sha-256",
            "logging_collector": "off",
            "log_line_prefix": "%m [%p] %q%u@%d ",
        }
        if not self.durable:
            settings.update(
                {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}
            )
        settings.update(self.extra_conf)
        lines = ["# Written by devstack on every start; edit extra_conf instead."]
        lines.extend(f"{key} = {_quote_conf(value)}" for key, value in settings.items())
        self._write_owned(self.data_dir / _CONF_FILE, "\n".join(lines) + "\n")

    def _write_owned(self, path: Path, text: str) -> None:
        path.write_text(text)
        user = self._os_user()
        if user is not None:
            os.chown(path, user.pw_uid, user.pw_gid)
        path.chmod(0o600)

    def _run(self, argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        """Run a PostgreSQL tool from the bindir, as the postgres user when root."""
        assert self._bindir is not None
        user = self._os_user()
        env = dict(os.environ)
        env["LC_ALL"] = "C"
        if user is not None:
            env.update(HOME=user.pw_dir, USER=user.pw_name, LOGNAME=user.pw_name)
        try:
            return subprocess.run(
                [str(self._bindir / argv[0]), *argv[1:]],
                cwd=self.base_dir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                # The postmaster must not share our process group, or a Ctrl-C
                # aimed at the test run would take it down mid-test.
                start_new_session=True,
                check=False,
                **run_as(user),
            )
        except OSError as exc:
            raise StackError(f"could not run {argv[0]} from {self._bindir}: {exc}") from exc


class PostgresStandby(PostgresServer):
    """A streaming replica of a running ``primary``: a hot standby under ``base_dir``, on
    its own loopback port, that ``promote()`` turns into a primary (a failover).

    Its data directory is a ``pg_basebackup`` of the primary (which must be running at the
    first start), with ``standby.signal`` and ``primary_conninfo`` written by ``-R``. It
    takes the primary's ``durable`` and ``extra_conf``. No replication slot: a slot would
    keep WAL on the primary after the standby is gone.
    """

    def __init__(self, base_dir: Path, primary: PostgresServer, *, port: int | None = None) -> None:
        super().__init__(
            base_dir, port=port, durable=primary.durable, extra_conf=primary.extra_conf
        )
        self.primary = primary

    def __repr__(self) -> str:
        return (
            f"PostgresStandby(base_dir={str(self.base_dir)!r}, port={self.port}, "
            f"primary={self.primary.port})"
        )

    def start(self) -> None:
        """Start the standby (copying the primary first if needed) and return once it
        streams from the primary: a failover from then on loses no committed transaction
        of a clean primary shutdown, which waits for its standbys to have it all."""
        super().start()
        if self.is_standby():
            self._wait_for("SELECT status FROM pg_stat_wal_receiver", "streaming", "stream")

    def is_standby(self) -> bool:
        """Whether the cluster is still a standby (not promoted yet)."""
        return (self.data_dir / "standby.signal").exists()

    def promote(self, timeout: float = _START_TIMEOUT_S) -> None:
        """Promote the standby and return once it accepts writes."""
        if not self.is_running():
            raise StackError(f"cannot promote {self!r}: it is not running")
        self._use_saved_bindir()
        # -w: pg_ctl returns once the control file says "in production", which the server
        # sets together with the end of recovery; read-write transactions start from then on.
        result = self._run(
            ["pg_ctl", "promote", "-w", "-t", str(int(timeout)), "-D", str(self.data_dir)]
        )
        if result.returncode != 0:
            raise StackError(
                f"pg_ctl promote failed (exit {result.returncode}: {result.stdout.strip()}), "
                f"see {self.log_path} (last lines:\n{tail(self.log_path)})"
            )
        self._wait_for("SELECT pg_is_in_recovery()", "f", "accept writes", timeout)

    def _wait_for(
        self, sql: str, expected: str, what: str, timeout: float = _START_TIMEOUT_S
    ) -> None:
        """Poll ``sql`` until it answers ``expected``; StackError after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while (answer := self._ask(sql)) != expected:
            if time.monotonic() >= deadline:
                raise StackError(
                    f"{self!r} does not {what} within {timeout:g}s ({sql}: {answer!r}), "
                    f"see {self.log_path} (last lines:\n{tail(self.log_path)})"
                )
            time.sleep(0.05)

    def _ask(self, sql: str) -> str:
        """One value from ``psql`` over the unix socket (its error text if it fails)."""
        self._use_saved_bindir()
        argv = ["psql", "-X", "-A", "-t", "-h", str(self.socket_dir), "-p", str(self.port)]
        result = self._run([*argv, "-U", _SUPERUSER, "-d", "postgres", "-c", sql])
        return result.stdout.strip()

    def _initdb(self) -> None:
        if not self.primary.is_running():
            raise StackError(f"the primary of {self!r} must be running to copy it")
        self._empty_data_dir()
        cmd = [
            "pg_basebackup",
            "-D",
            str(self.data_dir),
            "-h",
            "127.0.0.1",
            "-p",
            str(self.primary.port),
            "-U",
            _SUPERUSER,
            "--no-password",
            "--checkpoint=fast",
            "--wal-method=stream",
            "--write-recovery-conf",
        ]
        if not self.durable:
            cmd.append("--no-sync")
        result = self._run(cmd)
        if result.returncode != 0:
            raise StackError(
                f"pg_basebackup from {self.primary!r} failed (exit {result.returncode}):\n"
                f"{result.stdout.strip()[-4000:]}"
            )
