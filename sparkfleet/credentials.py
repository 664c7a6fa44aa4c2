"""The controller's secrets: the fleet's API key, the HF token and the mirror registry's
TLS certificate and key.

Reading is free; the deploy writes (:func:`make_api_key` and :func:`mirror_tls` create
what is missing) only while it executes, never while it plans, so ``--dry`` leaves the
controller as it found it. Secrets never reach argv, unit files or output: hosts
get them as 0600 files (see sparkfleet/service.py).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
import secrets as _random
from pathlib import Path

from pydantic import SecretStr

from sparkfleet import config
from sparkfleet.config import Settings
from sparkfleet.mirrors import Mirror

PROJECT = Path(__file__).resolve().parents[1]


# --- API key -------------------------------------------------------------------------


def api_key_path(settings: Settings) -> Path:
    """``api_key_file``, relative paths taken from the project (wherever pyinfra starts)."""
    path = Path(settings.api_key_file).expanduser()
    return path if path.is_absolute() else PROJECT / path


class NotYetMade(Exception):
    """``api_key: auto`` and no key yet: the deploy makes it when it executes."""


def existing_api_key(api_key: SecretStr, key_file: Path) -> str | None:
    """The API key the fleet serves with (None for ``none``), without making one.

    Raises :class:`NotYetMade` for ``auto`` before the first deploy made the key.
    """
    raw = api_key.get_secret_value()
    if raw == "none":
        return None
    if raw != "auto":
        return raw
    if not key_file.exists():
        raise NotYetMade(str(key_file))
    return key_file.read_text().strip()


def make_api_key(api_key: SecretStr, key_file: Path) -> str | None:
    """The API key, making the ``auto`` key (0600, once per project) if it is missing."""
    try:
        return existing_api_key(api_key, key_file)
    except NotYetMade:
        pass
    key_file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = "sf-" + _random.token_urlsafe(32)
    try:
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # made meanwhile by another host of this run
        return key_file.read_text().strip()
    with os.fdopen(fd, "w") as handle:
        handle.write(key + "\n")
    return key


def api_key(settings: Settings) -> str | None:
    """The fleet's API key (made if ``auto`` and missing): for code outside a deploy."""
    return make_api_key(settings.api_key, api_key_path(settings))


# --- HF token ----------------------------------------------------------------------------


hf_token = config.hf_token  # from data, else the controller's environment (the fleet lock reads it too)


# --- the mirror registry's TLS certificate -----------------------------------------------


def mirror_tls_paths(tls_dir: str, mirror: Mirror) -> tuple[Path, Path]:
    """Where the mirror registry's self-signed certificate and key live on the controller
    (one pair per mirror address and port): (certificate, key). They may not exist yet."""
    directory = Path(tls_dir).expanduser()
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", f"{mirror.address}-{mirror.registry_port}")
    return directory / f"{stem}.crt", directory / f"{stem}.key"


def names_mirror(certificate_pem: bytes, mirror: Mirror) -> bool:
    """Whether a registry certificate is one made for ``mirror``'s address."""
    from cryptography import x509

    try:
        cert = x509.load_pem_x509_certificate(certificate_pem)
        alt = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return False
    try:
        wanted: object = ipaddress.ip_address(mirror.address)
        return wanted in alt.get_values_for_type(x509.IPAddress)
    except ValueError:
        return mirror.address in alt.get_values_for_type(x509.DNSName)


def keep_mirror_tls(tls_dir: str, mirror: Mirror, certificate_pem: bytes, key_pem: bytes) -> None:
    """Keep a certificate and key the mirror already serves with (a second checkout adopts
    them instead of making new ones: that would restart the registry under every pull)."""
    cert, key = mirror_tls_paths(tls_dir, mirror)
    cert.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = key.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(key_pem)
    tmp.replace(key)
    cert.write_bytes(certificate_pem)


def mirror_tls(tls_dir: str, mirror: Mirror) -> tuple[Path, Path]:
    """The certificate and key, made once (like the API key) if they are missing."""
    cert, key = mirror_tls_paths(tls_dir, mirror)
    if cert.exists() and key.exists():
        return cert, key
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    private = ec.generate_private_key(ec.SECP256R1())
    try:
        alt: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(mirror.address))
    except ValueError:
        alt = x509.DNSName(mirror.address)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"sparkfleet mirror {mirror.address}")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(private.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(x509.SubjectAlternativeName([alt]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(private, hashes.SHA256())
    )
    cert.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    key_bytes = private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    tmp = key.with_suffix(".tmp")
    tmp.touch(mode=0o600)
    tmp.write_bytes(key_bytes)
    tmp.replace(key)
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    return cert, key
