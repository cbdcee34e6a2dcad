"""A throwaway certificate authority and the certificates a secured test broker needs.

Everything is made with ``cryptography`` in PEM, plus a PKCS#12 keystore for the broker
(what a JVM reads without conversion). Nothing here is fit for production: the keys live
unencrypted (or encrypted with a password written beside them) in the test directory.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import pkcs12
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["CertificateAuthority", "IssuedCert"]

# Long enough for any test session, short enough that a leaked file is soon worthless.
_VALIDITY = datetime.timedelta(days=2)
# A clock a little behind the machine's (another process, a VM) must still accept them.
_BACKDATE = datetime.timedelta(minutes=5)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_private(path: Path, data: bytes) -> None:
    """Write a key file readable by its owner only."""
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)
    path.write_bytes(data)


@dataclass(frozen=True)
class IssuedCert:
    """A certificate and its key, as PEM files (the key encrypted if ``key_password``)."""

    common_name: str
    cert_file: Path
    key_file: Path
    key_password: str | None = None


class CertificateAuthority:
    """A self-signed CA whose certificate is ``cert_file``; ``issue`` signs leaf certificates."""

    def __init__(self, directory: Path, common_name: str = "notify-outbox test CA") -> None:
        self.directory = directory
        self.cert_file = directory / "ca.pem"
        self._key_file = directory / "ca.key"
        directory.mkdir(parents=True, exist_ok=True)
        if self.cert_file.is_file() and self._key_file.is_file():
            loaded = serialization.load_pem_private_key(self._key_file.read_bytes(), None)
            assert isinstance(loaded, ec.EllipticCurvePrivateKey)
            self._key = loaded
            self._cert = x509.load_pem_x509_certificate(self.cert_file.read_bytes())
            return
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name))
            .issuer_name(_name(common_name))
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _BACKDATE)
            .not_valid_after(now + _VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(self._key.public_key()), critical=False
            )
            .sign(self._key, hashes.SHA256())
        )
        _write_private(self._key_file, _pem_key(self._key, None))
        self.cert_file.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))

    def issue(
        self,
        common_name: str,
        *,
        hosts: Sequence[str] = (),
        key_password: str | None = None,
    ) -> IssuedCert:
        """Sign a certificate for ``common_name`` (a client's principal, or a server) with
        ``hosts`` (DNS names or IP addresses) as its subjectAltName, which is what hostname
        verification checks. Written as ``<common_name>.pem`` and ``<common_name>.key``."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _BACKDATE)
            .not_valid_after(now + _VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            # Both usages: the broker's certificate is also its client certificate towards
            # its own controller listener.
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                critical=False,
            )
        )
        if hosts:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([_general_name(h) for h in hosts]), critical=False
            )
        cert = builder.sign(self._key, hashes.SHA256())
        issued = IssuedCert(
            common_name,
            self.directory / f"{common_name}.pem",
            self.directory / f"{common_name}.key",
            key_password,
        )
        issued.cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_private(issued.key_file, _pem_key(key, key_password))
        return issued

    def pkcs12(self, issued: IssuedCert, path: Path, password: str) -> Path:
        """Write ``issued`` (key, certificate and this CA) as a PKCS#12 keystore for a JVM."""
        key = serialization.load_pem_private_key(
            issued.key_file.read_bytes(),
            issued.key_password.encode() if issued.key_password else None,
        )
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        cert = x509.load_pem_x509_certificate(issued.cert_file.read_bytes())
        encryption = (
            serialization.PrivateFormat.PKCS12.encryption_builder()
            .kdf_rounds(10_000)
            .key_cert_algorithm(pkcs12.PBES.PBESv2SHA256AndAES256CBC)
            .hmac_hash(hashes.SHA256())
            .build(password.encode())
        )
        data = pkcs12.serialize_key_and_certificates(
            issued.common_name.encode(), key, cert, [self._cert], encryption
        )
        _write_private(path, data)
        return path


def _general_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _pem_key(key: ec.EllipticCurvePrivateKey, password: str | None) -> bytes:
    encryption: serialization.KeySerializationEncryption = (
        serialization.BestAvailableEncryption(password.encode())
        if password
        else serialization.NoEncryption()
    )
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption
    )
