"""The mirror host's own facts: its Python for olah, what its registry holds, whether both
services answer, which mirror registries a host trusts, and how big a cache is."""

from __future__ import annotations

import shlex

from pyinfra.api import FactBase

from sparkfleet import hostpaths
from sparkfleet.facts import MANIFEST_ACCEPT
from sparkfleet.hostread import HTTP_CLIENT


class HostPython(FactBase["dict | None"]):
    """The host's python3: version, machine and glibc (for the wheels the mirror needs)."""

    def requires_command(self) -> str:
        return "python3"

    def command(self) -> str:
        return (
            "python3 -c 'import sys, platform; print(sys.version_info[0], sys.version_info[1], "
            "platform.machine(), platform.libc_ver()[1] or \"-\")'"
        )

    def process(self, output):
        parts = output[0].split() if output else []
        if len(parts) != 4 or not parts[0].isdigit():
            return None
        return {"major": int(parts[0]), "minor": int(parts[1]), "machine": parts[2], "glibc": parts[3]}


class RegistryManifest(FactBase["str | None"]):
    """The digest the registry at ``url`` holds for ``path:reference``, or None."""

    def command(self, url: str, path: str, reference: str, cacert: str) -> str:
        # A python3 program, so the snapshot reader asks it in its own process (no curl).
        return f"python3 -c {shlex.quote(_MANIFEST)} " + " ".join(
            map(shlex.quote, (url, f"/v2/{path}/manifests/{reference}", cacert, MANIFEST_ACCEPT)))

    def process(self, output):
        return output[0].strip() if output and output[0].startswith("sha256:") else None


#: HEAD of a manifest: its digest, when the registry holds it (nothing when it is not up yet,
#: or holds no such manifest).
_MANIFEST = HTTP_CLIENT + r"""
import sys
from urllib.parse import urlsplit
url, path, cacert, accept = sys.argv[1:]
at = urlsplit(url)
try:
    where = (at.hostname, at.port or (443 if at.scheme == "https" else 80))
    status, said, _ = http(where, path, ["Accept: " + accept], timeout=10, method="HEAD",
                           cafile=cacert if at.scheme == "https" else None)
except (OSError, ValueError, IndexError):
    sys.exit()
if status < 400 and said.get("docker-content-digest"):
    print(said["docker-content-digest"])
"""


class MirrorAnswers(FactBase[bool]):
    """Whether the mirror registry and the HF mirrors (online, and offline on ``hf_offline_port``)
    all answer on this host."""

    @staticmethod
    def default():
        return False

    def command(self, registry: str, hf_port: int, hf_offline_port: int = 0) -> str:
        ports = [str(int(port)) for port in (hf_port, hf_offline_port) if port]
        return f"python3 -c {shlex.quote(_ANSWERS)} " + " ".join(
            map(shlex.quote, (registry, hostpaths.REGISTRY_CERT, *ports)))

    def process(self, output):
        return bool(output) and output[-1].strip() == "yes"


#: The registry answers /v2/ over TLS (status below 400) and each HF mirror answers at all.
_ANSWERS = HTTP_CLIENT + r"""
import sys
from urllib.parse import urlsplit
registry, cacert, ports = sys.argv[1], sys.argv[2], [int(p) for p in sys.argv[3:]]
at = urlsplit("https://" + registry)
try:
    ok = http((at.hostname, at.port or 443), "/v2/", timeout=5, cafile=cacert)[0] < 400
    for port in ports:
        http(("127.0.0.1", port), "/", timeout=5)
except (OSError, ValueError, IndexError):
    ok = False
print("yes" if ok else "no")
"""


class MirrorTrust(FactBase["list[str]"]):
    """The registries (``host:port``) whose certificate sparkfleet placed in docker's
    certs.d here, known by the marker beside it."""

    @staticmethod
    def default():
        return []

    def command(self) -> str:
        return (f"for m in {hostpaths.DOCKER_CERTS_DIR}/*/{hostpaths.MIRROR_TRUST_MARKER}; do "
                '[ -e "$m" ] && { d=${m%/*}; echo "${d##*/}"; }; done; true')  # no program per marker

    def process(self, output):
        return [line.strip() for line in output if line.strip()]
