"""`orchard certs init|issue`: a certificate authority for a fleet, and certificates for
its routers and workers (the `cryptography` package).

    orchard certs init DIR                                   DIR/ca.pem, DIR/ca-key.pem
    orchard certs issue DIR --name mac-1 --host mac-1.local  DIR/mac-1.pem, DIR/mac-1-key.pem

A certificate is good for both ends of a connection (server and client authentication),
so one per Mac serves its router or worker and dials the others with it. Keys are
written mode 0600. The certificate's name (its common name) is the identity a worker
registers under with mutual TLS.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cluster.config import setting

CA_CERT, CA_KEY = "ca.pem", "ca-key.pem"


@dataclass(frozen=True)
class CertsInit:
    """`orchard certs init`: a new fleet CA."""

    dir: str = setting(help="where to write ca.pem and ca-key.pem", flag="dir")
    name: str = setting("Orchard fleet CA", "the CA's name")
    days: int = setting(3650, "validity in days")


@dataclass(frozen=True)
class CertsIssue:
    """`orchard certs issue`: a key and certificate signed by the fleet CA."""

    dir: str = setting(help="the CA's directory (from `orchard certs init`); the files are written there", flag="dir")
    name: str = setting(help="the certificate's name: a worker registers under it with mutual TLS", flag="--name")
    hosts: tuple[str, ...] = setting((), "a DNS name or IP address it serves (repeatable; localhost and "
                                         "127.0.0.1 are always included)", flag="--host", repeat=True)
    days: int = setting(825, "validity in days")


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _name(common_name: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name),
                      x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Orchard")])


def init_ca(directory: str | Path, name: str = CertsInit.name, days: int = CertsInit.days) -> Path:
    """Write a CA certificate and key into `directory`; refuses to overwrite a CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    if (d / CA_KEY).exists():
        raise FileExistsError(f"{d / CA_KEY} exists: a fleet has one CA "
                              "(issue certificates with `orchard certs issue`)")
    key = _key()
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    _write_private(d / CA_KEY, _pem_key(key))
    (d / CA_CERT).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return d / CA_CERT


def issue(directory: str | Path, name: str, hosts: tuple[str, ...] = (),
          days: int = CertsIssue.days) -> tuple[Path, Path]:
    """A key and a certificate for `name` (serving `hosts`), signed by the CA in `directory`:
    (certificate path, key path)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID

    d = Path(directory)
    if not (d / CA_KEY).exists():
        raise FileNotFoundError(f"no CA in {d}: run `orchard certs init {d}` first")
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"--name {name!r}: use a plain name such as mac-1")
    ca_key = serialization.load_pem_private_key((d / CA_KEY).read_bytes(), password=None)
    ca = x509.load_pem_x509_certificate((d / CA_CERT).read_bytes())
    sans = []
    for host in dict.fromkeys((*hosts, "localhost", "127.0.0.1", name)):
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host.strip("[]"))))
        except ValueError:
            sans.append(x509.DNSName(host))
    key = _key()
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    cert_path, key_path = d / f"{name}.pem", d / f"{name}-key.pem"
    _write_private(key_path, _pem_key(key))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


def common_name(cert_path: str | Path) -> str:
    """The name a certificate was issued to."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    cert = x509.load_pem_x509_certificate(Path(cert_path).read_bytes())
    return cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value


def run_init(spec: CertsInit) -> int:
    try:
        path = init_ca(spec.dir, spec.name, spec.days)
    except FileExistsError as e:
        print(f"orchard certs init: {e}")
        return 1
    print(f"wrote the fleet CA: {path} (give it to every router, worker and client as --tls-ca) and "
          f"{Path(spec.dir) / CA_KEY} (keep it on this machine, mode 0600)")
    return 0


def run_issue(spec: CertsIssue) -> int:
    try:
        cert, key = issue(spec.dir, spec.name, spec.hosts, spec.days)
    except (FileNotFoundError, ValueError) as e:
        print(f"orchard certs issue: {e}")
        return 1
    print(f"wrote {cert} and {key} (mode 0600): use them as --tls-cert and --tls-key on {spec.name}")
    return 0
