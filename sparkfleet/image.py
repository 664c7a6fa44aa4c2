"""The serving image: pulled when absent, pinnable by digest, nothing done when present.

With a fleet source (``fleet_mirror``) every host pulls the fleet registry's byte-exact
copy of ``image`` (same digest) and runs that reference; without, ``image`` itself. A
pull is checked: the host must end with the fleet's digest, or it fails saying which.
"""

from __future__ import annotations

import json
import shlex

from pyinfra import host
from pyinfra.api import FactBase, FunctionCommand, StringCommand, operation
from pyinfra.api.exceptions import OperationError

from sparkfleet.config import Settings, fleet_source
from sparkfleet.distribution import MANIFEST_ACCEPT, ImageName, image_reference, source_answers
from sparkfleet.tasks import detached


class Image(FactBase["dict | None"]):
    """The local image ``reference`` resolves to: id and repo digests, or None."""

    def command(self, reference: str) -> str:
        return (
            f"docker image inspect --format '{{{{json .Id}}}} {{{{json .RepoDigests}}}}' "
            f"{shlex.quote(reference)} 2>/dev/null || true"
        )

    def process(self, output):
        if not output or not output[0].startswith('"'):
            return None
        image_id, digests = output[0].split(" ", 1)
        return {"id": json.loads(image_id), "repo_digests": json.loads(digests) or []}


def pinned_digest(reference: str) -> str | None:
    return reference.split("@", 1)[1] if "@" in reference else None


def _present(ref: str) -> bool:
    image = host.get_fact(Image, reference=ref)
    if image is None:
        return False
    digest = pinned_digest(ref)
    return digest is None or any(d.endswith("@" + digest) for d in image["repo_digests"])


def is_present(reference: str) -> bool:
    """Whether ``reference`` (or, with a fleet source, its copy in the fleet registry) is here."""
    if _present(reference):
        return True
    source = fleet_source()
    return bool(source) and _present(ImageName.parse(reference).at(source.registry))


def _verify(state, host, ref: str, expected: str | None, mirror_ref: str | None) -> bool:  # state, host: pyinfra's
    """After a pull: the host must hold the fleet's digest (the pin, or the fleet registry's)."""
    q = shlex.quote
    _, out = host.run_shell_command(
        StringCommand(f"docker image inspect --format '{{{{json .RepoDigests}}}}' {q(ref)}"), print_output=False
    )
    try:
        digests = json.loads("\n".join(out.stdout_lines) or "[]") or []
    except ValueError:
        digests = []
    if expected is None and mirror_ref:
        name = ImageName.parse(mirror_ref)
        registry = name.registry
        _, out = host.run_shell_command(
            StringCommand(
                f"curl -sfI -m 10 --cacert /etc/docker/certs.d/{registry}/ca.crt "
                f"-H {q('Accept: ' + MANIFEST_ACCEPT)} "
                f"{q(f'https://{registry}/v2/{name.path}/manifests/{name.tag}')} | tr -d '\\r' "
                "| sed -n 's/^[Dd]ocker-[Cc]ontent-[Dd]igest: *//p'"
            ),
            print_output=False,
        )
        expected = (out.stdout_lines or [""])[0].strip() or None
    if expected and not any(d.endswith("@" + expected) for d in digests):
        raise OperationError(
            f"{ref} on this host has digest {', '.join(d.split('@')[-1] for d in digests) or 'none'}, "
            f"the fleet's image is {expected}: the tag moved while the fleet pulled it; pin "
            "`image` to name@sha256:... so that every host runs the same image"
        )
    return True


@operation()
def pulled(settings: Settings):
    """
    Pull the serving image unless this exact reference is already on the host.

    + settings: validated settings (``image``; pin it as ``name@sha256:...`` for a fleet)

    A tag that moved upstream is not re-pulled: pin a digest to change what runs. With a
    fleet source the pull comes from its registry, and a host left with another digest
    than the fleet's fails with both digests named.
    """
    source = fleet_source()
    ref = image_reference(settings, source)
    if _present(ref):
        host.noop(f"image {ref} is present")
        return
    if source:
        yield source_answers(source, "registry")
    yield detached("image-pull", f"docker pull {shlex.quote(ref)}")
    yield FunctionCommand(_verify, (ref, pinned_digest(ref), ref if source and not pinned_digest(ref) else None), {})
