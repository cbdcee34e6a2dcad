"""A small asyncio client of a Confluent-compatible Schema Registry (Confluent's, Apicurio's
``/apis/ccompat/v7``, Karapace), with the errors the relay needs to tell apart.

Why not ``confluent-kafka``'s client: the relay must tell an outage (rows wait, no attempt
counted) from a refusal (a setting to fix, exit 2) from a missing subject (the row is retried
and dead-lettered with the reason), never print a password, and run on the relay's event
loop; four REST calls do that in a page. The bytes it helps write are Confluent's wire format,
which the tests decode with ``confluent-kafka``'s own deserializers.
"""

from __future__ import annotations

import json
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlsplit, urlunsplit

from notify_outbox.core.errors import ConfigurationError, NotifyOutboxError

__all__ = [
    "RegisteredSchema",
    "RegistryClient",
    "RegistryError",
    "RegistryRefused",
    "RegistryUnavailable",
    "SchemaIncompatible",
    "SubjectNotFound",
]

if TYPE_CHECKING:
    import httpx

_CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"


class RegistryError(NotifyOutboxError):
    """The Schema Registry answered with an error this client does not classify further."""


class RegistryUnavailable(RegistryError):
    """The registry did not answer (refused, timed out, 5xx): try again later."""


class RegistryRefused(RegistryError, ConfigurationError):
    """The registry refused the client: credentials (401/403) or TLS. No retry cures it."""


class SubjectNotFound(RegistryError):
    """No schema is registered under the subject (or not that version or id)."""


class SchemaIncompatible(RegistryError):
    """The registry refused a schema as incompatible with the subject's earlier versions."""


@dataclass(frozen=True)
class RegisteredSchema:
    """A schema as the registry holds it. ``schema_type``: ``AVRO``, ``JSON`` or ``PROTOBUF``."""

    id: int
    schema: str
    schema_type: str = "AVRO"
    subject: str | None = None
    version: int | None = None


def _public_url(url: str) -> str:
    """``url`` without user information, for messages."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def _tls_cause(error: BaseException) -> ssl.SSLError | None:
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, ssl.SSLError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


class RegistryClient:
    """Confluent Schema Registry REST calls over one ``httpx.AsyncClient``.

    ``url``: the API's base (for Apicurio ``http://host:8080/apis/ccompat/v7``). ``username``
    and ``password``: HTTP basic authentication (Confluent Cloud's API key and secret).
    ``cafile``: the CA that verifies an ``https`` registry (else the system's).
    """

    def __init__(
        self,
        url: str,
        *,
        username: str | None = None,
        password: str | None = None,
        cafile: Path | str | None = None,
        timeout: float = 5.0,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigurationError(
                "Schema Registry URL must be http(s)://host[:port][/path], "
                f"not {_public_url(url)!r}"
            )
        if parts.username or parts.password:
            raise ConfigurationError(
                "put the Schema Registry's user and password in their own settings, not in its URL"
            )
        self.url = url.rstrip("/")
        self._auth = (username, password or "") if username is not None else None
        verify: ssl.SSLContext | bool = True
        if cafile is not None:
            try:
                verify = ssl.create_default_context(cafile=str(cafile))
            except (OSError, ssl.SSLError) as e:
                raise ConfigurationError(
                    f"Schema Registry CA file {cafile} cannot be read as a PEM certificate: {e}"
                ) from None
        self._verify = verify
        self._timeout = timeout
        self._http: httpx.AsyncClient | None = None

    def _client(self) -> httpx.AsyncClient:
        # Made on first use: on the loop that uses it. httpx is imported here, so that the
        # producer API can name this package's types without the extra installed.
        import httpx

        if self._http is None:
            self._http = httpx.AsyncClient(
                base_url=self.url,
                auth=self._auth,
                verify=self._verify,
                timeout=self._timeout,
                headers={"Accept": _CONTENT_TYPE},
            )
        return self._http

    async def aclose(self) -> None:
        """Close the connections."""
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def _call(self, method: str, path: str, body: Any = None) -> Any:
        import httpx

        where = _public_url(self.url)
        try:
            response = await self._client().request(
                method,
                path,
                content=None if body is None else json.dumps(body),
                headers=None if body is None else {"Content-Type": _CONTENT_TYPE},
            )
        except httpx.HTTPError as e:
            tls = _tls_cause(e)
            if isinstance(tls, ssl.SSLCertVerificationError):
                raise RegistryRefused(
                    f"Schema Registry at {where}: TLS certificate not trusted "
                    f"({tls.verify_message}); set NOTIFY_OUTBOX_SCHEMA_REGISTRY_CAFILE to the "
                    "CA that signed it"
                ) from None
            raise RegistryUnavailable(
                f"Schema Registry at {where} unreachable ({type(e).__name__}: {e})"
            ) from None
        status = response.status_code
        if status < 300:
            return response.json()
        try:
            detail = response.json()
        except ValueError:
            detail = {}
        code = detail.get("error_code") if isinstance(detail, dict) else None
        message = detail.get("message") if isinstance(detail, dict) else None
        text = f"HTTP {status}" + (f", {message}" if message else "")
        if status in (401, 403):
            raise RegistryRefused(
                f"Schema Registry at {where} refused the client ({text}): check "
                "NOTIFY_OUTBOX_SCHEMA_REGISTRY_USERNAME and _PASSWORD"
            )
        if status == 404 and code in (40401, 40402, 40403, None):
            raise SubjectNotFound(text)
        if status == 409:
            raise SchemaIncompatible(f"Schema Registry at {where} refused the schema ({text})")
        if status >= 500 or status == 429:
            raise RegistryUnavailable(f"Schema Registry at {where} answered {text}")
        raise RegistryError(f"Schema Registry at {where} answered {text}")

    async def probe(self) -> None:
        """One cheap call (the subjects' list): raises what ``_call`` raises."""
        await self._call("GET", "/subjects")

    async def latest(self, subject: str) -> RegisteredSchema:
        """The subject's latest version. Raises ``SubjectNotFound`` when there is none."""
        try:
            found = await self._call("GET", f"/subjects/{quote(subject, safe='')}/versions/latest")
        except SubjectNotFound:
            raise SubjectNotFound(f"no schema registered under subject {subject!r}") from None
        return RegisteredSchema(
            id=int(found["id"]),
            schema=found["schema"],
            schema_type=found.get("schemaType") or "AVRO",
            subject=subject,
            version=found.get("version"),
        )

    async def by_id(self, schema_id: int) -> RegisteredSchema:
        """The schema with this global id (what a consumer reads from a record's prefix)."""
        try:
            found = await self._call("GET", f"/schemas/ids/{int(schema_id)}")
        except SubjectNotFound:
            raise SubjectNotFound(f"no schema with id {schema_id}") from None
        return RegisteredSchema(
            id=int(schema_id), schema=found["schema"], schema_type=found.get("schemaType") or "AVRO"
        )

    async def subjects_of(self, schema_id: int) -> set[str]:
        """The subjects under which the schema with this id is registered (none: an id the
        registry does not know)."""
        try:
            found = await self._call("GET", f"/schemas/ids/{int(schema_id)}/versions")
        except SubjectNotFound:
            return set()
        return {str(item["subject"]) for item in found}

    async def register(self, subject: str, schema: str, schema_type: str = "AVRO") -> int:
        """Register ``schema`` under ``subject`` (the registry checks compatibility) and
        return its id; the same schema again returns the same id."""
        body: dict[str, Any] = {"schema": schema}
        if schema_type != "AVRO":
            body["schemaType"] = schema_type
        found = await self._call("POST", f"/subjects/{quote(subject, safe='')}/versions", body)
        return int(found["id"])
