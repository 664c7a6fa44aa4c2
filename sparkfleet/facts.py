"""sparkfleet's own facts: what pyinfra's built-in facts do not read.

Each is a small ``FactBase`` answering one question about a host, cheap and cacheable.
Where pyinfra has a fact (``server.Arch``, ``server.Which``, ``hardware.Cpus``,
``files.File``, ``files.FileContents``, ``systemd.SystemdStatus``, ``docker.DockerImage``,
``docker.DockerSystemInfo``...) the steps use it directly.
"""

from __future__ import annotations

import shlex

from pyinfra.api import FactBase

from sparkfleet import hostpaths

#: The manifest types a registry may answer for the serving image.
MANIFEST_ACCEPT = (
    "application/vnd.docker.distribution.manifest.v2+json,application/vnd.oci.image.manifest.v1+json,"
    "application/vnd.docker.distribution.manifest.list.v2+json,application/vnd.oci.image.index.v1+json"
)

# --- docker --------------------------------------------------------------------------


class DockerRoot(FactBase["str | None"]):
    """Docker's data root if the daemon answers, else None."""

    def command(self) -> str:
        return "docker info --format '{{.DockerRootDir}}' 2>/dev/null || true"

    def process(self, output):
        root = output[0].strip() if output else ""
        return root if root.startswith("/") else None


# --- the mirror --------------------------------------------------------------------------


class CommandAvailable(FactBase[bool]):
    """Whether ``program`` is on the PATH."""

    @staticmethod
    def default():
        return False

    def command(self, program: str) -> str:
        return f"command -v {shlex.quote(program)} >/dev/null && echo yes || echo no"

    def process(self, output):
        return bool(output) and output[0].strip() == "yes"


class HostPython(FactBase["dict | None"]):
    """The host's python3: version, machine and glibc (for the wheels the mirror needs)."""

    def command(self) -> str:
        return (
            "python3 -c 'import sys, platform; print(sys.version_info[0], sys.version_info[1], "
            "platform.machine(), platform.libc_ver()[1] or \"-\")' 2>/dev/null || true"
        )

    def process(self, output):
        parts = output[0].split() if output else []
        if len(parts) != 4 or not parts[0].isdigit():
            return None
        return {"major": int(parts[0]), "minor": int(parts[1]), "machine": parts[2], "glibc": parts[3]}


class CPUCount(FactBase[int]):
    """The host's CPU count (``nproc``)."""

    @staticmethod
    def default():
        return 1

    def command(self) -> str:
        return "nproc 2>/dev/null || echo 1"

    def process(self, output):
        return int(output[0]) if output and output[0].strip().isdigit() else 1


class FileFirstLine(FactBase["str | None"]):
    """The first line of a small file, or None."""

    def command(self, path: str) -> str:
        return f"head -n 1 {shlex.quote(path)} 2>/dev/null || true"

    def process(self, output):
        return output[0].strip() if output and output[0].strip() else None


class RegistryManifest(FactBase["str | None"]):
    """The digest the registry at ``url`` holds for ``path:reference``, or None."""

    def command(self, url: str, path: str, reference: str, cacert: str) -> str:
        q = shlex.quote
        return (
            f"curl -sfI -m 10 --cacert {q(cacert)} -H {q('Accept: ' + MANIFEST_ACCEPT)} "
            f"{q(f'{url}/v2/{path}/manifests/{reference}')} 2>/dev/null | tr -d '\\r' "
            "| sed -n 's/^[Dd]ocker-[Cc]ontent-[Dd]igest: *//p' || true"
        )

    def process(self, output):
        return output[0].strip() if output and output[0].startswith("sha256:") else None


class DirBytes(FactBase[int]):
    """Bytes under ``path`` (0 when absent)."""

    @staticmethod
    def default():
        return 0

    def command(self, path: str) -> str:
        return f"du -sb {shlex.quote(path)} 2>/dev/null | cut -f1 || true"

    def process(self, output):
        return int(output[0]) if output and output[0].strip().isdigit() else 0


class MirrorUnits(FactBase["list[str]"]):
    """Which of the mirror's services run or are enabled here (sparkfleet's own only)."""

    @staticmethod
    def default():
        return []

    def command(self) -> str:
        hf, registry, config = hostpaths.HF_MIRROR_UNIT, hostpaths.REGISTRY_UNIT, hostpaths.REGISTRY_CONFIG
        return (
            f"for u in {hf} {registry}; do "
            f"if [ $u = {registry} ] && ! grep -qs sparkfleet {config}; then continue; fi; "
            "if systemctl is-active -q $u || systemctl is-enabled -q $u 2>/dev/null; then echo $u; fi; done"
        )

    def process(self, output):
        return [line.strip() for line in output if line.strip()]


class MirrorAnswers(FactBase[bool]):
    """Whether the mirror registry and the HF mirror both answer on this host."""

    @staticmethod
    def default():
        return False

    def command(self, registry: str, hf_port: int) -> str:
        return (
            f"curl -sf -m 5 --cacert {hostpaths.REGISTRY_CERT} https://{registry}/v2/ >/dev/null && "
            f"curl -s -m 5 -o /dev/null http://127.0.0.1:{hf_port}/ && echo yes || echo no"
        )

    def process(self, output):
        return bool(output) and output[-1].strip() == "yes"


class SshServerAddress(FactBase[str]):
    """The address this host was reached at over SSH ($SSH_CONNECTION's third field; run
    it with _sudo=False, sudo drops the variable), or "" (not SSH, or unknown)."""

    @staticmethod
    def default():
        return ""

    def command(self) -> str:
        return 'echo "${SSH_CONNECTION:-}"'

    def process(self, output):
        fields = output[0].split() if output else []
        return fields[2] if len(fields) >= 3 else ""


class RouteSource(FactBase[str]):
    """This host's source address on its route to ``address`` ("" when it has none)."""

    @staticmethod
    def default():
        return ""

    def command(self, address: str) -> str:
        return f"ip route get {shlex.quote(address)} 2>/dev/null | sed -n 's/.* src \\([^ ]*\\).*/\\1/p' | head -n 1"

    def process(self, output):
        return output[0].strip() if output else ""
