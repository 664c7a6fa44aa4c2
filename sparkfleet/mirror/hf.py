"""The HF mirror: the real ``olah`` (PyPI) as ``sparkfleet-hf-mirror.service``.

It fetches each file from the hub once — concurrent requests for a block it does not
have yet share one upstream download — and serves the fleet from its cache. Hosts
download with their usual huggingface_hub and ``HF_ENDPOINT`` pointing at it: same cache
layout, revision pinning and resume; the token stays in ``hf.env`` and olah forwards it
upstream per request (it never stores it).

The controller downloads olah's wheels for the mirror host's Python and uploads them:
the host needs python3 3.10+, no pip and no index.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import subprocess
import sys
import tempfile
from itertools import chain
from pathlib import Path
from urllib.parse import urlsplit

from pyinfra import host
from pyinfra.api import StringCommand, operation
from pyinfra.api.exceptions import OperationError

from sparkfleet import olah_wheels, remote, snapshot
from sparkfleet.hostpaths import OLAH_DIR, OLAH_MARKER
from sparkfleet.mirror.facts import HostPython

#: On the controller: olah's wheels per requirement and host Python.
WHEELHOUSE = Path(".sparkfleet/wheelhouse")


def controller_wheelhouse(requirement: str, python: dict) -> Path:
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
    # A complete wheelhouse is never removed: another deploy from this checkout may be
    # reading it. One that finished first wins, and this download goes.
    try:
        tmp.rename(final)
    except OSError:
        if not (final / ".complete").exists():
            raise
        subprocess.run(["rm", "-rf", str(tmp)], check=False)
    return final


def _install_olah(state, host, requirement: str, python: dict) -> bool:  # pyinfra passes state, host
    wheels = controller_wheelhouse(requirement, python)
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "wheels.tar.gz"
        subprocess.run(["tar", "czf", str(archive), "-C", str(wheels), "."], check=True, timeout=300)
        remote.run(host, f"mkdir -p {OLAH_DIR}")
        remote.put(host, str(archive), f"{OLAH_DIR}/wheels.tar.gz")
    q = shlex.quote
    script = (
        f"set -e; cd {OLAH_DIR}; rm -rf wheels lib.new; mkdir wheels; tar xzf wheels.tar.gz -C wheels; "
        "pip=$(ls wheels/pip-*.whl | head -n 1); "
        f"python3 \"$pip/pip\" install -q --disable-pip-version-check --root-user-action=ignore --no-index "
        "--no-deps --target lib.new $(ls wheels/*.whl | grep -v /pip-); "  # the set is the closure (olah_wheels)
        f"rm -rf lib; mv lib.new lib; rm -rf wheels wheels.tar.gz; echo {q(requirement)} > {OLAH_MARKER}"
    )
    done = remote.run(host, StringCommand("sh", "-c", q(script)), timeout=900)
    if not done.ok:
        raise OperationError(f"installing {requirement} failed:\n    " + "\n    ".join(done.stderr[-10:]))
    return True


@operation()
def installed(requirement: str):
    """
    Install the HF mirror into /opt/sparkfleet/mirror/olah.

    + requirement: the pip requirement (``mirror_olah``, e.g. olah==0.5.4)

    The controller downloads the wheels for the host's python3 and uploads them; the host
    installs them with pip run from its wheel: it needs python3 (3.10+), no pip, no index.
    """
    if snapshot.first_line(OLAH_MARKER) == requirement:
        host.noop(f"{requirement} is installed")
        return
    python = host.get_fact(HostPython)
    if python is None or (python["major"], python["minor"]) < (3, 10):
        yield remote.fail("the HF mirror (olah) needs python3 3.10 or newer on the mirror host; "
                          "install it, or pick another fleet_mirror")
        return
    yield remote.callback(_install_olah, requirement, python)


def upstream_hub(hf_endpoint: str | None) -> tuple[str, str, str]:
    """(scheme, netloc, LFS netloc) of the hub olah fetches from."""
    if not hf_endpoint:
        return "https", "huggingface.co", "cdn-lfs.huggingface.co"
    url = urlsplit(hf_endpoint)
    return url.scheme, url.netloc, url.netloc
