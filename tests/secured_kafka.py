"""The secured test broker (``devstack.kafka_secured``) as the tests use it: how each kind of
client connects to it, and the harness's super user creating topics and ACLs (issue #33).

aiokafka's admin client has no ACL calls, so ACLs go as raw CreateAcls requests through it
(its protocol classes have them); no JVM is started per ACL.
"""

from __future__ import annotations

import asyncio
import base64
import json
import ssl
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from aiokafka import ConsumerRecord
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.protocol.admin import CreateAclsRequest, DescribeAclsRequest

from devstack.kafka_secured import ADMIN, MTLS_CLIENT, PLAIN_USER, SCRAM_USER, SecuredKafkaBroker
from tests.support import consume, create_topics

__all__ = ["OAUTH_USER", "Client", "SecuredKafka", "unsecured_token"]

# How a relay connects: SASL_SSL with SCRAM-SHA-512, PLAIN or OAUTHBEARER, or a client
# certificate.
Client = Literal["scram", "plain", "oauth", "mtls"]
#: The "sub" of the tokens unsecured_token makes: the OAUTHBEARER relay's principal.
OAUTH_USER = "relay-oauth"


def unsecured_token() -> str:
    """An unsigned JWT (``alg: none``) for ``OAUTH_USER``, valid for an hour: what the broker's
    unsecured validator accepts. The OAUTHBEARER relays' token provider
    (``NOTIFY_OUTBOX_KAFKA_SASL_OAUTH_TOKEN_PROVIDER=tests.secured_kafka:unsecured_token``)."""

    def part(value: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(value).encode()).rstrip(b"=").decode()

    now = int(time.time())
    claims = {"sub": OAUTH_USER, "iat": now, "exp": now + 3600}
    return f"{part({'alg': 'none'})}.{part(claims)}."


Operation = Literal["READ", "WRITE", "DESCRIBE"]

# Kafka's protocol codes (org.apache.kafka.common.acl / resource).
_TOPIC = 2
_LITERAL = 3
_OPERATIONS: dict[Operation, int] = {"READ": 3, "WRITE": 4, "DESCRIBE": 8}
_DENY, _ALLOW = 2, 3
_ACL_VISIBLE_WITHIN = 30.0


@dataclass(frozen=True)
class SecuredKafka:
    """Where the secured broker listens and who may connect to it, with the harness's
    super-user operations (topics, ACLs, reading a topic)."""

    broker: SecuredKafkaBroker

    @property
    def sasl_ssl(self) -> str:
        """host:port of the SASL_SSL listener (SCRAM-SHA-512 and PLAIN users, OAUTHBEARER)."""
        return self.broker.sasl_ssl_bootstrap

    @property
    def mtls(self) -> str:
        """host:port of the listener that requires a client certificate."""
        return self.broker.mtls_bootstrap

    @staticmethod
    def principal(client: Client) -> str:
        """The ACL principal a relay connecting as ``client`` has."""
        user = {"scram": SCRAM_USER, "plain": PLAIN_USER, "oauth": OAUTH_USER, "mtls": MTLS_CLIENT}[
            client
        ]
        return f"User:{user}"

    def relay_settings(self, client: Client) -> dict[str, Any]:
        """``OutboxSettings`` fields (documented names only) for a relay connecting as
        ``client``, verifying the broker with the stack's CA."""
        b = self.broker
        if client == "mtls":
            cert = b.client_cert(MTLS_CLIENT)
            return {
                "kafka_bootstrap_servers": self.mtls,
                "kafka_security_protocol": "SSL",
                "kafka_ssl_cafile": b.ca_file,
                "kafka_ssl_certfile": cert.cert_file,
                "kafka_ssl_keyfile": cert.key_file,
                "kafka_ssl_password": cert.key_password,
            }
        if client == "oauth":
            return {
                "kafka_bootstrap_servers": self.sasl_ssl,
                "kafka_security_protocol": "SASL_SSL",
                "kafka_sasl_mechanism": "OAUTHBEARER",
                "kafka_sasl_oauth_token_provider": "tests.secured_kafka:unsecured_token",
                "kafka_ssl_cafile": b.ca_file,
            }
        user = SCRAM_USER if client == "scram" else PLAIN_USER
        return {
            "kafka_bootstrap_servers": self.sasl_ssl,
            "kafka_security_protocol": "SASL_SSL",
            "kafka_sasl_mechanism": "SCRAM-SHA-512" if client == "scram" else "PLAIN",
            "kafka_sasl_username": user,
            "kafka_sasl_password": b.passwords[user],
            "kafka_ssl_cafile": b.ca_file,
        }

    def relay_env(self, client: Client, **overrides: Any) -> dict[str, str]:
        """``relay_settings`` as the ``NOTIFY_OUTBOX_*`` variables of a relay process."""
        fields = {**self.relay_settings(client), **overrides}
        return {
            f"NOTIFY_OUTBOX_{name.upper()}": str(value)
            for name, value in fields.items()
            if value is not None
        }

    def admin_client(self) -> dict[str, Any]:
        """aiokafka client arguments for the harness's super user (SCRAM over SASL_SSL)."""
        return {
            "security_protocol": "SASL_SSL",
            "sasl_mechanism": "SCRAM-SHA-512",
            "sasl_plain_username": ADMIN,
            "sasl_plain_password": self.broker.passwords[ADMIN],
            "ssl_context": ssl.create_default_context(cafile=str(self.broker.ca_file)),
        }

    async def create_topic(self, prefix: str = "t", *, partitions: int = 3) -> str:
        """A fresh topic (as the super user), every partition led; returns its name."""
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        await create_topics(
            self.sasl_ssl, [name], partitions=partitions, client=self.admin_client()
        )
        return name

    async def acl(
        self,
        principal: str,
        topic: str,
        *operations: Operation,
        allow: bool = True,
    ) -> None:
        """Allow (or deny) ``principal`` the ``operations`` on ``topic`` (a literal name), and
        return once the broker's authorizer has them (KRaft applies an ACL after its metadata
        record is committed; a client in between would still be refused)."""
        permission = _ALLOW if allow else _DENY
        admin = AIOKafkaAdminClient(bootstrap_servers=self.sasl_ssl, **self.admin_client())
        try:
            async with asyncio.timeout(_ACL_VISIBLE_WITHIN):
                await admin.start()
                for op in operations:
                    request = CreateAclsRequest(
                        _TOPIC, topic, _LITERAL, principal, "*", _OPERATIONS[op], permission
                    )
                    response = await admin._send_request(request)
                    for code, message in response.creation_responses:
                        if code:
                            raise RuntimeError(f"Kafka refused the ACL {op} on {topic}: {message}")
                wanted = {(_OPERATIONS[op], permission) for op in operations}
                # DescribeAcls is answered from the broker's authorizer: ask until it has them.
                while True:
                    if wanted <= await _acls(admin, principal, topic):
                        break
                    await asyncio.sleep(0.05)
        finally:
            await admin.close()

    async def consume(
        self, topic: str, *, expect: int, within: float = 30.0
    ) -> tuple[list[ConsumerRecord[bytes, bytes]], int]:
        """``tests.support.consume`` as the super user."""
        return await consume(
            self.sasl_ssl, topic, expect=expect, within=within, client=self.admin_client()
        )


async def _acls(admin: AIOKafkaAdminClient, principal: str, topic: str) -> set[tuple[int, int]]:
    """(operation, permission) of the literal ACLs the broker has for ``principal`` on
    ``topic``. ANY (1) as the operation and the permission filters."""
    response = await admin._send_request(
        DescribeAclsRequest(_TOPIC, topic, _LITERAL, principal, "*", 1, 1)
    )
    if response.error_code:
        raise RuntimeError(f"DescribeAcls failed: {response.error_message}")
    found: set[tuple[int, int]] = set()
    for resource in response.resources:
        for _principal, _host, operation, permission in resource[-1]:
            found.add((operation, permission))
    return found
