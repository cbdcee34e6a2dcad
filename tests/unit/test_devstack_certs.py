"""devstack's throwaway CA (the secured test broker's certificates): what hostname
verification and a JVM keystore need, checked without a broker."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.serialization import pkcs12

from devstack.certs import CertificateAuthority


def test_a_server_certificate_names_its_hosts_and_is_signed_by_the_ca(tmp_path: Path) -> None:
    ca = CertificateAuthority(tmp_path)
    issued = ca.issue("broker", hosts=["localhost", "127.0.0.1"])
    cert = x509.load_pem_x509_certificate(issued.cert_file.read_bytes())
    ca_cert = x509.load_pem_x509_certificate(ca.cert_file.read_bytes())
    cert.verify_directly_issued_by(ca_cert)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert issued.key_file.stat().st_mode & 0o077 == 0, "a key file readable by others"


def test_an_encrypted_key_needs_its_password_and_the_ca_is_reused(tmp_path: Path) -> None:
    ca = CertificateAuthority(tmp_path)
    issued = ca.issue("client", key_password="s3cret")
    with pytest.raises(TypeError, match="encrypted"):
        serialization.load_pem_private_key(issued.key_file.read_bytes(), None)
    serialization.load_pem_private_key(issued.key_file.read_bytes(), b"s3cret")
    again = CertificateAuthority(tmp_path)
    assert again.cert_file.read_bytes() == ca.cert_file.read_bytes()


def test_the_keystore_holds_the_key_its_certificate_and_the_ca(tmp_path: Path) -> None:
    ca = CertificateAuthority(tmp_path)
    issued = ca.issue("broker", hosts=["localhost"])
    path = ca.pkcs12(issued, tmp_path / "broker.p12", "storepass")
    store = pkcs12.load_pkcs12(path.read_bytes(), b"storepass")
    assert store.key is not None
    assert store.cert is not None
    assert store.cert.certificate.subject.rfc4514_string() == "CN=broker"
    assert [c.certificate.subject.rfc4514_string() for c in store.additional_certs] == [
        "CN=notify-outbox test CA"
    ]
