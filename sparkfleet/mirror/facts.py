"""The mirror host's own facts: its Python for olah, what its registry holds, whether both
services answer, which mirror registries a host trusts, and how big a cache is."""

from __future__ import annotations

import shlex

from pyinfra.api import FactBase

from sparkfleet import hostpaths
from sparkfleet.facts import MANIFEST_ACCEPT


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

    def requires_command(self, url: str, path: str, reference: str, cacert: str) -> str:
        return "curl"

    def command(self, url: str, path: str, reference: str, cacert: str) -> str:
        q = shlex.quote
        # A registry that is not up yet, or holds no such manifest, answers nothing.
        return (
            f"curl -sfI -m 10 --cacert {q(cacert)} -H {q('Accept: ' + MANIFEST_ACCEPT)} "
            f"{q(f'{url}/v2/{path}/manifests/{reference}')} | tr -d '\\r' "
            "| sed -n 's/^[Dd]ocker-[Cc]ontent-[Dd]igest: *//p'"
        )

    def process(self, output):
        return output[0].strip() if output and output[0].startswith("sha256:") else None


class MirrorAnswers(FactBase[bool]):
    """Whether the mirror registry and the HF mirrors (online, and offline on ``hf_offline_port``)
    all answer on this host."""

    @staticmethod
    def default():
        return False

    def requires_command(self, registry: str, hf_port: int, hf_offline_port: int = 0) -> str:
        return "curl"

    def command(self, registry: str, hf_port: int, hf_offline_port: int = 0) -> str:
        return (
            f"curl -sf -m 5 --cacert {hostpaths.REGISTRY_CERT} https://{registry}/v2/ >/dev/null && "
            + "".join(f"curl -s -m 5 -o /dev/null http://127.0.0.1:{port}/ && " for port in (hf_port, hf_offline_port)
                      if port)
            + "echo yes || echo no"
        )

    def process(self, output):
        return bool(output) and output[-1].strip() == "yes"


class MirrorTrust(FactBase["list[str]"]):
    """The registries (``host:port``) whose certificate sparkfleet placed in docker's
    certs.d here, known by the marker beside it."""

    @staticmethod
    def default():
        return []

    def command(self) -> str:
        return (f"for m in {hostpaths.DOCKER_CERTS_DIR}/*/{hostpaths.MIRROR_TRUST_MARKER}; do "
                '[ -e "$m" ] && basename "$(dirname "$m")"; done; true')

    def process(self, output):
        return [line.strip() for line in output if line.strip()]
