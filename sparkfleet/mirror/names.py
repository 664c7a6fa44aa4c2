"""Names of the mirror's services as the fleet's hosts see them: the mirror's address,
image references in the mirror registry, the HF endpoint, the upstream registry the copy
reads from."""

from __future__ import annotations

import ipaddress
from collections import Counter
from dataclasses import dataclass, replace

from sparkfleet.config import ConfigError, Mirror, Settings, host_mirror
from sparkfleet.facts import RouteSource, SshServerAddress

#: Per run (pyinfra state): {mirror host: the address the fleet reaches it at}.
_ADDRESSES: dict[int, tuple[object, dict[str, str]]] = {}


def located(state, current, mirrors: dict[str, Mirror | None]) -> Mirror | None:
    """``current``'s mirror with the address every host of the fleet uses for it.

    The controller's name for the mirror (an SSH alias, a ``.local`` name) may resolve
    nowhere else, and a host-network container has no mDNS. So unless ``mirror_address``
    says, the address is the mirror's own source address on its route to each peer (``ip
    route get <peer>`` on the mirror, the peer being where the controller reached it):
    the address the peer's packets come back from, which a name or the controller's
    view of the mirror (a VPN, an SSH alias) need not be. One address for the fleet:
    olah writes it into redirects and the registry certificate names it. Every host
    checks that it answers before it pulls or downloads (clients.answers).
    """
    mirror = mirrors.get(current.name)
    if mirror is None or mirror.address:
        return mirror
    kept, found = _ADDRESSES.get(id(state), (None, {}))
    if kept is not state:  # an id is reused once its state is gone
        found = {}
        _ADDRESSES[id(state)] = (state, found)
    if mirror.host not in found:
        users = [name for name, m in mirrors.items() if m and m.host == mirror.host]
        found[mirror.host] = _fleet_address(state, mirror.host, users)
    return replace(mirror, address=found[mirror.host])


def _usable(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return not (ip.is_loopback or ip.is_link_local or ip.is_unspecified)


def _fleet_address(state, mirror_name: str, users: list[str]) -> str:
    server = state.inventory.get_host(mirror_name)
    peers = [state.inventory.get_host(n) for n in users if n != mirror_name]
    peers = [p for p in peers if p in state.active_hosts]
    seen: dict[str, str] = {}
    for peer in peers:
        reached_at = peer.get_fact(SshServerAddress, _sudo=False)
        source = server.get_fact(RouteSource, address=reached_at) if _usable(reached_at) else ""
        seen[peer.name] = (source if _usable(source) else "") or f"none (reached at {reached_at or '?'})"
    sources = Counter(a for a in seen.values() if _usable(a))
    if sources:
        return sources.most_common(1)[0][0]
    own = server.get_fact(SshServerAddress, _sudo=False)
    if _usable(own) or not peers:
        return own if _usable(own) else "127.0.0.1"  # a fleet of one reaches itself
    routes = "; ".join(f"to {name}: {a}" for name, a in seen.items())
    raise ConfigError(
        f"{mirror_name}: the mirror has no address the other hosts can reach ({routes}), nothing was "
        f"changed on any host. Fix: set mirror_address (host data of {mirror_name}) to an address of it "
        "every host reaches, or deploy with --data fleet_mirror=none"
    )


@dataclass(frozen=True)
class ImageName:
    """A docker reference split the way registries see it."""

    registry: str  # host[:port]; docker.io for Docker Hub
    path: str  # repository path in that registry (library/x for official images)
    tag: str | None
    digest: str | None

    @classmethod
    def parse(cls, reference: str) -> ImageName:
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


def upstream_registry_url(image: str, image_registry_url: str | None) -> str:
    """The registry the mirror copies ``image`` from."""
    if image_registry_url:
        return image_registry_url.rstrip("/")
    registry = ImageName.parse(image).registry
    return "https://registry-1.docker.io" if registry == "docker.io" else f"https://{registry}"


def image_reference(settings: Settings, mirror: Mirror | None = None) -> str:
    """The reference hosts pull and run: the mirror registry's copy, or ``image`` itself."""
    mirror = mirror if mirror is not None else host_mirror()
    return ImageName.parse(settings.image).at(mirror.registry) if mirror else settings.image


def hf_endpoint(settings: Settings, mirror: Mirror | None = None) -> str | None:
    """The HF endpoint downloads use: the mirror's HF endpoint, or ``hf_endpoint``."""
    mirror = mirror if mirror is not None else host_mirror()
    return mirror.hf_endpoint if mirror else settings.hf_endpoint
