"""A throwaway CA and certificates signed by it: ``adamps up --tls`` and the tests.

Not for production clusters, whose operators bring their own PKI (cert-manager, a corporate CA):
the keys are written unencrypted to the run directory (mode 0600), and the certificates live a
week. One certificate serves every process of a local cluster: it names every address they dial
(127.0.0.1, localhost), and as a client certificate it is what mutual TLS asks for.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

#: how long the generated certificates are valid (a local run, a test)
VALIDITY = datetime.timedelta(days=7)


@dataclass(frozen=True)
class CertFiles:
    """PEM files: the CA's certificate, and one certificate with its key."""

    ca: Path
    cert: Path
    key: Path

    def env(self, mutual: bool = False) -> dict[str, str]:
        """The environment that turns TLS on in a process (``$ADAMPS_TLS_*``)."""
        out = {"ADAMPS_TLS_CA": str(self.ca), "ADAMPS_TLS_CERT": str(self.cert),
               "ADAMPS_TLS_KEY": str(self.key)}  # fmt: skip
        if mutual:
            out["ADAMPS_TLS_MUTUAL"] = "1"
        return out


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())  # fmt: skip


def make_ca(
    common_name: str = "adamps throwaway CA",
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),  # fmt: skip
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def issue(
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    common_name: str,
    hosts: Sequence[str] = ("127.0.0.1", "localhost"),
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A certificate for `hosts` (IP addresses or DNS names), good as server and as client."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    names: list[x509.GeneralName] = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def write_ca_and_cert(
    directory: str | os.PathLike[str],
    hosts: Sequence[str] = ("127.0.0.1", "localhost"),
    common_name: str = "adamps",
) -> CertFiles:
    """Writes ``ca.pem``, ``cert.pem`` and ``key.pem`` (0600) under `directory`/tls."""
    d = Path(directory) / "tls"
    d.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = make_ca()
    key, cert = issue(ca_key, ca_cert, common_name, hosts)
    files = CertFiles(d / "ca.pem", d / "cert.pem", d / "key.pem")
    _write(files.ca, ca_cert.public_bytes(serialization.Encoding.PEM))
    _write(files.cert, cert.public_bytes(serialization.Encoding.PEM))
    _write(files.key, _key_pem(key))
    return files


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m adamps.security.tls_certs DIR [HOST ...]``: a throwaway CA and one certificate for the
    hosts (default 127.0.0.1 and localhost, always included) in DIR/tls, for a test cluster in
    Compose or Kubernetes. Prints the three paths."""
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m adamps.security.tls_certs", description=main.__doc__
    )
    p.add_argument("dir", help="the files go to DIR/tls (ca.pem, cert.pem, key.pem)")
    p.add_argument("hosts", nargs="*", help="further DNS names or IP addresses (* wildcards ok)")
    a = p.parse_args(argv)
    hosts = ["127.0.0.1", "localhost", *a.hosts]
    files = write_ca_and_cert(a.dir, hosts)
    print(f"ca {files.ca}\ncert {files.cert}\nkey {files.key}\nhosts {' '.join(hosts)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
