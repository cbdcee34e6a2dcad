"""An OAUTHBEARER token provider for the relay (``NOTIFY_OUTBOX_KAFKA_SASL_OAUTH_TOKEN_PROVIDER
=examples.secured_kafka.oidc_token:token``): an access token from an OpenID Connect provider
by the client-credentials grant, cached until shortly before it expires (the relay asks at
every connection's authentication).

Configured by ``OIDC_TOKEN_URL``, ``OIDC_CLIENT_ID`` and ``OIDC_CLIENT_SECRET_FILE`` (or
``OIDC_CLIENT_SECRET``); optional ``OIDC_SCOPE``. Needs httpx.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import httpx

# Renew this long before the provider's expiry: a connection may authenticate just before.
_EARLY_S = 30.0

_cached: tuple[str, float] | None = None  # (token, monotonic time it is renewed at)
_lock: asyncio.Lock | None = None


def _secret() -> str:
    path = os.environ.get("OIDC_CLIENT_SECRET_FILE")
    if path:
        return Path(path).read_text().rstrip("\n")
    return os.environ["OIDC_CLIENT_SECRET"]


async def _fetch() -> tuple[str, float]:
    form = {"grant_type": "client_credentials"}
    if scope := os.environ.get("OIDC_SCOPE"):
        form["scope"] = scope
    async with httpx.AsyncClient(timeout=10) as client:
        response = await client.post(
            os.environ["OIDC_TOKEN_URL"],
            data=form,
            auth=(os.environ["OIDC_CLIENT_ID"], _secret()),
        )
    # Raises for a refusal: the relay says the token provider failed, and why.
    response.raise_for_status()
    body = response.json()
    lifetime = float(body.get("expires_in", 300))
    return str(body["access_token"]), time.monotonic() + max(0.0, lifetime - _EARLY_S)


async def token() -> str:
    """The current access token, fetched again once it is close to its expiry."""
    global _cached, _lock
    if _lock is None:
        _lock = asyncio.Lock()
    async with _lock:  # connections authenticating together share one fetch
        if _cached is None or time.monotonic() >= _cached[1]:
            _cached = await _fetch()
        return _cached[0]
