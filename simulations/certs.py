"""Self-signed TLS material and SuperNode authentication keys for a Flower deployment.

Writes, under an output directory:

- ``ca.crt``, ``ca.key``: a self-signed certificate authority (EC P-384, 10 years by default);
- ``server.crt``, ``server.key``: the SuperLink's certificate, signed by the CA, with
  ``subjectAltName`` = ``localhost``, ``127.0.0.1``, ``::1`` and any extra hosts/IPs you name
  (the names SuperNodes and the ``flwr`` CLI use to reach the SuperLink must be in there);
- ``keys/<name>``, ``keys/<name>.pub``: one EC P-384 key pair per SuperNode, OpenSSH format
  (what ``flower-supernode --auth-supernode-private-key`` and ``flwr supernode register``
  read).

Usage::

    python -m fedcomp.simulations.certs OUT_DIR [--hosts superlink.example.org 10.0.0.5] [--nodes 2]

Only the ``cryptography`` package is used (no openssl binary). Private keys are written with
mode 0600.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import ipaddress
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["NodeKey", "TlsFiles", "make_ca_and_server_cert", "make_node_keys", "main"]

DEFAULT_HOSTS: tuple[str, ...] = ("localhost", "127.0.0.1", "::1")


@dataclasses.dataclass(frozen=True)
class TlsFiles:
    """Paths of the CA and server certificate files (PEM)."""

    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path


@dataclasses.dataclass(frozen=True)
class NodeKey:
    """Paths of one SuperNode's authentication key pair (OpenSSH format)."""

    name: str
    private_key: Path
    public_key: Path


def _write(path: Path, data: bytes, private: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if private:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(path, 0o600)
    else:
        path.write_bytes(data)
    return path


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _san(hosts: Iterable[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    seen: set[str] = set()
    for host in hosts:
        if host in seen:
            continue
        seen.add(host)
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def make_ca_and_server_cert(
    out_dir: str | Path,
    hosts: Sequence[str] = (),
    days: int = 3650,
) -> TlsFiles:
    """Create a self-signed CA and a server certificate it signs.

    Parameters
    ----------
    out_dir : path
        Directory to write ``ca.crt``, ``ca.key``, ``server.crt``, ``server.key`` into.
    hosts : sequence of str
        Extra DNS names or IP addresses for the server certificate's subjectAltName, on top
        of ``localhost``, ``127.0.0.1`` and ``::1``.
    days : int
        Validity of both certificates.
    """
    out = Path(out_dir)
    now = datetime.datetime.now(datetime.timezone.utc)
    not_before = now - datetime.timedelta(minutes=5)  # tolerate small clock skew
    not_after = now + datetime.timedelta(days=days)

    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedcomp"),
        x509.NameAttribute(NameOID.COMMON_NAME, "fedcomp test CA"),
    ])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA384())
    )

    all_hosts = list(DEFAULT_HOSTS) + [h for h in hosts if h]
    server_key = ec.generate_private_key(ec.SECP384R1())
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedcomp"),
            x509.NameAttribute(NameOID.COMMON_NAME, all_hosts[-1] if hosts else "localhost"),
        ]))
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(_san(all_hosts), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=True, key_cert_sign=False, crl_sign=False,
                encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA384())
    )

    return TlsFiles(
        ca_cert=_write(out / "ca.crt", ca_cert.public_bytes(serialization.Encoding.PEM)),
        ca_key=_write(out / "ca.key", _key_pem(ca_key), private=True),
        server_cert=_write(out / "server.crt", server_cert.public_bytes(serialization.Encoding.PEM)),
        server_key=_write(out / "server.key", _key_pem(server_key), private=True),
    )


def make_node_keys(out_dir: str | Path, names: Iterable[str]) -> list[NodeKey]:
    """Create one EC P-384 key pair per SuperNode name under ``out_dir`` (OpenSSH format).

    ``<name>`` holds the private key (for ``flower-supernode --auth-supernode-private-key``),
    ``<name>.pub`` the public key (for ``flwr supernode register <name>.pub``).
    """
    out = Path(out_dir)
    keys = []
    for name in names:
        key = ec.generate_private_key(ec.SECP384R1())
        private = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
        )
        public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        keys.append(NodeKey(
            name=name,
            private_key=_write(out / name, private, private=True),
            public_key=_write(out / f"{name}.pub", public + f" {name}\n".encode()),
        ))
    return keys


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fedcomp.simulations.certs",
        description="Write a self-signed CA, a SuperLink server certificate and SuperNode auth keys.",
    )
    parser.add_argument("out_dir", type=Path, help="output directory (created)")
    parser.add_argument("--hosts", nargs="*", default=[],
                        help="extra DNS names / IPs of the SuperLink for the certificate's SAN")
    parser.add_argument("--nodes", type=int, default=2, help="number of SuperNode key pairs (default 2)")
    parser.add_argument("--days", type=int, default=3650, help="certificate validity in days")
    args = parser.parse_args(argv)

    tls = make_ca_and_server_cert(args.out_dir, hosts=args.hosts, days=args.days)
    keys = make_node_keys(args.out_dir / "keys", [f"supernode-{i}" for i in range(args.nodes)])
    print(f"CA certificate:     {tls.ca_cert}")
    print(f"server certificate: {tls.server_cert} (SAN: {', '.join([*DEFAULT_HOSTS, *args.hosts])})")
    print(f"server key:         {tls.server_key}")
    for key in keys:
        print(f"{key.name}: private {key.private_key}, public {key.public_key}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
