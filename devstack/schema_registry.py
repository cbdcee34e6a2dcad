"""A throwaway Apicurio Registry serving the Confluent-compatible schema registry API.

Apicurio's all-in-one application (a Quarkus jar plus ``lib/``) is fetched once with Maven
from Maven Central into devstack's cache and unpacked there. Each ``SchemaRegistryServer``
runs its own JVM on a free loopback port, as an unprivileged user when we are root, with its
storage in an H2 file database under its directory: a restart (or a crash) keeps the schemas
and their ids, as a real registry backed by a database would.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import ssl
import tarfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

from devstack._common import (
    StackError,
    cache_root,
    free_ports,
    grant_search,
    locked,
    maven_copy,
    read_json,
    service_user,
    write_json,
)
from devstack._daemon import Daemon, NotReady, spawn
from devstack.kafka import find_java

if TYPE_CHECKING:
    from devstack.certs import IssuedCert

__all__ = ["APICURIO_VERSION", "SchemaRegistryServer", "apicurio_home"]

APICURIO_VERSION = "3.0.9"
_ARTIFACT = f"io.apicurio:apicurio-registry-app:{APICURIO_VERSION}:tar.gz:all"
_TARBALL = f"apicurio-registry-app-{APICURIO_VERSION}-all.tar.gz"
_RUNNER = f"apicurio-registry-app-{APICURIO_VERSION}-runner.jar"
_MAVEN_TIMEOUT_S = 1200
_STATE_FILE = "devstack-schema-registry.json"
# Confluent's default; Apicurio's ccompat API defaults to NONE, which would let tests
# register changes a real registry refuses.
_COMPATIBILITY = "BACKWARD"
_CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"


def apicurio_home() -> Path:
    """Cache directory of the pinned Apicurio version (``app/`` is the unpacked tarball)."""
    return cache_root() / f"apicurio-registry-{APICURIO_VERSION}"


def _runner_jar() -> Path:
    """The unpacked runner jar: fetched with Maven on first use, then from the cache."""
    home = apicurio_home()
    jar = home / "app" / _RUNNER
    if read_json(home / "complete.json").get("version") != APICURIO_VERSION:
        home.mkdir(parents=True, exist_ok=True)
        with locked(home / ".lock"):
            # Another process may have finished the fetch while we waited.
            if read_json(home / "complete.json").get("version") != APICURIO_VERSION:
                _fetch(home)
    if not jar.is_file():
        raise StackError(f"{jar} is missing: remove {home} to fetch Apicurio again")
    return jar


def _fetch(home: Path) -> None:
    staging = home / f"app.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        tarball = maven_copy(
            _ARTIFACT,
            staging,
            home / "mvn.log",
            what=f"Apicurio Registry {APICURIO_VERSION}",
            timeout=_MAVEN_TIMEOUT_S,
        )
        _unpack(tarball, staging)
        tarball.unlink()
        if not (staging / _RUNNER).is_file():
            raise StackError(f"{_TARBALL} has no {_RUNNER}")
        app = home / "app"
        shutil.rmtree(app, ignore_errors=True)
        os.replace(staging, app)
        write_json(home / "complete.json", {"version": APICURIO_VERSION, "artifact": _ARTIFACT})
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _unpack(tarball: Path, dest: Path) -> None:
    def keep(member: tarfile.TarInfo, path: str) -> tarfile.TarInfo:
        # The "data" filter refuses absolute paths, links out of dest and setuid bits;
        # the entries' owner (the image builder's "runner" uid) is not kept: ours instead.
        safe = tarfile.data_filter(member, path)
        return safe.replace(uid=os.getuid(), gid=os.getgid(), uname="", gname="", deep=False)

    with tarfile.open(tarball, mode="r:gz") as tar:
        tar.extractall(dest, filter=keep)  # noqa: S202 - filtered by keep, above
    for path in dest.rglob("*"):
        # Readable (directories searchable) by the service account, whatever our umask.
        mode = path.lstat().st_mode
        if not path.is_symlink():
            path.chmod(mode | 0o444 | (0o111 if path.is_dir() else 0))


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class SchemaRegistryServer(Daemon):
    """One Apicurio Registry under ``base_dir`` on 127.0.0.1, compatibility BACKWARD.

    ``base_dir`` holds ``data/`` (the H2 database: schemas survive ``restart()`` and
    ``kill()``), ``tmp/`` (the JVM's temporary files), ``registry.log`` (the JVM's output)
    and a JSON state file with port and pid, so another process constructing a server on
    the same directory controls the same JVM.
    """

    # A JVM stops slower than pgbouncer: no need to look as often.
    _exit_poll_s = 0.1

    def __init__(
        self,
        base_dir: Path,
        *,
        port: int | None = None,
        heap: str = "384m",
        tls: IssuedCert | None = None,
        ca_file: Path | None = None,
    ) -> None:
        self.base_dir = Path(base_dir).resolve()
        #: HTTPS only, with this certificate (its key unencrypted), verified against
        #: ``ca_file`` by this object's own requests.
        self.tls = tls
        self.ca_file = ca_file
        self.data_dir = self.base_dir / "data"
        self.tmp_dir = self.base_dir / "tmp"
        self.log_path = self.base_dir / "registry.log"
        self.heap = heap
        self._proc = None
        state_path = self._state_path = self.base_dir / _STATE_FILE
        saved_port = read_json(state_path).get("port")
        if port is None and isinstance(saved_port, int):
            port = saved_port
        self.port: int = port if port is not None else free_ports(1)[0]

    def __repr__(self) -> str:
        return f"SchemaRegistryServer(base_dir={str(self.base_dir)!r}, port={self.port})"

    @property
    def url(self) -> str:
        """The Confluent-compatible base URL clients use (``.../apis/ccompat/v7``)."""
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://127.0.0.1:{self.port}/apis/ccompat/v7"

    def is_running(self) -> bool:
        """Whether the registry JVM is alive (not necessarily serving yet)."""
        return self.pid is not None

    def start(self, timeout: float = 60.0) -> None:
        """Start the registry, wait until it serves, and set compatibility to BACKWARD."""
        if self.is_running():
            return
        java = find_java()
        jar = _runner_jar()
        if not _port_free(self.port):
            raise StackError(
                f"port 127.0.0.1:{self.port} is already in use; stop whatever listens "
                f"there or remove {self._state_path} to pick a new port"
            )
        user = service_user("the schema registry")
        for directory in (self.base_dir, self.data_dir, self.tmp_dir):
            directory.mkdir(parents=True, exist_ok=True)
        self.log_path.touch(exist_ok=True)
        if user is not None:
            for path in (self.base_dir, self.data_dir, self.tmp_dir, self.log_path):
                os.chown(path, user.pw_uid, user.pw_gid)
            for entry in self.data_dir.iterdir():
                os.chown(entry, user.pw_uid, user.pw_gid)
            grant_search(self.base_dir, user, self.base_dir)
            grant_search(jar.parent, user, jar)
            if self.tls is not None:
                for path in (self.tls.cert_file, self.tls.key_file):
                    os.chown(path, user.pw_uid, user.pw_gid)
                grant_search(self.tls.cert_file.parent, user, self.tls.cert_file)
        self._save_state(pid=None)
        started = time.monotonic()
        with self.log_path.open("ab") as log:
            self._proc = spawn(self._argv(java, jar), cwd=self.base_dir, stdout=log, user=user)
        self._save_state(pid=self._proc.pid)
        try:
            self._wait_ready(started + timeout, timeout, interval=0.2)
            self._set_compatibility()
        except BaseException:
            self.kill()
            raise

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the registry with SIGTERM, falling back to SIGKILL after ``timeout``."""
        self._terminate(timeout)

    def restart(self) -> None:
        """Stop and start again on the same port with the same schemas."""
        self.stop()
        self.start()

    # -- internals ---------------------------------------------------------

    def _argv(self, java: Path, jar: Path) -> list[str]:
        # System properties rather than environment variables: they outrank any
        # APICURIO_*/QUARKUS_* variable the caller's environment happens to hold.
        return [
            str(java),
            f"-Xmx{self.heap}",
            # Two cores shared with PostgreSQL and Kafka: no parallel GC threads.
            "-XX:+UseSerialGC",
            "-XX:+ExitOnOutOfMemoryError",
            # No hsperfdata files in /tmp for every test run.
            "-XX:-UsePerfData",
            # Vert.x's file cache goes here instead of a /tmp shared with other users;
            # it also marks the argv as ours (see _owns).
            f"-Djava.io.tmpdir={self.tmp_dir}",
            "-Dquarkus.http.host=127.0.0.1",
            *self._listen_args(),
            "-Dapicurio.storage.kind=sql",
            "-Dapicurio.storage.sql.kind=h2",
            # A file instead of the default in-memory database, so schemas (and the ids
            # producers embed in messages) survive a restart. WRITE_DELAY=0 commits every
            # change to disk at once, so a SIGKILL right after a registration keeps it too.
            f"-Dapicurio.datasource.url=jdbc:h2:file:{self.data_dir}/registry;WRITE_DELAY=0",
            # The default pool opens 20 connections up front; a test registry needs few.
            "-Dapicurio.datasource.jdbc.initial-size=2",
            "-Dapicurio.datasource.jdbc.min-size=2",
            "-Dapicurio.datasource.jdbc.max-size=10",
            "-jar",
            str(jar),
        ]

    def _listen_args(self) -> list[str]:
        if self.tls is None:
            return [f"-Dquarkus.http.port={self.port}"]
        # HTTPS only: the plain port is not served (insecure requests disabled).
        return [
            f"-Dquarkus.http.ssl-port={self.port}",
            f"-Dquarkus.http.port={free_ports(1, avoid=[self.port])[0]}",
            "-Dquarkus.http.insecure-requests=disabled",
            f"-Dquarkus.http.ssl.certificate.files={self.tls.cert_file}",
            f"-Dquarkus.http.ssl.certificate.key-files={self.tls.key_file}",
        ]

    def _owns(self, argv: list[str]) -> bool:
        # Only our JVM has our temporary directory.
        return _RUNNER in " ".join(argv) and f"-Djava.io.tmpdir={self.tmp_dir}" in argv

    def _state(self) -> dict[str, Any]:
        return {"port": self.port}

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(  # noqa: S310 - a loopback http URL of ours
            self.url + path, data=data, method=method, headers={"Content-Type": _CONTENT_TYPE}
        )
        context = None
        if self.tls is not None:
            context = ssl.create_default_context(
                cafile=str(self.ca_file) if self.ca_file is not None else None
            )
        with urllib.request.urlopen(request, timeout=5, context=context) as response:  # noqa: S310
            return json.load(response)

    def _probe(self) -> str | None:
        try:
            self._request("GET", "/subjects")
        except urllib.error.HTTPError as exc:
            return f"HTTP {exc.code}"
        except (urllib.error.URLError, OSError, ValueError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    def _set_compatibility(self) -> None:
        try:
            self._request("PUT", "/config", {"compatibility": _COMPATIBILITY})
            level = self._request("GET", "/config").get("compatibilityLevel")
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise StackError(
                f"could not set the schema registry's compatibility to {_COMPATIBILITY}: "
                f"{exc}, see {self.log_path}"
            ) from exc
        if level != _COMPATIBILITY:
            raise StackError(
                f"the schema registry's compatibility is {level!r} after setting "
                f"{_COMPATIBILITY}, see {self.log_path}"
            )

    def _not_started(self, failure: NotReady, timeout: float) -> str:
        if failure.code is not None:
            return f"the schema registry exited with code {failure.code} while starting"
        return (
            f"the schema registry did not answer on {self.url} within {timeout:.0f}s "
            f"({failure.last_error})"
        )
