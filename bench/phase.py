"""What the backlog-drain and outage-recovery phases share: a run id, a work directory with the
relay source snapshot, the services, the environment record, progress, and the result JSON
(written even when the phase fails half-way, then turned into markdown and plots)."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bench import envinfo
from bench.config import Mode
from bench.procs import BenchError, Child
from bench.progress import Progress
from bench.runner import _clean, record_environment, snapshot_source, start_mode
from bench.services import Services, close_services, make_work_dir, remove_work_dir

__all__ = ["PhaseRun", "loadavg", "slug", "utc"]

_STOP_TIMEOUT = 40.0  # above the relay's default shutdown_timeout (30 s)


def utc() -> str:
    """Now, UTC, ISO 8601 to the second."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages."""
    return [round(x, 2) for x in os.getloadavg()]


def slug(name: str) -> str:
    """``name`` as a lower-case identifier (database and topic names)."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


class PhaseRun:
    """One run of a phase: ``run(body)`` opens the services, records the environment, runs
    ``body`` and writes ``<out>/<phase>-<UTC timestamp>.json``."""

    def __init__(self, phase: str, config: dict[str, Any], out_dir: Path, *, keep: bool) -> None:
        self.phase = phase
        self.out_dir = out_dir
        self.keep = keep
        self.run_id = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
        self.work = make_work_dir()
        self.src, self.src_digest = snapshot_source(self.work)
        self.progress = Progress()
        self.errors: list[str] = []
        self.notes: list[str] = []
        self._log_no = 0
        self.result: dict[str, Any] = {
            "schema": 1,
            "phase": phase,
            "run_id": self.run_id,
            "started_utc": utc(),
            "config": config,
            "notes": self.notes,
        }

    @property
    def path(self) -> Path:
        """Where the result JSON goes."""
        return self.out_dir / f"{self.phase}-{self.run_id}.json"

    def log_path(self, what: str) -> Path:
        """A new numbered log file in the work directory."""
        self._log_no += 1
        return self.work / "logs" / f"{self._log_no:03d}-{slug(what)}.log"

    async def start(
        self,
        services: Services,
        mode: Mode,
        dsn: str,
        *,
        name: str,
        extra_env: dict[str, str] | None = None,
        wait_ready: bool = True,
    ) -> Child:
        """Start one process of ``mode`` (see ``bench.runner.start_mode``)."""
        return await start_mode(
            services,
            mode,
            dsn,
            src=self.src,
            log_path=self.log_path(name),
            extra_env=extra_env,
            wait_ready=wait_ready,
        )

    async def stop(self, child: Child) -> int | None:
        """A graceful stop (bounded); a note when the exit was not clean."""
        code = await child.stop(_STOP_TIMEOUT)
        if code not in (0, -15):
            self.notes.append(f"{child.name} exited with {code} (log {child.log_path})")
        return code

    async def run(
        self,
        open_services: Callable[[Path], Awaitable[Services]],
        body: Callable[[Services], Awaitable[None]],
        *,
        fsync_seconds: int = 0,
    ) -> Path:
        """Open the services, record the environment, run ``body``; always write the JSON.
        BenchError when the bench itself broke (``self.errors``)."""
        self.result["load_average_start"] = loadavg()
        cpu0 = envinfo.cpu_times()
        t0 = time.monotonic()
        services: Services | None = None
        ok = False
        try:
            self.progress.line(f"bench {self.phase}: work dir {self.work}")
            self.progress.status("starting PostgreSQL and Kafka")
            services = await open_services(self.work)
            services.src = self.src
            self.progress.line(
                f"services: {'own devstack (durable)' if services.own_stack else 'given'} "
                f"{services.bootstrap}"
            )
            self.result["environment"] = await record_environment(
                services,
                self.work,
                self.src_digest,
                fsync_seconds=fsync_seconds,
                progress=self.progress,
                notes=self.notes,
                load_average=self.result["load_average_start"],
            )
            await body(services)
            ok = not self.errors
        except BenchError as e:
            self.errors.append(str(e))
            raise
        finally:
            busy1, total1 = envinfo.cpu_times()
            self.result["load_average_end"] = loadavg()
            self.result["host_cpu_busy"] = (
                (busy1 - cpu0[0]) / (total1 - cpu0[1]) if total1 > cpu0[1] else None
            )
            self.result["wall_seconds"] = round(time.monotonic() - t0, 1)
            self.result["finished_utc"] = utc()
            self.result["errors"] = self.errors
            if services is not None:
                try:
                    await close_services(services)
                except Exception as e:
                    self.errors.append(f"stopping services: {type(e).__name__}: {e}")
            self.write()
            if ok and not self.keep:
                remove_work_dir(self.work)
            else:
                self.progress.line(f"work dir kept: {self.work}")
        if self.errors:
            raise BenchError("; ".join(self.errors[:5]))
        return self.path

    def write(self) -> Path:
        """Write the result JSON (atomically); returns its path."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(_clean(self.result), indent=1) + "\n")
        tmp.replace(self.path)
        return self.path
