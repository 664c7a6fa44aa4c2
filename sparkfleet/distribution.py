"""Fleet distribution: the serving image and the weights cross the WAN once per fleet.

One host of the inventory (``fleet_mirror``, resolved in config.FleetSource) is the fleet's
source, and every host (the mirror too) downloads from it over the LAN, in parallel:

* model files through an HF mirror: the real ``olah`` (PyPI), run as
  ``sparkfleet-hf-mirror.service``. It fetches each file from the hub once — concurrent
  requests for a block it does not have yet share one upstream download — and serves the
  fleet from its cache. Hosts download with their usual huggingface_hub and ``HF_ENDPOINT``
  pointing at it: same cache layout, revision pinning and resume; the token stays in
  ``hf.env`` and olah forwards it upstream per request (it never stores it).
* the image through a registry on the mirror (Debian/Ubuntu ``docker-registry``, TLS with a
  certificate made on the controller and trusted in ``/etc/docker/certs.d``), holding a
  byte-exact copy of the image made by ``templates/sparkfleet-copy-image.py``: each blob is
  read from upstream once, and the copy keeps the image's digest. Hosts pull it by digest.

Why a copy and not a pull-through cache: measured on the testbed, docker-registry 2.8's
proxy reads every cold blob from upstream twice (once to store it, once to serve it) and
once more per concurrent client (2.0x and 3.9x the image). A ``docker save``/``load``
fan-out sends the uncompressed layers (3.2x the bytes here) and loses the digest.

With ``fleet_mirror=None`` nothing here runs and every host downloads from upstream as
before. The deploy prints, per host and for the fleet, what came from upstream and what
from the fleet source (see :class:`DistributionReport`).
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import json
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from urllib.parse import urlsplit

from pyinfra import host, logger
from pyinfra.api import FactBase, FunctionCommand, StringCommand, operation
from pyinfra.api.exceptions import OperationError
from pyinfra.api.state import BaseStateCallback
from pyinfra.operations import files, systemd

from sparkfleet import olah_wheels
from sparkfleet.config import FleetSource, Settings, fleet_source
from sparkfleet.tasks import detached

PROJECT = Path(__file__).resolve().parents[1]
TEMPLATES = PROJECT / "templates"

# On the mirror host
OPT = "/opt/sparkfleet/mirror"
OLAH_DIR = f"{OPT}/olah"
OLAH_LIB = f"{OLAH_DIR}/lib"
OLAH_MARKER = f"{OLAH_DIR}/installed"
COPY_TOOL = f"{OPT}/sparkfleet-copy-image.py"
HF_UNIT = "sparkfleet-hf-mirror.service"
HF_UNIT_PATH = f"/etc/systemd/system/{HF_UNIT}"
HF_CONFIG = "/etc/sparkfleet/hf-mirror.toml"
REGISTRY_UNIT = "docker-registry.service"
REGISTRY_CONFIG = "/etc/docker/registry/config.yml"
REGISTRY_CERT = "/etc/docker/registry/sparkfleet-mirror.crt"
REGISTRY_KEY = "/etc/docker/registry/sparkfleet-mirror.key"
REGISTRY_USER = "docker-registry"
APT_KEYRING = "/usr/share/keyrings/sparkfleet-mirror.asc"
APT_SOURCES = "/etc/apt/sources.list.d/sparkfleet-mirror.list"
# On the controller
WHEELHOUSE = Path(".sparkfleet/wheelhouse")

MANIFEST_ACCEPT = (
    "application/vnd.docker.distribution.manifest.v2+json,application/vnd.oci.image.manifest.v1+json,"
    "application/vnd.docker.distribution.manifest.list.v2+json,application/vnd.oci.image.index.v1+json"
)
MIB = 1024**2


# --- where things are -------------------------------------------------------------------


@dataclass(frozen=True)
class ImageName:
    """A docker reference split the way registries see it."""

    registry: str  # host[:port]; docker.io for Docker Hub
    path: str  # repository path in that registry (library/x for official images)
    tag: str | None
    digest: str | None

    @classmethod
    def parse(cls, reference: str) -> "ImageName":
        name, _, digest = reference.partition("@")
        tag = None
        if ":" in name.rsplit("/", 1)[-1]:
            name, tag = name.rsplit(":", 1)
        first, _, rest = name.partition("/")
        if rest and ("." in first or ":" in first or first == "localhost"):
            registry, path = first, rest
        else:
            registry, path = "docker.io", name if "/" in name else f"library/{name}"
        if not tag and not digest:
            tag = "latest"
        return cls(registry, path, tag, digest or None)

    def at(self, registry: str) -> str:
        """This image's reference in another registry (same path, tag and digest)."""
        return f"{registry}/{self.path}" + (f":{self.tag}" if self.tag else "") + (
            f"@{self.digest}" if self.digest else ""
        )


def upstream_registry_url(settings: Settings) -> str:
    if settings.image_registry_url:
        return settings.image_registry_url.rstrip("/")
    registry = ImageName.parse(settings.image).registry
    return "https://registry-1.docker.io" if registry == "docker.io" else f"https://{registry}"


def image_reference(settings: Settings, source: FleetSource | None = None) -> str:
    """The reference hosts pull and run: the fleet registry's copy, or ``image`` itself."""
    source = source if source is not None else fleet_source()
    return ImageName.parse(settings.image).at(source.registry) if source else settings.image


def hf_endpoint(settings: Settings, source: FleetSource | None = None) -> str | None:
    """The HF endpoint downloads use: the fleet's HF mirror, or ``hf_endpoint``."""
    source = source if source is not None else fleet_source()
    return source.hf_endpoint if source else settings.hf_endpoint


def source_answers(source: FleetSource, service: str) -> StringCommand:
    """A command that fails this host, saying so, when the fleet source's ``service``
    ("registry" or "hf") does not answer it."""
    if service == "registry":
        probe = f"curl -sf -m 10 --cacert {shlex.quote(host_ca_path(source))} https://{source.registry}/v2/ >/dev/null"
        what = f"registry {source.registry}"
    else:
        probe = f"curl -s -m 10 -o /dev/null {source.hf_endpoint}/"
        what = f"HF mirror {source.hf_endpoint}"
    message = (f"the fleet source {source.host} does not answer ({what}): see its errors above, "
               "or deploy with --data fleet_mirror=none to download from upstream")
    return StringCommand(probe, "||", "{", "echo", shlex.quote(message), ">&2;", "exit", "1;", "}")


def host_ca_path(source: FleetSource) -> str:
    """Where docker looks for the fleet registry's certificate (read per pull: no restart)."""
    return f"/etc/docker/certs.d/{source.registry}/ca.crt"


def tls_files(settings: Settings, source: FleetSource) -> tuple[Path, Path]:
    """The fleet registry's self-signed certificate and key, made once per address on the
    controller (like the API key): (certificate, key)."""
    directory = Path(settings.mirror_tls_dir).expanduser()
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", f"{source.address}-{source.registry_port}")
    cert, key = directory / f"{stem}.crt", directory / f"{stem}.key"
    if cert.exists() and key.exists():
        return cert, key
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    private = ec.generate_private_key(ec.SECP256R1())
    try:
        alt: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(source.address))
    except ValueError:
        alt = x509.DNSName(source.address)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"sparkfleet mirror {source.address}")])
    now = datetime.datetime.now(datetime.timezone.utc)
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
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    key_bytes = private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    tmp = key.with_suffix(".tmp")
    tmp.touch(mode=0o600)
    tmp.write_bytes(key_bytes)
    tmp.replace(key)
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    return cert, key


def mirror_needs(settings: Settings, image_gib: float, path_needs: dict[str, float]) -> dict[str, float]:
    """Disk the mirror's caches still need on the mirror host, added to the preflight's
    needs: the image copy and olah's copy of every file this host still has to fetch."""
    source = fleet_source()
    if not source or not source.is_self:
        return path_needs
    needs = dict(path_needs)
    needs[settings.mirror_dir] = needs.get(settings.mirror_dir, 0.0) + image_gib + path_needs.get(settings.hf_home, 0.0)
    return needs


# --- facts ------------------------------------------------------------------------------


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
    """Which of the fleet-source services run or are enabled here (sparkfleet's own only)."""

    @staticmethod
    def default():
        return []

    def command(self) -> str:
        return (
            f"for u in {HF_UNIT} {REGISTRY_UNIT}; do "
            f"if [ $u = {REGISTRY_UNIT} ] && ! grep -qs sparkfleet {REGISTRY_CONFIG}; then continue; fi; "
            "if systemctl is-active -q $u || systemctl is-enabled -q $u 2>/dev/null; then echo $u; fi; done"
        )

    def process(self, output):
        return [line.strip() for line in output if line.strip()]


# --- operations: the mirror host ---------------------------------------------------------


@operation()
def registry_installed(settings: Settings):
    """
    Install ``docker-registry`` (the CNCF distribution registry) when it is missing.

    + settings: validated settings (``mirror_apt_repo``/``mirror_apt_key_url``: a repository to
      take it from; None: the host's own archives, Ubuntu universe / Debian main)
    """
    if host.get_fact(CommandAvailable, program="docker-registry"):
        host.noop("docker-registry is installed")
        return
    q = shlex.quote
    if settings.mirror_apt_repo:
        yield f"curl -fsSL --retry 3 {q(settings.mirror_apt_key_url)} -o {APT_KEYRING}"
        yield f"echo {q(f'deb [signed-by={APT_KEYRING}] {settings.mirror_apt_repo} /')} > {APT_SOURCES}"
        # Only that list is refreshed: the rest of the host's apt state is not ours.
        yield (
            f"apt-get update -o Dir::Etc::sourcelist={APT_SOURCES} -o Dir::Etc::sourceparts=- "
            "-o APT::Get::List-Cleanup=0"
        )
    else:
        yield "apt-get update"
    # Our config.yml replaces the package's; keep it on upgrades.
    yield (
        "DEBIAN_FRONTEND=noninteractive apt-get install -y -o Dpkg::Options::=--force-confold "
        "--no-install-recommends docker-registry"
    )


def _controller_wheelhouse(requirement: str, python: dict) -> Path:
    """Wheels of ``requirement`` (+ pip) for the host's Python, downloaded once by the
    controller's pip from its index (PyPI): the host needs no index and no pip of its own."""
    import pip

    machine, glibc = python["machine"], python["glibc"]
    tag = f"{python['major']}{python['minor']}"
    platforms = [f"manylinux2014_{machine}"]
    if machine == "x86_64":
        platforms += ["manylinux1_x86_64", "manylinux2010_x86_64"]
    if re.match(r"^2\.\d+$", glibc):
        platforms += [f"manylinux_2_{m}_{machine}" for m in range(17, int(glibc.split(".")[1]) + 1)]
    inputs = [requirement, tag, sorted(platforms), pip.__version__, olah_wheels.WITHOUT_DEPS]
    key = hashlib.sha256(json.dumps(inputs).encode()).hexdigest()[:16]
    final = WHEELHOUSE / f"{re.sub(r'[^A-Za-z0-9]+', '-', requirement)}-cp{tag}-{machine}-{key}"
    if (final / ".complete").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=final.name + ".", dir=final.parent))
    common = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "-d", str(tmp)]
    target = ["--only-binary=:all:", "--python-version", f"{python['major']}.{python['minor']}",
              "--implementation", "cp", "--abi", f"cp{tag}", *[a for p in platforms for a in ("--platform", p)]]
    pip_wheel = [*common, "--no-deps", f"pip=={pip.__version__}"]
    for args in chain(olah_wheels.downloads([*common, *target], requirement, tmp), [pip_wheel]):
        done = subprocess.run(args, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise OperationError(
                f"the controller could not download {requirement} for Python {python['major']}.{python['minor']} "
                f"on {machine} (pip exit {done.returncode}):\n    " + "\n    ".join(done.stderr.strip().splitlines()[-8:])
            )
    (tmp / ".complete").write_text(requirement + "\n")
    if final.exists():
        subprocess.run(["rm", "-rf", str(final)], check=False)
    tmp.rename(final)
    return final


def _install_olah(state, host, requirement: str, python: dict) -> bool:  # pyinfra passes state, host
    wheels = _controller_wheelhouse(requirement, python)
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "wheels.tar.gz"
        subprocess.run(["tar", "czf", str(archive), "-C", str(wheels), "."], check=True, timeout=300)
        host.run_shell_command(StringCommand(f"mkdir -p {OLAH_DIR}"), print_output=False)
        if not host.put_file(str(archive), f"{OLAH_DIR}/wheels.tar.gz", print_output=False):
            raise OperationError(f"could not upload the {requirement} wheels")
    q = shlex.quote
    script = (
        f"set -e; cd {OLAH_DIR}; rm -rf wheels lib.new; mkdir wheels; tar xzf wheels.tar.gz -C wheels; "
        "pip=$(ls wheels/pip-*.whl | head -n 1); "
        f"python3 \"$pip/pip\" install -q --disable-pip-version-check --root-user-action=ignore --no-index "
        "--no-deps --target lib.new $(ls wheels/*.whl | grep -v /pip-); "  # the set is the closure (olah_wheels)
        f"rm -rf lib; mv lib.new lib; rm -rf wheels wheels.tar.gz; echo {q(requirement)} > {OLAH_MARKER}"
    )
    ok, output = host.run_shell_command(StringCommand("sh", "-c", q(script)), print_output=False, _timeout=900)
    if not ok:
        raise OperationError(f"installing {requirement} failed:\n    " + "\n    ".join(output.stderr_lines[-10:]))
    return True


@operation()
def hf_mirror_installed(settings: Settings):
    """
    Install the HF mirror (``mirror_olah``, e.g. olah==0.5.4) into /opt/sparkfleet/mirror/olah.

    + settings: validated settings (``mirror_olah``)

    The controller downloads the wheels for the host's python3 and uploads them; the host
    installs them with pip run from its wheel: it needs python3 (3.10+), no pip, no index.
    """
    if host.get_fact(FileFirstLine, path=OLAH_MARKER) == settings.mirror_olah:
        host.noop(f"{settings.mirror_olah} is installed")
        return
    python = host.get_fact(HostPython)
    if python is None or (python["major"], python["minor"]) < (3, 10):
        yield StringCommand(
            "echo", shlex.quote("the HF mirror (olah) needs python3 3.10 or newer on the mirror host; "
                                "install it, or pick another fleet_mirror"), ">&2; exit 1",
        )
        return
    yield FunctionCommand(_install_olah, (settings.mirror_olah, python), {})


def _upstream_hub(settings: Settings) -> tuple[str, str, str]:
    """(scheme, netloc, LFS netloc) of the hub olah fetches from."""
    if not settings.hf_endpoint:
        return "https", "huggingface.co", "cdn-lfs.huggingface.co"
    url = urlsplit(settings.hf_endpoint)
    return url.scheme, url.netloc, url.netloc


@operation()
def image_copied(settings: Settings, source: FleetSource):
    """
    Copy the serving image, byte for byte, into the fleet registry unless it holds it.

    + settings: validated settings (``image``, ``image_registry_url``)
    + source: this host, the fleet source
    """
    name = ImageName.parse(settings.image)
    local = f"https://{source.registry}"
    if host.get_fact(RegistryManifest, url=local, path=name.path, reference=name.digest or name.tag,
                     cacert=REGISTRY_CERT):
        host.noop(f"the fleet registry holds {name.path}@{name.digest or name.tag}")
        return
    q = shlex.quote
    result = f"{settings.mirror_dir}/image-copy.json"
    command = (
        f"rm -f {q(result)}; python3 {COPY_TOOL} {q(upstream_registry_url(settings))} {q(name.path)} "
        f"{q(name.digest or name.tag or 'latest')} {q(local)} --cacert {REGISTRY_CERT} --result {q(result)}"
        + (f" --tag {q(name.tag)}" if name.tag else "")
    )
    yield detached("image-copy", command)
    yield FunctionCommand(_record_copy, (result,), {})


def _record_copy(state, host, result_path: str) -> bool:
    ok, output = host.run_shell_command(StringCommand(f"cat {shlex.quote(result_path)}"), print_output=False)
    try:
        result = json.loads("\n".join(output.stdout_lines))
    except ValueError:
        return True
    _report(state).copy = result
    return True


def serving_mirror(settings: Settings, source: FleetSource) -> list:
    """On the mirror host: the registry with the image copy and the HF mirror, each up and
    restarted only when its configuration changed. Returns the operations (for the report)."""
    cert, key = tls_files(settings, source)
    installed = registry_installed(name="fleet source: docker-registry installed", settings=settings)
    storage = files.directory(
        name="fleet source: registry storage", path=f"{settings.mirror_dir}/registry",
        user=REGISTRY_USER, group=REGISTRY_USER, mode="750",
    )
    tls = [
        files.put(name="fleet source: registry certificate", src=str(cert), dest=REGISTRY_CERT, mode="644"),
        files.put(name="fleet source: registry key", src=str(key), dest=REGISTRY_KEY,
                  user="root", group=REGISTRY_USER, mode="640"),
    ]
    config = files.template(
        name="fleet source: registry configuration", src=str(TEMPLATES / "registry-mirror.yml.j2"),
        dest=REGISTRY_CONFIG, mode="644", storage=f"{settings.mirror_dir}/registry",
        port=source.registry_port, cert=REGISTRY_CERT, key=REGISTRY_KEY,
    )
    registry_feeds = (installed, storage, *tls, config)
    systemd.service(name=f"fleet source: {REGISTRY_UNIT} running", service=REGISTRY_UNIT, running=True, enabled=True)
    systemd.service(
        name=f"fleet source: {REGISTRY_UNIT} restarted for its new configuration", service=REGISTRY_UNIT,
        restarted=True, _if=lambda: any(op.did_change() for op in registry_feeds),
    )

    olah = hf_mirror_installed(name=f"fleet source: HF mirror ({settings.mirror_olah}) installed", settings=settings)
    scheme, netloc, lfs_netloc = _upstream_hub(settings)
    hf_config = files.template(
        name="fleet source: HF mirror configuration", src=str(TEMPLATES / "hf-mirror.toml.j2"),
        dest=HF_CONFIG, mode="644", port=source.hf_port, repos=f"{settings.mirror_dir}/hf/repos",
        scheme=scheme, netloc=netloc, lfs_netloc=lfs_netloc, address=source.address,
    )
    hf_unit = files.template(
        name=f"fleet source: systemd unit {HF_UNIT}", src=str(TEMPLATES / "sparkfleet-hf-mirror.service.j2"),
        dest=HF_UNIT_PATH, mode="644", lib=OLAH_LIB, config=HF_CONFIG, data_dir=f"{settings.mirror_dir}/hf",
        requirement=settings.mirror_olah,
        # olah spends ~tens of ms of CPU per request; one process per core, up to 4.
        workers=max(1, min(4, host.get_fact(CPUCount))),
    )
    hf_data = files.directory(name="fleet source: HF mirror cache", path=f"{settings.mirror_dir}/hf/repos")
    systemd.daemon_reload(name="fleet source: systemd reload for the HF mirror unit", _if=hf_unit.did_change)
    systemd.service(name=f"fleet source: {HF_UNIT} running", service=HF_UNIT, running=True, enabled=True)
    hf_feeds = (olah, hf_config, hf_unit, hf_data)
    systemd.service(
        name=f"fleet source: {HF_UNIT} restarted for its new configuration", service=HF_UNIT,
        restarted=True, _if=lambda: any(op.did_change() for op in hf_feeds),
    )
    # Both answer before anything is fetched from them.
    ready = wait_serving(name="fleet source: registry and HF mirror answer", source=source)
    tool = files.put(name="fleet source: image copy tool", src=str(TEMPLATES / "sparkfleet-copy-image.py"),
                     dest=COPY_TOOL, mode="755")
    copy = image_copied(name="fleet source: serving image copied from upstream", settings=settings, source=source)
    return [installed, olah, ready, tool, copy]


class ServingAnswers(FactBase[bool]):
    """Whether the fleet registry and the HF mirror both answer on this host."""

    @staticmethod
    def default():
        return False

    def command(self, registry: str, hf_port: int) -> str:
        return (
            f"curl -sf -m 5 --cacert {REGISTRY_CERT} https://{registry}/v2/ >/dev/null && "
            f"curl -s -m 5 -o /dev/null http://127.0.0.1:{hf_port}/ && echo yes || echo no"
        )

    def process(self, output):
        return bool(output) and output[-1].strip() == "yes"


@operation(is_idempotent=False)
def wait_serving(source: FleetSource):
    """
    Wait (up to 60 s) until the fleet registry and the HF mirror answer.

    + source: this host, the fleet source
    """
    if host.get_fact(ServingAnswers, registry=source.registry, hf_port=source.hf_port):
        host.noop("the registry and the HF mirror answer")
        return
    yield StringCommand(
        "sh", "-c",
        shlex.quote(
            "for i in $(seq 60); do "
            f"curl -sf -m 5 --cacert {REGISTRY_CERT} https://{source.registry}/v2/ >/dev/null && "
            f"curl -s -m 5 -o /dev/null http://127.0.0.1:{source.hf_port}/ && exit 0; sleep 1; done; "
            f"echo 'the fleet source does not answer: see journalctl -u {REGISTRY_UNIT} -u {HF_UNIT}' >&2; "
            f"journalctl -u {REGISTRY_UNIT} -u {HF_UNIT} -n 20 --no-pager -o cat >&2; exit 1"
        ),
    )


# --- the state of every host -----------------------------------------------------------


def fleet_source_ready(settings: Settings) -> list:
    """The fleet source for this host: served here (mirror host), trusted (every host using
    it), or stopped (a host that served it before). Returns the operations it declared."""
    source = fleet_source()
    ops: list = []
    if source and source.is_self:
        ops += serving_mirror(settings, source)
    else:
        # A host that served the fleet before (fleet_mirror moved or off): stop its services.
        for unit in host.get_fact(MirrorUnits):
            ops.append(systemd.service(name=f"former fleet source: {unit} stopped", service=unit,
                                       running=False, enabled=False))
    if source:
        cert, _ = tls_files(settings, source)
        ops.append(files.put(name="fleet source: its registry certificate trusted by docker",
                             src=str(cert), dest=host_ca_path(source), mode="644"))
    _report(host.state).sources[host.name] = source
    return ops


# --- the report ---------------------------------------------------------------------------


@dataclass
class _HostRecord:
    source: FleetSource | None = None
    image_op: object = None
    weights_op: object = None
    repo_dirs: list[str] = field(default_factory=list)
    repo_bytes_before: int = 0
    address: str = ""


class DistributionReport(BaseStateCallback):
    """Prints, once the distribution steps ended on every host, what each host received and
    from where, what the fleet took from upstream, and how long the steps took.

    Measured, not assumed: bytes a host received are its HF cache's growth (weights) and the
    fleet registry's access log for its address (image); bytes from upstream are what the
    copy tool read (image) and the growth of the HF mirror's cache (weights, which it stores
    as fetched). Nothing is printed when nothing was fetched.
    """

    def __init__(self) -> None:
        self.hosts: dict[str, _HostRecord] = {}
        self.sources: dict[str, FleetSource | None] = {}
        self.tracked: set[str] = set()
        self.steps: dict[str, str] = {}  # op hash -> step (fleet source, image, weights)
        self.step_start: dict[str, float] = {}
        self.step_seconds: dict[str, float] = {}
        self.ended: set[str] = set()
        self.started: float | None = None
        self.finished: float | None = None
        self.wall_start: float | None = None
        self.copy: dict | None = None
        self.hf_cache_before: int | None = None
        self.mirror_dir: str | None = None

    def track(self, step: str, *ops) -> None:
        for op in ops:
            if op is not None:
                self.tracked.add(op._hash)
                self.steps[op._hash] = step

    def operation_start(self, state, op_hash):  # noqa: D401 - pyinfra callback
        if op_hash not in self.tracked:
            return
        self.step_start[op_hash] = time.monotonic()
        if self.started is None:
            self.started = time.monotonic()
            self.wall_start = time.time()

    def operation_end(self, state, op_hash):
        if op_hash not in self.tracked:
            return
        step = self.steps[op_hash]
        self.step_seconds[step] = self.step_seconds.get(step, 0.0) + time.monotonic() - self.step_start.get(
            op_hash, time.monotonic()
        )
        self.ended.add(op_hash)
        if self.ended >= self.tracked:
            self.finished = time.monotonic()
            try:
                self.print(state)
            except Exception as exc:  # noqa: BLE001 - a report must never fail a deploy
                logger.warning(f"distribution report: {exc}")

    # --- measuring ---------------------------------------------------------------------

    def _fetched(self, record: _HostRecord, which: str) -> bool:
        op = getattr(record, which)
        return bool(op is not None and op.did_change())

    def print(self, state) -> None:
        names = [n for n, r in self.hosts.items()
                 if self._fetched(r, "image_op") or self._fetched(r, "weights_op")]
        if not names:
            return
        inventory = {h.name: h for h in state.inventory}
        mirrors = {r.source.host for r in self.hosts.values() if r.source}
        registry_bytes: dict[str, int] = {}
        for mirror in mirrors:
            if mirror in inventory:
                registry_bytes.update(_registry_bytes_by_client(inventory[mirror], self.wall_start))
        lines: list[str] = []
        totals = {"image_source": 0, "weights_source": 0, "weights_direct": 0, "direct_image_hosts": 0}
        for name in names:
            record = self.hosts[name]
            parts = []
            weights = 0
            if self._fetched(record, "weights_op") and name in inventory:
                weights = max(0, _dir_bytes(inventory[name], record.repo_dirs) - record.repo_bytes_before)
            if record.source:
                client = _source_address(inventory[name], record.source.address) if name in inventory else ""
                image = registry_bytes.get(client, 0)
                totals["image_source"] += image
                totals["weights_source"] += weights
                if self._fetched(record, "image_op"):
                    parts.append(f"image {_mib(image)} from the fleet source")
                if self._fetched(record, "weights_op"):
                    parts.append(f"weights {_mib(weights)} from the fleet source")
                parts.append("0 B from upstream")
            else:
                totals["weights_direct"] += weights
                if self._fetched(record, "image_op"):
                    totals["direct_image_hosts"] += 1
                    parts.append("image pulled from upstream")
                if self._fetched(record, "weights_op"):
                    parts.append(f"weights {_mib(weights)} from upstream")
            lines.append(f"    [{name}] " + ", ".join(parts))
        upstream: list[str] = []
        if mirrors:
            mirror = sorted(mirrors)[0]
            if self.copy is not None:
                upstream.append(f"image {_mib(self.copy.get('upstream_bytes', 0))} (copied once into the fleet registry)")
            if self.hf_cache_before is not None and mirror in inventory and self.mirror_dir:
                grown = _dir_bytes(inventory[mirror], [f"{self.mirror_dir}/hf/repos"]) - self.hf_cache_before
                upstream.append(f"weights {_mib(max(0, grown))} (into the HF mirror's cache)")
        if totals["weights_direct"]:
            upstream.append(f"weights {_mib(totals['weights_direct'])} downloaded directly")
        if totals["direct_image_hosts"]:
            upstream.append(f"image pulled directly by {totals['direct_image_hosts']} host(s)")
        took = (self.finished or time.monotonic()) - (self.started or time.monotonic())
        where = ", ".join(sorted(f"{m} ({self.hosts[m].address or m})" for m in mirrors if m in self.hosts)) or "none"
        logger.info(
            "\n--> Distribution (fleet source: " + where + ")\n" + "\n".join(lines) + "\n"
            f"    fleet: from upstream: {', '.join(upstream) or 'nothing'}"
            + (f"; from the fleet source: image {_mib(totals['image_source'])}, weights {_mib(totals['weights_source'])}"
               if mirrors else "") + "\n"
            f"    distribution steps took {took:.1f} s: "
            + ", ".join(f"{step} {self.step_seconds[step]:.1f} s" for step in ("fleet source", "image", "weights")
                        if step in self.step_seconds) + "\n"
        )


def _mib(n: int) -> str:
    return f"{n / MIB:.1f} MiB" if n >= 0.1 * MIB or n == 0 else f"{n} B"


def _dir_bytes(target_host, paths: list[str]) -> int:
    if not paths:
        return 0
    quoted = " ".join(shlex.quote(p) for p in paths)
    ok, output = target_host.run_shell_command(
        StringCommand(f"du -sbc {quoted} 2>/dev/null | tail -n 1 | cut -f1"), print_output=False
    )
    line = output.stdout_lines[-1].strip() if ok and output.stdout_lines else ""
    return int(line) if line.isdigit() else 0


def _source_address(target_host, mirror_address: str) -> str:
    """The address ``target_host`` reaches the mirror from (what the registry logs)."""
    q = shlex.quote(mirror_address)
    ok, output = target_host.run_shell_command(
        StringCommand(
            f"a=$(getent ahostsv4 {q} | awk 'NR==1{{print $1}}'); "
            "ip -o route get \"${a:-" + q + "}\" 2>/dev/null | sed -n 's/.* src \\([^ ]*\\).*/\\1/p'"
        ),
        print_output=False,
    )
    return output.stdout_lines[0].strip() if ok and output.stdout_lines else ""


_ACCESS = re.compile(r'^(\S+) - \S+ \[[^\]]*\] "GET /v2/\S+/blobs/sha256:[0-9a-f]+ [^"]*" 2\d\d (\d+)')


def _registry_bytes_by_client(mirror_host, since: float | None) -> dict[str, int]:
    """Blob bytes the fleet registry sent per client address since ``since`` (its access log)."""
    if since is None:
        return {}
    ok, output = mirror_host.run_shell_command(
        StringCommand(f"journalctl -u {REGISTRY_UNIT} --since @{int(since) - 1} -o cat --no-pager 2>/dev/null"),
        print_output=False,
    )
    sent: dict[str, int] = {}
    for line in output.stdout_lines if ok else []:
        m = _ACCESS.match(line)
        if m:
            sent[m.group(1)] = sent.get(m.group(1), 0) + int(m.group(2))
    return sent


_REPORTS: dict[int, DistributionReport] = {}


def _report(state) -> DistributionReport:
    key = id(state)
    if key not in _REPORTS:
        _REPORTS[key] = DistributionReport()
        state.add_callback_handler(_REPORTS[key])
    return _REPORTS[key]


def report(settings: Settings, ops: list, image_op, weights_op, repo_dirs: list[str]) -> None:
    """Register this host's distribution operations with the run's report."""
    source = fleet_source()
    rep = _report(host.state)
    rep.track("fleet source", *ops)
    rep.track("image", image_op)
    rep.track("weights", weights_op)
    record = _HostRecord(source=source, image_op=image_op, weights_op=weights_op, repo_dirs=repo_dirs,
                         address=source.address if source and source.is_self else "")
    if repo_dirs and weights_op is not None and weights_op.will_change:
        record.repo_bytes_before = sum(host.get_fact(DirBytes, path=p) for p in repo_dirs)
    rep.hosts[host.name] = record
    if source and source.is_self:
        rep.mirror_dir = settings.mirror_dir
        rep.hf_cache_before = host.get_fact(DirBytes, path=f"{settings.mirror_dir}/hf/repos")
