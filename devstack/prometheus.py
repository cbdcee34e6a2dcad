"""A throwaway Prometheus server (and ``promtool``) from Debian's ``prometheus`` package.

Installed with apt when missing and we are root (``apt-get update`` first); the package's own
service is stopped and disabled, so nothing is left running on :9090. The server runs as the
package's ``prometheus`` user when we are root (it needs no privileges), on a free loopback
port, with a generated config that scrapes given targets every second and evaluates given
rules files every second.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from devstack._common import StackError, apt_install, free_ports, grant_search, tail
from devstack._daemon import Daemon, spawn, wait_ready

__all__ = ["PrometheusServer", "find_tool"]

_PACKAGE = "prometheus"
_START_TIMEOUT_S = 60
_APT_TIMEOUT_S = 900
_RUN_AS = ("prometheus", "nobody")  # as root: the package's user, else nobody


def _install() -> None:
    """``apt-get install prometheus`` (as root), then make sure its service does not run."""
    if os.geteuid() != 0:
        raise StackError(
            "prometheus/promtool not found: install the Debian package `prometheus` "
            "(sudo apt-get install --no-install-recommends prometheus) or put both on PATH"
        )
    apt_install(
        _PACKAGE,
        # Both programs come from the package: one found means it is installed.
        find=lambda: Path(found) if (found := shutil.which("promtool")) else None,
        stop_service=_stop_package_service,
        timeout=_APT_TIMEOUT_S,
    )


def _stop_package_service() -> None:
    """The package enables a system service on :9090; tests want only their own servers."""
    if shutil.which("systemctl") and Path("/run/systemd/system").is_dir():
        subprocess.run(
            ["systemctl", "disable", "--now", _PACKAGE], capture_output=True, check=False
        )
    elif Path(f"/etc/init.d/{_PACKAGE}").exists():
        subprocess.run([f"/etc/init.d/{_PACKAGE}", "stop"], capture_output=True, check=False)


def find_tool(name: str) -> Path:
    """The path of ``prometheus`` or ``promtool``, installing the package when missing."""
    found = shutil.which(name)
    if found is None:
        _install()
        found = shutil.which(name)
    if found is None:
        raise StackError(f"{name} still not on PATH after installing the {_PACKAGE} package")
    return Path(found)


def _run_as() -> pwd.struct_passwd | None:
    if os.geteuid() != 0:
        return None
    for name in _RUN_AS:
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise StackError(f"running as root, and none of the users {_RUN_AS} exists to run Prometheus")


class PrometheusServer(Daemon):
    """A Prometheus server scraping ``targets`` (``host:port`` of ``/metrics``) every
    ``scrape_interval`` seconds as job ``job``, with ``rules`` evaluated every
    ``evaluation_interval`` seconds. Use as a context manager, or ``start()``/``stop()``."""

    def __init__(
        self,
        base_dir: Path,
        targets: Sequence[str],
        *,
        rules: Sequence[Path] = (),
        job: str = "notify-outbox",
        scrape_interval: float = 1.0,
        evaluation_interval: float = 1.0,
    ) -> None:
        self.base_dir = base_dir
        self.targets = list(targets)
        self.rules = list(rules)
        self.job = job
        self.scrape_interval = scrape_interval
        self.evaluation_interval = evaluation_interval
        self.port = 0
        self._proc = None
        self.log_path = base_dir / "prometheus.log"

    @property
    def url(self) -> str:
        """The server's base URL."""
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> PrometheusServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _write_config(self) -> Path:
        rules_dir = self.base_dir / "rules"
        rules_dir.mkdir(parents=True, exist_ok=True)
        copies = []
        for n, path in enumerate(self.rules):
            copy = rules_dir / f"{n}-{path.name}"
            shutil.copyfile(path, copy)
            copy.chmod(0o644)
            copies.append(str(copy))
        # JSON is YAML: no YAML writer needed.
        config = {
            "global": {
                "scrape_interval": f"{int(self.scrape_interval * 1000)}ms",
                "scrape_timeout": f"{int(self.scrape_interval * 1000)}ms",
                "evaluation_interval": f"{int(self.evaluation_interval * 1000)}ms",
            },
            "rule_files": copies,
            "scrape_configs": [
                {"job_name": self.job, "static_configs": [{"targets": self.targets}]}
            ],
        }
        path = self.base_dir / "prometheus.yml"
        path.write_text(json.dumps(config, indent=2) + "\n")
        path.chmod(0o644)
        return path

    def start(self) -> None:
        """Start the server and wait until it is ready; raises StackError with its log."""
        binary = find_tool("prometheus")
        self.base_dir.mkdir(parents=True, exist_ok=True)
        config = self._write_config()
        data = self.base_dir / "data"
        data.mkdir(exist_ok=True)
        user = _run_as()
        self.log_path.touch()
        if user is not None:
            for path in (data, self.log_path):
                os.chown(path, user.pw_uid, user.pw_gid)
            grant_search(self.base_dir, user, config)
        (self.port,) = free_ports(1)
        argv = [
            str(binary),
            f"--config.file={config}",
            f"--storage.tsdb.path={data}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--storage.tsdb.retention.time=1d",
            "--log.level=warn",
        ]
        with self.log_path.open("ab") as log:
            self._proc = spawn(argv, cwd=self.base_dir, stdout=log, user=user)
        failure = wait_ready(
            self._proc,
            self._probe,
            deadline=time.monotonic() + _START_TIMEOUT_S,
            interval=0.1,
        )
        if failure is None:
            return
        if failure.code is not None:
            raise StackError(f"prometheus exited ({failure.code}) at start:\n{tail(self.log_path)}")
        self.stop()
        raise StackError(f"prometheus not ready within {_START_TIMEOUT_S}s:\n{tail(self.log_path)}")

    def _probe(self) -> str | None:
        try:
            with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:  # noqa: S310
                return None if r.status == 200 else f"HTTP {r.status}"
        except (urllib.error.URLError, OSError) as exc:
            return str(exc)

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s)."""
        self._terminate(10.0)

    # --- the HTTP API -------------------------------------------------------------------------

    def api(self, path: str, **params: str) -> Any:
        """GET ``/api/v1/<path>``; returns its ``data``, raises StackError on an error."""
        query = urllib.parse.urlencode(params)
        url = f"{self.url}/api/v1/{path}" + (f"?{query}" if query else "")
        try:
            with urllib.request.urlopen(url, timeout=10) as r:  # noqa: S310
                body = json.load(r)
        except urllib.error.HTTPError as e:
            raise StackError(f"prometheus {path}: HTTP {e.code}: {e.read()[:500]!r}") from None
        if body.get("status") != "success":
            raise StackError(f"prometheus {path}: {body}")
        return body["data"]

    def query(self, promql: str) -> list[dict[str, Any]]:
        """An instant query's vector: ``[{"metric": {...}, "value": [t, "v"]}, ...]``."""
        data = self.api("query", query=promql)
        result = data["result"]
        assert isinstance(result, list)
        return result

    def value(self, promql: str) -> float | None:
        """The value of a query that returns one series (None: no series)."""
        result = self.query(promql)
        if not result:
            return None
        if len(result) > 1:
            raise StackError(f"{promql!r} returned {len(result)} series, expected one")
        return float(result[0]["value"][1])

    def alerts(self) -> list[dict[str, Any]]:
        """Active alerts (pending and firing): ``[{"labels": {...}, "state": ...}, ...]``."""
        alerts = self.api("alerts")["alerts"]
        assert isinstance(alerts, list)
        return alerts

    def targets_up(self) -> bool:
        """Whether every scrape target's last scrape succeeded."""
        active = self.api("targets")["activeTargets"]
        return bool(active) and all(t.get("health") == "up" for t in active)
