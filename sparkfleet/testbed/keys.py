"""The controller's SSH key (.testbed/id_ed25519), made once per checkout."""

from __future__ import annotations

import os
from pathlib import Path

from . import paths


def ensure_ssh_key(path: Path = paths.SSH_KEY) -> str:
    """Create an unencrypted ed25519 key pair at *path* (+ .pub) if missing; return the
    public key line. Made with `cryptography` (a paramiko dependency) so the controller
    needs no ssh-keygen."""
    pub = path.with_name(path.name + ".pub")
    if path.exists() and pub.exists():
        return pub.read_text().strip()
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    priv = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    )
    pub_line = key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    ).decode() + " sparkfleet-testbed"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(priv)
    os.replace(tmp, path)
    pub.write_text(pub_line + "\n")
    return pub_line
