"""A secured single-node KRaft broker: SASL_SSL (SCRAM-SHA-512 and PLAIN), mutual TLS, ACLs.

Beside the plain ``KafkaBroker`` (same jars, same lifecycle), for the tests of a relay that
talks to an enterprise cluster (issue #33). Three listeners, all on 127.0.0.1:

- ``SASL_SSL``: TLS (server certificate only) then SASL, SCRAM-SHA-512, PLAIN or OAUTHBEARER
  (unsecured JWTs: Kafka's test validator);
- ``MTLS``: TLS with a client certificate required; also the inter-broker listener;
- ``CONTROLLER``: TLS with the broker's own certificate as its client certificate;
- ``MISMATCH``: as ``SASL_SSL`` (SCRAM-SHA-512), but its certificate, signed by the same CA,
  names another host (``elsewhere.invalid``): a client that verifies hostnames must refuse it.

The standard authorizer denies whatever no ACL allows (``allow.everyone.if.no.acl.found`` is
false). Super users: ``broker`` (its own certificate, for the controller and inter-broker
traffic) and ``admin`` (SCRAM user and client certificate alike, for the test harness).
A certificate's principal is its CN (``ssl.principal.mapping.rules``), so ACLs name
``User:relaymtls`` rather than a whole distinguished name. SCRAM users are created when the
storage is formatted; PLAIN users live in the listener's JAAS configuration.
"""

from __future__ import annotations

import secrets
import ssl
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from devstack._common import StackError, free_ports, read_json
from devstack.certs import CertificateAuthority, IssuedCert
from devstack.kafka import KafkaBroker, _port_free, probe_metadata

__all__ = ["ADMIN", "MTLS_CLIENT", "PLAIN_USER", "SCRAM_USER", "SecuredKafkaBroker"]

ADMIN = "admin"  # super user: SCRAM-SHA-512 password, and a client certificate
SCRAM_USER = "relayscram"  # SCRAM-SHA-512, no ACL of its own
PLAIN_USER = "relayplain"  # PLAIN, no ACL of its own
MTLS_CLIENT = "relaymtls"  # a client certificate (key encrypted with a password), no ACL
_BROKER = "broker"
_ELSEWHERE = "broker-elsewhere"  # the MISMATCH listener's certificate
_HOSTS = ("localhost", "127.0.0.1")
_AUTHORIZER = "org.apache.kafka.metadata.authorizer.StandardAuthorizer"


def _password() -> str:
    # Hex: nothing that the JAAS or the --add-scram syntax would have to quote.
    return secrets.token_hex(16)


class SecuredKafkaBroker(KafkaBroker):
    """A ``KafkaBroker`` with the listeners, certificates, users and authorizer above.

    ``port`` is the SASL_SSL listener's, ``mtls_port`` the mutual TLS one's. The
    certificates are under ``base_dir/tls``, made at the first start; the passwords are
    kept in the state file so that a restart on the same storage still matches them.
    """

    def __init__(
        self,
        base_dir: Path,
        *,
        extra_config: Mapping[str, str] | None = None,
        heap: str = "512m",
    ) -> None:
        super().__init__(base_dir, extra_config=extra_config, heap=heap)
        state = read_json(self.base_dir / "devstack-kafka.json")
        saved = [state.get("mtls_port"), state.get("mismatch_port")]
        fresh = iter(free_ports(2, avoid=[self.port, self.controller_port]))
        self.mtls_port: int = saved[0] if isinstance(saved[0], int) else next(fresh)
        self.mismatch_port: int = saved[1] if isinstance(saved[1], int) else next(fresh)
        saved_secrets = state.get("secrets")
        kept: dict[str, Any] = saved_secrets if isinstance(saved_secrets, dict) else {}
        self.passwords: dict[str, str] = {
            name: str(kept.get(name) or _password())
            for name in (ADMIN, SCRAM_USER, PLAIN_USER, MTLS_CLIENT, "keystore")
        }
        self.tls_dir = self.base_dir / "tls"
        self.ca = CertificateAuthority(self.tls_dir)
        # A CA nobody trusts, for a client that must fail to verify the broker.
        self.unknown_ca_file = CertificateAuthority(
            self.tls_dir / "unknown", "an unknown CA"
        ).cert_file

    def __repr__(self) -> str:
        return (
            f"SecuredKafkaBroker(base_dir={str(self.base_dir)!r}, sasl_ssl={self.port}, "
            f"mtls={self.mtls_port}, mismatch={self.mismatch_port})"
        )

    @property
    def sasl_ssl_bootstrap(self) -> str:
        """host:port of the SASL_SSL listener (SCRAM-SHA-512 and PLAIN)."""
        return f"127.0.0.1:{self.port}"

    @property
    def mtls_bootstrap(self) -> str:
        """host:port of the mutual TLS listener."""
        return f"127.0.0.1:{self.mtls_port}"

    @property
    def mismatch_bootstrap(self) -> str:
        """host:port of a SASL_SSL listener whose certificate names another host."""
        return f"127.0.0.1:{self.mismatch_port}"

    @property
    def ca_file(self) -> Path:
        """The CA certificate (PEM) that verifies the broker."""
        return self.ca.cert_file

    def client_cert(self, name: str) -> IssuedCert:
        """The client certificate of ``name`` (``ADMIN`` or ``MTLS_CLIENT``)."""
        password = self.passwords[MTLS_CLIENT] if name == MTLS_CLIENT else None
        return IssuedCert(
            name, self.tls_dir / f"{name}.pem", self.tls_dir / f"{name}.key", password
        )

    def start(self, timeout: float = 120.0) -> None:
        """Make the certificates if they are missing, then start as ``KafkaBroker`` does."""
        if self.is_running():
            return
        for port in (self.mtls_port, self.mismatch_port):
            if not _port_free(port):
                raise StackError(
                    f"port 127.0.0.1:{port} is already in use; stop whatever listens there "
                    f"or remove {self.base_dir / 'devstack-kafka.json'} to pick new ports"
                )
        if not all((self.tls_dir / f"{n}.p12").is_file() for n in (_BROKER, _ELSEWHERE)):
            self._make_certificates()
        super().start(timeout)

    # -- internals ---------------------------------------------------------

    def _make_certificates(self) -> None:
        broker = self.ca.issue(_BROKER, hosts=_HOSTS)
        self.ca.pkcs12(broker, self.tls_dir / f"{_BROKER}.p12", self.passwords["keystore"])
        elsewhere = self.ca.issue(_ELSEWHERE, hosts=["elsewhere.invalid"])
        self.ca.pkcs12(elsewhere, self.tls_dir / f"{_ELSEWHERE}.p12", self.passwords["keystore"])
        self.ca.issue(ADMIN)
        self.ca.issue(MTLS_CLIENT, key_password=self.passwords[MTLS_CLIENT])

    def _state(self) -> dict[str, Any]:
        return {
            **super()._state(),
            "mtls_port": self.mtls_port,
            "mismatch_port": self.mismatch_port,
            "secrets": self.passwords,
        }

    def _config(self) -> dict[str, str]:
        config = super()._config()
        listeners = (
            f"SASL_SSL://127.0.0.1:{self.port},MTLS://127.0.0.1:{self.mtls_port},"
            f"MISMATCH://127.0.0.1:{self.mismatch_port}"
        )
        keystore_password = self.passwords["keystore"]
        plain_jaas = (
            "org.apache.kafka.common.security.plain.PlainLoginModule required "
            f'user_{PLAIN_USER}="{self.passwords[PLAIN_USER]}";'
        )
        config.update(
            {
                "listeners": f"{listeners},CONTROLLER://127.0.0.1:{self.controller_port}",
                "advertised.listeners": listeners,
                "listener.security.protocol.map": (
                    "CONTROLLER:SSL,MTLS:SSL,SASL_SSL:SASL_SSL,MISMATCH:SASL_SSL"
                ),
                "inter.broker.listener.name": "MTLS",
                # The broker's identity, towards clients and towards its own controller.
                "ssl.keystore.type": "PKCS12",
                "ssl.keystore.location": str(self.tls_dir / f"{_BROKER}.p12"),
                "ssl.keystore.password": keystore_password,
                "ssl.key.password": keystore_password,
                "ssl.truststore.type": "PEM",
                "ssl.truststore.location": str(self.ca.cert_file),
                "ssl.client.auth": "required",
                "listener.name.sasl_ssl.ssl.client.auth": "none",
                "ssl.principal.mapping.rules": "RULE:^CN=([^,]+)$/$1/,DEFAULT",
                "sasl.enabled.mechanisms": "SCRAM-SHA-512,PLAIN,OAUTHBEARER",
                # OAUTHBEARER with Kafka's unsecured validator (the default without a server
                # callback handler): unsigned JWTs, the principal is their "sub" claim.
                "listener.name.sasl_ssl.oauthbearer.sasl.jaas.config": (
                    "org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule "
                    'required unsecuredLoginStringClaim_sub="broker";'
                ),
                "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config": (
                    "org.apache.kafka.common.security.scram.ScramLoginModule required;"
                ),
                "listener.name.sasl_ssl.plain.sasl.jaas.config": plain_jaas,
                "listener.name.mismatch.ssl.client.auth": "none",
                "listener.name.mismatch.ssl.keystore.type": "PKCS12",
                "listener.name.mismatch.ssl.keystore.location": str(
                    self.tls_dir / f"{_ELSEWHERE}.p12"
                ),
                "listener.name.mismatch.ssl.keystore.password": keystore_password,
                "listener.name.mismatch.ssl.key.password": keystore_password,
                "listener.name.mismatch.sasl.enabled.mechanisms": "SCRAM-SHA-512",
                "listener.name.mismatch.scram-sha-512.sasl.jaas.config": (
                    "org.apache.kafka.common.security.scram.ScramLoginModule required;"
                ),
                "authorizer.class.name": _AUTHORIZER,
                "allow.everyone.if.no.acl.found": "false",
                "super.users": f"User:{_BROKER};User:{ADMIN}",
            }
        )
        config.update(self.extra_config)
        return config

    def _format_args(self) -> list[str]:
        return [
            arg
            for user in (ADMIN, SCRAM_USER)
            for arg in (
                "--add-scram",
                f"SCRAM-SHA-512=[name={user},password={self.passwords[user]}]",
            )
        ]

    def client_ssl_context(self, name: str = ADMIN) -> ssl.SSLContext:
        """A TLS context that verifies the broker and presents ``name``'s certificate."""
        context = ssl.create_default_context(cafile=str(self.ca_file))
        cert = self.client_cert(name)
        context.load_cert_chain(cert.cert_file, cert.key_file, cert.key_password)
        return context

    def _probe(self) -> str | None:
        try:
            cluster_id, brokers = probe_metadata(
                self.mtls_port, timeout=2.0, ssl_context=self.client_ssl_context()
            )
        except (OSError, struct.error, UnicodeDecodeError) as exc:
            return f"{type(exc).__name__}: {exc}"
        if cluster_id == self.cluster_id and brokers:
            return None
        return f"cluster {cluster_id!r} with brokers {brokers}"
