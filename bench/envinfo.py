"""The environment recorded with every result: machine, fsync figure, PostgreSQL and Kafka
versions and settings, Python and library versions, git revision, load."""

from __future__ import annotations

import asyncio
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from bench.procs import ROOT, BenchError
from bench.services import connection

_LIBRARIES = (
    "notify-outbox",
    "asyncpg",
    "aiokafka",
    "anyio",
    "uvloop",
    "pydantic",
    "pydantic-settings",
    "matplotlib",
)
_PG_SETTINGS = (
    "server_version",
    "synchronous_commit",
    "fsync",
    "wal_sync_method",
    "full_page_writes",
    "shared_buffers",
    "wal_buffers",
    "commit_delay",
    "max_connections",
    "shared_preload_libraries",
)


def host_info() -> dict[str, Any]:
    """CPU model, cores, memory, kernel, Python."""
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_kib = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_kib = int(line.split()[1])
    except OSError:
        pass
    return {
        "cpu_model": model,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "memory_gib": round(mem_kib / 1024 / 1024, 1),
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
    }


def library_versions() -> dict[str, str | None]:
    """Installed versions of the libraries that matter here."""
    out: dict[str, str | None] = {}
    for name in _LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_output(*args: str) -> str:
    """The output of ``git ARGS`` in this checkout; BenchError with git's message if it
    fails."""
    try:
        done = subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BenchError(f"git {' '.join(args)}: {e}") from None
    if done.returncode != 0:
        raise BenchError(f"git {' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done.stdout.strip()


def _git(*args: str) -> str | None:
    try:
        return git_output(*args)
    except BenchError:
        return None


def git_info() -> dict[str, Any]:
    """HEAD revision and subject, branch, and whether the tree has uncommitted changes
    (read-only)."""
    status = _git("status", "--porcelain")
    changed = [line[3:] for line in status.splitlines()] if status else []
    return {
        "revision": _git("rev-parse", "HEAD"),
        "subject": _git("log", "-1", "--format=%s", "HEAD"),
        "branch": _git("rev-parse", "--abbrev-ref", "HEAD"),
        "dirty": bool(changed) if status is not None else None,
        "changed_files": changed[:50],
    }


def cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat (steal counts as busy)."""
    try:
        fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0.0, 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    total = sum(fields[:8])
    return total - idle, total


def busy_share(before: tuple[float, float], after: tuple[float, float]) -> float | None:
    """The host's CPU busy share between two ``cpu_times()`` readings (None if no time
    passed)."""
    return (after[0] - before[0]) / (after[1] - before[1]) if after[1] > before[1] else None


def fdatasync_probe(directory: Path, seconds: float = 1.0) -> dict[str, Any]:
    """8 kB write + fdatasync in a loop for ``seconds`` in ``directory``."""
    path = directory / "fdatasync-probe.tmp"
    block = os.urandom(8192)
    times: list[float] = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end and len(times) < 200_000:
            os.pwrite(fd, block, 0)
            t = time.monotonic_ns()
            os.fdatasync(fd)
            times.append((time.monotonic_ns() - t) / 1000.0)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return {
        "directory": str(directory),
        "ops": len(times),
        "median_us": round(statistics.median(times), 1) if times else None,
        "mean_us": round(statistics.fmean(times), 1) if times else None,
    }


def pg_test_fsync(directory: Path, seconds: int) -> dict[str, Any]:
    """``pg_test_fsync -s seconds`` (devstack's find_pg_bindir); its fdatasync figure."""
    try:
        from devstack.postgres import find_pg_bindir

        binary = find_pg_bindir() / "pg_test_fsync"
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    path = directory / "pg_test_fsync.tmp"
    try:
        done = subprocess.run(
            [str(binary), "-s", str(seconds), "-f", str(path)],
            capture_output=True,
            text=True,
            timeout=30 * seconds + 60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        path.unlink(missing_ok=True)
    result: dict[str, Any] = {"seconds": seconds, "exit": done.returncode}
    m = re.search(r"^\s*fdatasync\s+([\d.]+) ops/sec\s+(\d+) usecs/op", done.stdout, re.M)
    if m:
        result["fdatasync_ops_per_s"] = float(m.group(1))
        result["fdatasync_us_per_op"] = int(m.group(2))
    result["output"] = done.stdout[-4000:]
    return result


async def postgres_info(dsn: str) -> dict[str, Any]:
    """Version and key settings of the server."""
    async with connection(dsn) as conn:
        async with asyncio.timeout(30):
            version = await conn.fetchval("SELECT version()")
            rows = await conn.fetch(
                "SELECT name, setting, unit FROM pg_settings WHERE name = ANY($1::text[])",
                list(_PG_SETTINGS),
            )
            shared = await conn.fetchval("SHOW shared_buffers")
    settings = {r["name"]: r["setting"] + (r["unit"] or "") for r in rows}
    settings["shared_buffers"] = shared
    return {"version": version, "settings": settings}
