"""Log output of the command line: text (the default) or JSON, one object per line, with
secrets redacted in both.

``NOTIFY_OUTBOX_LOG_FORMAT=json`` makes every record one JSON object::

    {"time": "2026-11-23T06:59:01.123Z", "level": "WARNING", "logger": "notify_outbox.relay",
     "message": "Kafka available again after 3.2s; ...", "dependency": "Kafka",
     "outage_seconds": 3.2, "rows_given_back": 0, "rows_pending": 12}

Fields given with ``extra=`` (row ids, topic, attempts, outage duration) become keys of their
own. The library itself configures no handler (embedding applications own their logging);
``JsonFormatter`` and ``Redactor`` are public so they can use them too. ``redact`` takes the
secrets of a settings object out of a message that comes from a library (a connection error).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import IO, TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit

from .errors import ConfigurationError

if TYPE_CHECKING:
    from .settings import DatabaseSettings

__all__ = [
    "JsonFormatter",
    "RedactingFormatter",
    "Redactor",
    "configure_logging",
    "redact",
    "secrets_from_env",
]

LogFormat = Literal["text", "json"]
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# Attributes every LogRecord has: anything else on a record came from ``extra=``.
_RECORD_ATTRS = frozenset(
    vars(logging.LogRecord("", 0, "", 0, "", None, None)).keys()
    | {"message", "asctime", "taskName"}
)
# user:password@ in any URL (a DSN quoted by a library's error message).
_URL_PASSWORD = re.compile(r"(?P<head>\b[a-z][a-z0-9+.-]*://[^:/@\s]*):[^@\s]*@", re.IGNORECASE)
# Shorter secrets would turn ordinary words into "***"; a password that short still never
# shows inside a URL (the pattern above).
_MIN_SECRET = 4


class Redactor:
    """Replaces known secret values, and the password of any URL, by ``***``."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        # Longest first, so a DSN is replaced whole before its password alone is looked for.
        self._secrets = sorted({s for s in secrets if len(s) >= _MIN_SECRET}, key=len, reverse=True)

    def __call__(self, text: str) -> str:
        # URLs first, so that a DSN keeps its user and host (useful) and loses its password.
        text = _URL_PASSWORD.sub(r"\g<head>:***@", text)
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def deep(self, value: Any) -> Any:
        """``value`` with every string inside it (dict keys and values, list items) redacted."""
        if isinstance(value, str):
            return self(value)
        if isinstance(value, Mapping):
            return {self.deep(str(k)): self.deep(v) for k, v in value.items()}
        if isinstance(value, list | tuple | set | frozenset):
            return [self.deep(v) for v in value]
        return value


def secrets_from_env(*extra: str | None, env: Mapping[str, str] | None = None) -> list[str]:
    """The secrets the command line may know: every ``NOTIFY_OUTBOX_*DSN`` (and its password)
    and ``NOTIFY_OUTBOX_*PASSWORD*`` variable, or the file its ``*_FILE`` variable names, plus
    ``extra`` DSNs (a ``--dsn`` flag)."""
    source = os.environ if env is None else env
    ours = [(k, v) for k, v in source.items() if k.startswith("NOTIFY_OUTBOX_")]
    # A secret given through a file (NOTIFY_OUTBOX_<NAME>_FILE, settings.py) is as secret.
    for key, path in list(ours):
        name = key.removesuffix("_FILE")
        if name != key and path and ("PASSWORD" in name or name.endswith("DSN")):
            with (
                contextlib.suppress(OSError, UnicodeDecodeError),
                open(path, encoding="utf-8") as f,
            ):
                ours.append((name, f.read().rstrip("\r\n")))
    values = [v for k, v in ours if "PASSWORD" in k and not k.endswith("_FILE")]
    for dsn in (*(v for k, v in ours if k.endswith("DSN")), *extra):
        if not dsn:
            continue
        values.append(dsn)
        # The password as a URL parser reads it, and as written before the last "@" (they
        # differ when the password holds an unencoded "/", "?" or "#": hide both).
        values.append(dsn.split("://", 1)[-1].rpartition("@")[0].partition(":")[2])
        with contextlib.suppress(ValueError):  # a port that is no number
            values.append(urlsplit(dsn).password or "")
    return [v for v in values if v]


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_jsonable(v) for v in value]
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``time`` (ISO-8601, UTC, milliseconds), ``level``,
    ``logger``, ``message``, then every ``extra=`` field, and ``exception`` / ``stack`` when
    present. An extra field whose name is taken is kept as ``extra_<name>``."""

    def __init__(self, redactor: Redactor | None = None) -> None:
        super().__init__()
        self._redact = redactor or Redactor()

    def format(self, record: logging.LogRecord) -> str:
        when = datetime.fromtimestamp(record.created, UTC)
        doc: dict[str, Any] = {
            "time": when.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name, value in record.__dict__.items():
            if name in _RECORD_ATTRS or name.startswith("_"):
                continue
            doc[f"extra_{name}" if name in doc else name] = _jsonable(value)
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            doc["exception"] = record.exc_text
        if record.stack_info:
            doc["stack"] = self.formatStack(record.stack_info)
        # Redacted field by field, before encoding: a secret with a quote or a backslash
        # would no longer match once JSON-escaped.
        return json.dumps(self._redact.deep(doc), ensure_ascii=False)


class RedactingFormatter(logging.Formatter):
    """The text format, with secrets redacted from the whole line (traceback included)."""

    def __init__(self, fmt: str = TEXT_FORMAT, redactor: Redactor | None = None) -> None:
        super().__init__(fmt)
        self._redact = redactor or Redactor()

    def format(self, record: logging.LogRecord) -> str:
        return self._redact(super().format(record))


class _CliHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Marks the handler ``configure_logging`` installed, so a second call replaces it."""


def configure_logging(
    level: str,
    log_format: str | None = None,
    *,
    secrets: Iterable[str] = (),
    stream: IO[str] | None = None,
) -> logging.Handler | None:
    """Log to ``stream`` (stderr) at ``level`` in ``log_format`` (``text`` or ``json``; None
    or empty: text), like ``logging.basicConfig``: nothing is installed when the root logger
    already has handlers of someone else's (an application, pytest). Returns the handler.

    Raises ConfigurationError (one line) for an unknown level or format."""
    chosen = (log_format or "text").strip().lower()
    if chosen not in ("text", "json"):
        raise ConfigurationError(
            f"NOTIFY_OUTBOX_LOG_FORMAT must be text or json (got {log_format!r})"
        )
    numeric = logging.getLevelName(level.strip().upper())
    if not isinstance(numeric, int):
        raise ConfigurationError(
            f"--log-level must be DEBUG, INFO, WARNING or ERROR (got {level!r})"
        )
    root = logging.getLogger()
    ours = [h for h in root.handlers if isinstance(h, _CliHandler)]
    if len(ours) != len(root.handlers):
        return None
    for handler in ours:
        root.removeHandler(handler)
    redactor = Redactor(secrets)
    handler = _CliHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(
        JsonFormatter(redactor) if chosen == "json" else RedactingFormatter(redactor=redactor)
    )
    root.addHandler(handler)
    root.setLevel(numeric)
    return handler


def redact(text: str, settings: DatabaseSettings) -> str:
    """``text`` with every secret of ``settings`` replaced by ``***`` (defence in depth for
    messages that come from libraries, such as connection errors)."""
    dsns = [settings.dsn, getattr(settings, "listen_dsn", None)]
    secrets = [
        *dsns,
        getattr(settings, "kafka_sasl_password", None),
        getattr(settings, "kafka_ssl_password", None),
    ]
    for secret in secrets:
        if secret is not None and secret.get_secret_value():
            text = text.replace(secret.get_secret_value(), "***")
    for dsn in dsns:
        if dsn is None:
            continue
        try:
            password = urlsplit(dsn.get_secret_value()).password
        except ValueError:
            password = None
        if password:
            text = text.replace(password, "***")
    return text
