"""Key material for secure mode: CURVE key pairs, a TLS CA and certificate, a token.

:func:`generate_keys` writes what ``tspd keys generate DIR`` and ``tspd demo
--secure`` use (docs/security.md)::

    DIR/curve/NAME.key          public certificate of process NAME (ZeroMQ format)
    DIR/curve/NAME.key_secret   its secret certificate (mode 0600)
    DIR/allow/NAME.key          the allow-list: every public certificate
    DIR/tls/ca.pem, ca.key      a self-signed CA (the key mode 0600)
    DIR/tls/server.pem, .key    the bootstrap server's certificate, signed by the CA,
                                valid for the given hosts (the key mode 0600)
    DIR/bootstrap.token         a random bearer token (mode 0600)

CURVE certificates come from :func:`zmq.auth.create_certificates`; the TLS files
from the ``cryptography`` package (EC P-256, SHA-256).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import zmq.auth

from tspd.core.errors import ConfigError

__all__ = ["KeyFiles", "generate_curve_keys", "generate_keys", "generate_tls", "generate_token"]


@dataclass(frozen=True, slots=True)
class KeyFiles:
    """Where :func:`generate_keys` wrote everything."""

    directory: Path
    #: Per process name: (public certificate, secret certificate).
    curve: dict[str, tuple[Path, Path]] = field(default_factory=dict)
    allow_dir: Path | None = None
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    token_file: Path | None = None

    def public_key(self, name: str) -> str:
        """Process ``name``'s public key in Z85."""
        public, _ = zmq.auth.load_certificate(self.curve[name][0])
        return public.decode("ascii")

    def env(self, name: str | None = None, *, server: bool = False) -> dict[str, str]:
        """The ``TSPD_*`` variables for process ``name`` (its CURVE keys and the
        allow-list; ``None``: none), as a bootstrap client (the CA and the token) or,
        with ``server``, as the bootstrap server (certificate, key and token)."""
        env: dict[str, str] = {}
        if name is not None and self.allow_dir is not None:
            env["TSPD_CURVE_SECRET_KEY_FILE"] = str(self.curve[name][1])
            env["TSPD_CURVE_ALLOW_DIR"] = str(self.allow_dir)
        if server and self.cert_file is not None and self.key_file is not None:
            env["TSPD_TLS_CERT_FILE"] = str(self.cert_file)
            env["TSPD_TLS_KEY_FILE"] = str(self.key_file)
        elif self.ca_file is not None:
            env["TSPD_TLS_CA_FILE"] = str(self.ca_file)
        if self.token_file is not None:
            env["TSPD_BOOTSTRAP_TOKEN_FILE"] = str(self.token_file)
        return env


def _private(path: Path) -> None:
    os.chmod(path, 0o600)


def generate_curve_keys(
    directory: str | os.PathLike[str], names: Sequence[str]
) -> tuple[dict[str, tuple[Path, Path]], Path]:
    """One CURVE key pair per name under ``directory/curve`` and an allow-list of all
    their public certificates in ``directory/allow``; returns both."""
    if not names or len(set(names)) != len(names):
        raise ConfigError(f"key pairs need distinct names, got {list(names)}")
    for name in names:
        if not name or not all(c.isalnum() or c in "-_." for c in name) or name[0] == ".":
            raise ConfigError(f"a key pair name must be letters, digits, '-', '_' or '.': {name!r}")
    curve = Path(directory) / "curve"
    allow = Path(directory) / "allow"
    curve.mkdir(parents=True, exist_ok=True)
    allow.mkdir(parents=True, exist_ok=True)
    pairs: dict[str, tuple[Path, Path]] = {}
    for name in names:
        public, secret = zmq.auth.create_certificates(curve, name, metadata={"name": name})
        _private(Path(secret))
        shutil.copy(public, allow / f"{name}.key")
        pairs[name] = (Path(public), Path(secret))
    return pairs, allow


def generate_tls(
    directory: str | os.PathLike[str], hosts: Sequence[str], *, days: int = 365
) -> tuple[Path, Path, Path]:
    """A self-signed CA and a server certificate it signs for ``hosts`` (names or IP
    addresses) under ``directory/tls``: ``(ca.pem, server.pem, server.key)``."""
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError as err:  # pragma: no cover - a dependency of tspd
        raise ConfigError(f"TLS certificates need the 'cryptography' package: {err}") from None
    if not hosts:
        raise ConfigError("a server certificate needs at least one host name or address")
    tls = Path(directory) / "tls"
    tls.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    valid = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tspd bootstrap CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(valid[0])
        .not_valid_after(valid[1])
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
            x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(valid[0])
        .not_valid_after(valid[1])
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    plain_key = serialization.NoEncryption()
    pkcs8 = serialization.PrivateFormat.PKCS8
    ca_file, ca_key_file = tls / "ca.pem", tls / "ca.key"
    cert_file, key_file = tls / "server.pem", tls / "server.key"
    ca_file.write_bytes(ca.public_bytes(pem))
    ca_key_file.write_bytes(ca_key.private_bytes(pem, pkcs8, plain_key))
    _private(ca_key_file)
    cert_file.write_bytes(cert.public_bytes(pem) + ca.public_bytes(pem))
    key_file.write_bytes(key.private_bytes(pem, pkcs8, plain_key))
    _private(key_file)
    return ca_file, cert_file, key_file


def generate_token(directory: str | os.PathLike[str]) -> Path:
    """A random bearer token (256 bits, URL-safe) in ``directory/bootstrap.token``."""
    path = Path(directory) / "bootstrap.token"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(secrets.token_urlsafe(32) + "\n", encoding="utf-8")
    _private(path)
    return path


def generate_keys(
    directory: str | os.PathLike[str],
    names: Sequence[str],
    *,
    hosts: Sequence[str] = ("127.0.0.1", "localhost"),
    tls: bool = True,
    token: bool = True,
    days: int = 365,
) -> KeyFiles:
    """Everything of the module doc's layout under ``directory``."""
    pairs, allow = generate_curve_keys(directory, names)
    ca_file = cert_file = key_file = token_file = None
    if tls:
        ca_file, cert_file, key_file = generate_tls(directory, hosts, days=days)
    if token:
        token_file = generate_token(directory)
    return KeyFiles(
        directory=Path(directory),
        curve=pairs,
        allow_dir=allow,
        ca_file=ca_file,
        cert_file=cert_file,
        key_file=key_file,
        token_file=token_file,
    )
