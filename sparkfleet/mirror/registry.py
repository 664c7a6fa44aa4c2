"""The mirror registry: Debian/Ubuntu ``docker-registry`` over TLS, holding a byte-exact
copy of the serving image made by ``templates/sparkfleet-copy-image.py``.

Why a copy and not a pull-through cache: measured on the testbed, docker-registry 2.8's
proxy reads every cold blob from upstream twice (once to store it, once to serve it) and
once more per concurrent client (2.0x and 3.9x the image). A ``docker save``/``load``
fan-out sends the uncompressed layers (3.2x the bytes here) and loses the digest.
"""

from __future__ import annotations

import json
import shlex

from pyinfra import host
from pyinfra.api import FunctionCommand, operation
from pyinfra.facts.server import Which

from sparkfleet import remote
from sparkfleet.config import Mirror
from sparkfleet.facts import RegistryManifest
from sparkfleet.hostpaths import COPY_TOOL, MIRROR_APT_KEYRING, MIRROR_APT_SOURCES, REGISTRY_CERT
from sparkfleet.mirror.names import ImageName
from sparkfleet.mirror.report import report_of
from sparkfleet.tasks import detached


@operation()
def installed(apt_repo: str | None, apt_key_url: str | None):
    """
    Install ``docker-registry`` (the CNCF registry, "distribution") when it is missing.

    + apt_repo, apt_key_url: a repository to take it from and its signing key
      (``mirror_apt_repo``/``mirror_apt_key_url``); None: the host's own archives,
      Ubuntu universe / Debian main
    """
    if host.get_fact(Which, command="docker-registry"):
        host.noop("docker-registry is installed")
        return
    q = shlex.quote
    if apt_repo:
        yield f"curl -fsSL --retry 3 {q(apt_key_url)} -o {MIRROR_APT_KEYRING}"
        yield f"echo {q(f'deb [signed-by={MIRROR_APT_KEYRING}] {apt_repo} /')} > {MIRROR_APT_SOURCES}"
        # Only that list is refreshed: the rest of the host's apt state is not ours.
        yield (
            f"apt-get update -o Dir::Etc::sourcelist={MIRROR_APT_SOURCES} -o Dir::Etc::sourceparts=- "
            "-o APT::Get::List-Cleanup=0"
        )
    else:
        yield "apt-get update"
    # Our config.yml replaces the package's; keep it on upgrades.
    yield (
        "DEBIAN_FRONTEND=noninteractive apt-get install -y -o Dpkg::Options::=--force-confold "
        "--no-install-recommends docker-registry"
    )


@operation()
def image_copied(image: str, upstream: str, result_dir: str, mirror: Mirror):
    """
    Copy the serving image, byte for byte, into the mirror registry unless it holds it.

    + image: the serving image's reference (``image``)
    + upstream: the URL of the registry to copy it from
    + result_dir: where the copy tool leaves its count of bytes (``mirror_dir``)
    + mirror: this host, the mirror
    """
    name = ImageName.parse(image)
    local = f"https://{mirror.registry}"
    if host.get_fact(RegistryManifest, url=local, path=name.path, reference=name.digest or name.tag,
                     cacert=REGISTRY_CERT):
        host.noop(f"the mirror registry holds {name.path}@{name.digest or name.tag}")
        return
    q = shlex.quote
    result = f"{result_dir}/image-copy.json"
    command = (
        f"rm -f {q(result)}; python3 {COPY_TOOL} {q(upstream)} "
        f"{q(name.path)} {q(name.digest or name.tag or 'latest')} {q(local)} --cacert {REGISTRY_CERT} "
        f"--result {q(result)}" + (f" --tag {q(name.tag)}" if name.tag else "")
    )
    yield detached("image-copy", command)
    yield FunctionCommand(_record_copy, (result,), {})


def _record_copy(state, host, result_path: str) -> bool:  # pyinfra passes state, host
    done = remote.run(host, f"cat {shlex.quote(result_path)}")
    try:
        result = json.loads("\n".join(done.stdout))
    except ValueError:
        return True
    report_of(state).copy = result
    return True
