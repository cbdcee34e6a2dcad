"""A tiny asyncio HTTP server for monitoring: ``/metrics`` (Prometheus), ``/livez`` (the event
loop answers) and ``/readyz`` (PostgreSQL, Kafka and the listener are fine), plus the client
side of ``notify-outbox healthcheck``.

It speaks just enough HTTP/1.1 for probes and scrapers: GET and HEAD, one request per
connection. No web framework: the relay should not carry one for three read-only endpoints.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Annotated, Protocol

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    disable_created_metrics,
    generate_latest,
)
from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from notify_outbox.core.errors import ConfigurationError
from notify_outbox.core.settings import format_validation_error
from notify_outbox.relay.fleet import Fleet

from .fleet_metrics import FleetMetrics
from .metrics import MonitoredRelay, Readiness, RelayMetrics

if TYPE_CHECKING:
    from notify_outbox.core.settings import OutboxSettings

__all__ = [
    "HttpSettings",
    "MonitoringServer",
    "healthcheck",
    "healthcheck_main",
    "serve_monitoring",
]

log = logging.getLogger("notify_outbox.http")

_READ_TIMEOUT = 5.0  # a client that sends no complete request within this is dropped
_MAX_HEADER_LINES = 100
# A scrape or probe waits this long for the table gauges, then answers with the last values.
_REFRESH_TIMEOUT = 3.0
_JSON = "application/json"
_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}


class Monitor(Protocol):
    """What the server reads: ``RelayMetrics`` (one relay) or ``FleetMetrics`` (a fleet)."""

    @property
    def registry(self) -> CollectorRegistry: ...
    @property
    def stale_database(self) -> bool: ...

    async def refresh(self) -> None:
        """Read the table gauges unless they are fresh."""
        ...

    def readiness(self) -> Readiness:
        """The answer of ``/readyz``."""
        ...

    def liveness(self) -> tuple[bool, float]:
        """Whether the event loop answers in time, and its lag."""
        ...


class MonitoringServer:
    """Serves ``/metrics``, ``/livez`` and ``/readyz`` of one relay (or fleet) on
    ``host:port`` (port 0: any free port, see ``port`` once started)."""

    def __init__(self, metrics: Monitor, host: str, port: int) -> None:
        self.metrics = metrics
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        """Bind and listen. Raises ConfigurationError, naming the setting, when the address
        cannot be had (a port in use, an address not of this host)."""
        try:
            self._server = await asyncio.start_server(self._handle, self.host, self.port)
        except OSError as e:
            why = "address already in use" if e.errno == errno.EADDRINUSE else e.strerror or e
            raise ConfigurationError(
                f"cannot serve /metrics on {self.host}:{self.port} "
                f"(NOTIFY_OUTBOX_HTTP_HOST / NOTIFY_OUTBOX_HTTP_PORT): {why}"
            ) from None
        self.port = int(self._server.sockets[0].getsockname()[1])
        log.info("serving /metrics, /livez and /readyz on http://%s:%d", self.host, self.port)

    async def close(self) -> None:
        """Stop listening and drop open connections."""
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(AttributeError):  # Python < 3.13 has no close_clients
                self._server.close_clients()  # type: ignore[attr-defined]
            await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(_READ_TIMEOUT):
                request = await reader.readline()
                for _ in range(_MAX_HEADER_LINES):
                    if (await reader.readline()).strip() == b"":
                        break
            parts = request.decode("latin-1").split()
            if len(parts) != 3 or not parts[2].startswith("HTTP/"):
                return  # not HTTP: just close
            method, target = parts[0], parts[1]
            status, content_type, body = await self._route(method, target.split("?", 1)[0])
            head = (
                f"HTTP/1.1 {status} {_REASONS[status]}\r\n"
                f"Content-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\n"
                "Cache-Control: no-store\r\n"
                "Connection: close\r\n\r\n"
            )
            writer.write(head.encode("latin-1") + (b"" if method == "HEAD" else body))
            await writer.drain()
        except (TimeoutError, OSError, ValueError, asyncio.IncompleteReadError):
            pass  # a client that went away or sent garbage: nothing to answer
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def _route(self, method: str, path: str) -> tuple[int, str, bytes]:
        if path not in ("/metrics", "/livez", "/readyz"):
            return 404, _JSON, _json({"error": f"no such endpoint {path}"})
        if method not in ("GET", "HEAD"):
            return 405, _JSON, _json({"error": f"{method} not allowed: use GET"})
        m = self.metrics
        if path == "/metrics" or (path == "/readyz" and m.stale_database):
            # /readyz: a fresh read of the gauges also tells whether PostgreSQL is back.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_REFRESH_TIMEOUT):
                    await m.refresh()
        if path == "/metrics":
            return 200, CONTENT_TYPE_LATEST, generate_latest(m.registry)
        if path == "/livez":
            alive, lag = m.liveness()
            body = {"status": "alive" if alive else "event loop stalled", "loop_lag_seconds": lag}
            return (200 if alive else 503), _JSON, _json(body)
        readiness = m.readiness()
        return (200 if readiness.ready else 503), _JSON, _json(readiness.as_json())


def _json(data: object) -> bytes:
    return (json.dumps(data, separators=(", ", ": ")) + "\n").encode()


@contextlib.asynccontextmanager
async def serve_monitoring(
    relay: MonitoredRelay | Fleet, settings: OutboxSettings
) -> AsyncIterator[None]:
    """The daemon's monitoring server while the body runs, if ``http_port`` is set (else
    nothing). Raises ConfigurationError at once when the port cannot be had."""
    if settings.http_port is None:
        yield
        return
    # Counters' *_created series double the output for nothing a dashboard uses (the daemon
    # owns its process; an embedding application keeps its own choice).
    disable_created_metrics()  # type: ignore[no-untyped-call]
    metrics: RelayMetrics | FleetMetrics = (
        FleetMetrics(relay) if isinstance(relay, Fleet) else RelayMetrics(relay)
    )
    server = MonitoringServer(metrics, settings.http_host, settings.http_port)
    await server.start()
    metrics.start(refresh=False)  # the gauges are read when scraped, at most every 5 s
    try:
        yield
    finally:
        await server.close()
        await metrics.aclose()


# --- notify-outbox healthcheck ----------------------------------------------------------------


class HttpSettings(BaseSettings):
    """Where the local daemon's monitoring server listens (the same variables as
    ``OutboxSettings``; nothing else is needed, so a probe needs no DSN)."""

    model_config = SettingsConfigDict(
        env_prefix="NOTIFY_OUTBOX_", extra="ignore", hide_input_in_errors=True
    )

    http_host: str = "127.0.0.1"
    http_port: Annotated[int | None, Field(ge=1, le=65535)] = None


def healthcheck(url: str | None = None, *, timeout: float = 5.0) -> tuple[int, str]:
    """Ask the local daemon's ``/readyz``: exit code 0 (ready) or 1 (not ready, or no answer),
    and one line saying why. ``url`` defaults to ``NOTIFY_OUTBOX_HTTP_HOST`` /
    ``NOTIFY_OUTBOX_HTTP_PORT``. Raises ConfigurationError when neither says where."""
    if url is None:
        try:
            s = HttpSettings()  # from the environment
        except ValidationError as e:
            raise ConfigurationError(format_validation_error(e)) from None
        if s.http_port is None:
            raise ConfigurationError(
                "NOTIFY_OUTBOX_HTTP_PORT is not set: the relay serves /readyz only when it is "
                "(or pass --url)"
            )
        # A server bound to every interface is reached on loopback.
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(  # noqa: S104
            s.http_host, s.http_host
        )
        host = f"[{host}]" if ":" in host else host
        url = f"http://{host}:{s.http_port}/readyz"
    if not url.startswith(("http://", "https://")):
        raise ConfigurationError(f"--url must start with http:// or https://, got {url!r}")
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310
            return 0, response.read().decode("utf-8", "replace").strip()
    except urllib.error.HTTPError as e:
        return 1, e.read().decode("utf-8", "replace").strip() or f"HTTP {e.code}"
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        return 1, f"no answer from {url}: {reason}"


def healthcheck_main(url: str | None, timeout: float) -> int:
    """``notify-outbox healthcheck``: prints /readyz's answer (or why there is none) and
    returns the exit code."""
    code, line = healthcheck(url, timeout=timeout)
    print(line if code == 0 else f"notify-outbox: not ready: {line}")
    return code
