"""Which host serves the image and the weights to which: the fleet's mirror
(``fleet_mirror``) and, past ``fleet_fanout`` hosts, the relays under it (a tree, breadth
first, a pair's other member under its partner). Decided from the inventory and the
settings alone; the fleet (:mod:`sparkfleet.fleet`) adds the addresses, found on the hosts
once per run."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sparkfleet.config import FIXES, ConfigError, Settings
from sparkfleet.pairs import fleet_pairs

log = logging.getLogger("sparkfleet")

#: An inventory group of this name picks the mirror for fleet_mirror="auto".
MIRROR_GROUP = "mirror"


@dataclass(frozen=True)
class Mirror:
    """A host that serves model files (an HF mirror) and the image (a registry) to others:
    the fleet's mirror, which fetches them from upstream, or a relay, which fetches them
    from the mirror above it (``upstream``)."""

    host: str  # its inventory name
    address: str | None  # how the other hosts reach it (None: found on the hosts, mirror.names)
    hf_port: int
    registry_port: int
    is_self: bool  # the current host is the mirror
    hf_offline_port: int = 0  # the HF mirror serving its cache only (0: none; the fleet's mirror only)
    upstream: Mirror | None = None  # a relay's source (None: upstream itself, the fleet's mirror)
    serves: tuple[str, ...] = ()  # the hosts that fetch from it (the fleet's mirror: all, a relay's fallback)
    depth: int = 0  # hops from the fleet's mirror: a relay copies the image after the ones above it

    @property
    def root(self) -> Mirror:
        """The fleet's mirror, the top of the relays."""
        return self.upstream.root if self.upstream else self

    @property
    def fallbacks(self) -> tuple[Mirror, ...]:
        """Where a host of this relay turns when it fails mid-way: the fleet's mirror, which
        serves every host; the relay itself (``is_self``) first to the one above it, which
        serves it. Nothing for the fleet's mirror."""
        if not self.upstream:
            return ()
        above = (self.upstream, self.root) if self.is_self else (self.root,)
        return tuple({m.host: m for m in above}.values())

    @property
    def netloc_host(self) -> str:
        """The address as URLs and registry names write it (IPv6 in brackets)."""
        return f"[{self.address}]" if self.address and ":" in self.address else str(self.address)

    @property
    def hf_endpoint(self) -> str:
        return f"http://{self.netloc_host}:{self.hf_port}"

    @property
    def hf_offline_endpoint(self) -> str | None:
        """The fleet's mirror's HF mirror that serves its cache only: revisions upstream no
        longer has."""
        root = self.root
        return f"http://{root.netloc_host}:{root.hf_offline_port}" if root.hf_offline_port else None

    @property
    def registry(self) -> str:
        return f"{self.netloc_host}:{self.registry_port}"


def _auto_mirror(hosts: list[Any], unreachable: set[str]) -> str | None:
    """``fleet_mirror=auto``: the first reachable host of group ``mirror``, else of the
    inventory. A host the controller cannot reach is never chosen: its peers could not
    reach it either, and every one of them would fail at its first download."""
    names = [h.name for h in hosts]
    grouped = [h.name for h in hosts if MIRROR_GROUP in (getattr(h, "groups", None) or ())]
    up = [n for n in names if n not in unreachable]
    chosen = next((n for n in grouped if n in up), None) or next(iter(up), None)
    first = (grouped or names or [None])[0]
    if chosen != first and first is not None:
        log.warning("%s is unreachable, so %s serves the mirror (fleet_mirror=auto) in this run",
                    first, chosen or "no host")
    return chosen


def chosen_mirrors(hosts: list[Any], settings: dict[str, Settings],
                    unreachable: frozenset[str] | set[str] = frozenset()) -> tuple[dict[str, str | None], list[str]]:
    names = [h.name for h in hosts]
    auto = _auto_mirror(hosts, set(unreachable)) if any(settings[n].fleet_mirror == "auto" for n in names) else None
    chosen: dict[str, str | None] = {}
    problems: list[str] = []
    for name in names:
        want = settings[name].fleet_mirror
        if want is None or want in names:
            chosen[name] = want
        elif want == "auto":
            chosen[name] = auto
        else:
            problems.append(
                f"{name}: `fleet_mirror` = {want!r} is not a host of the inventory ({', '.join(names)}). "
                f"Fix: {FIXES['fleet_mirror']}"
            )
    for mirror in sorted({m for m in chosen.values() if m}):
        if chosen.get(mirror) != mirror:
            users = ", ".join(n for n, m in chosen.items() if m == mirror)
            problems.append(
                f"{mirror}: serves the mirror for {users}, so it must use it too, but its own "
                f"`fleet_mirror` = {settings[mirror].fleet_mirror!r}. Fix: give every host the same fleet_mirror"
            )
        elif mirror in unreachable:
            users = ", ".join(n for n, m in chosen.items() if m == mirror and n != mirror)
            problems.append(
                f"{mirror}: `fleet_mirror` names it as the mirror of {users}, but it is unreachable. "
                "Fix: bring it back, or deploy with --data fleet_mirror=auto (a reachable host serves "
                "the mirror) or --data fleet_mirror=none (every host downloads from upstream)"
            )
    return chosen, problems


def fleet_mirrors(hosts: Iterable[Any], settings: dict[str, Settings],
                  unreachable: frozenset[str] | set[str] = frozenset()) -> dict[str, Mirror | None]:
    """Each host's mirror, from fleet_mirror: ``"auto"`` is the first reachable host of
    the inventory group ``mirror`` if there is one, else of the inventory. A named mirror
    that is ``unreachable`` (the controller could not connect to it) stops the run before
    any host changes."""
    hosts = list(hosts)
    chosen, problems = chosen_mirrors(hosts, settings, unreachable)
    if problems:
        raise ConfigError("\n  ".join(["invalid configuration, nothing was changed on any host:", *problems]))
    pairs = fleet_pairs(hosts, settings)[0]
    sources: dict[str, Mirror | None] = {name: None for name, mirror in chosen.items() if mirror is None}
    for root in sorted({m for m in chosen.values() if m}):
        users = [name for name, mirror in chosen.items() if mirror == root]
        # Only a host this run reaches and that serves can relay: one that is down or not
        # serving fetches (when it next does) from the fleet's mirror.
        placed = [n for n in users if n != root and n not in unreachable and settings[n].serving]
        parents = relay_tree([root, *placed], settings[root].fleet_fanout, {n: p.members for n, p in pairs.items()})
        parents.update({n: root for n in users if n != root and n not in placed})
        sources.update(_tree_mirrors(root, users, parents, settings))
    return sources


def _tree_mirrors(root: str, users: list[str], parents: dict[str, str],
                  settings: dict[str, Settings]) -> dict[str, Mirror]:
    """Each of ``users``' mirror in the tree ``parents`` under the fleet's mirror ``root``:
    itself when it serves others (a relay, or the mirror), else the host it fetches from."""
    depths = tree_depths(parents)

    def served_by(name: str, is_self: bool) -> Mirror:
        s = settings[name]
        # The controller's name for a mirror (an SSH alias, a .local name) may mean
        # nothing to the other hosts: unless its own mirror_address says, it is found on them.
        return Mirror(name, s.mirror_address, s.mirror_hf_port, s.mirror_registry_port,
                      is_self, s.mirror_hf_offline_port if name == root else 0,
                      served_by(parents[name], False) if name in parents else None,
                      # The fleet's mirror serves every host: it is the fallback of all of them.
                      tuple(n for n in users if n != root) if name == root
                      else tuple(n for n, p in parents.items() if p == name),
                      depths.get(name, 0))

    relays = {root, *parents.values()}
    given: dict[str, list[str]] = {}
    for name in sorted(relays, key=users.index):
        if settings[name].mirror_address:
            given.setdefault(str(settings[name].mirror_address), []).append(name)
    clashes = [f"{', '.join(names)}: each serves the image and the weights (the fleet's mirror or a relay), "
               f"and each gives `mirror_address` = {address}. Fix: set mirror_address in each one's host data "
               f"(an address of that host), not for the whole fleet"
               for address, names in given.items() if len(names) > 1]
    if clashes:
        raise ConfigError("\n  ".join(["invalid configuration, nothing was changed on any host:", *clashes]))
    return {name: served_by(name, True) if name in relays else served_by(parents[name], False) for name in users}


def relay_tree(order: list[str], fanout: int, pairs: dict[str, tuple[str, ...]]) -> dict[str, str]:
    """Which host each host fetches the image and the weights from ({host: source}) when
    ``order[0]`` is the mirror: breadth first in ``order``, each host serving at most
    ``fanout`` hosts over the LAN, so every NIC carries at most ``fanout`` copies and the
    depth grows as log(fanout) of the fleet. A pair member's partners fetch from it over
    their link (``pairs``: {member: the pair's members}), not counted against its fanout."""
    parents: dict[str, str] = {}
    serving: list[str] = []  # hosts placed, in the order they take hosts to serve
    load: Counter = Counter()

    def place(name: str, parent: str | None) -> None:
        if parent is not None:
            parents[name] = parent
        serving.append(name)
        for partner in pairs.get(name, ()):  # over the link, first
            if partner in order and partner != name and partner not in parents and partner != order[0]:
                place(partner, name)

    place(order[0], None)
    for name in order[1:]:
        if name in parents:
            continue
        parent = next(h for h in serving if load[h] < fanout)
        load[parent] += 1
        place(name, parent)
    return parents


def tree_depths(parents: dict[str, str]) -> dict[str, int]:
    """Each host's hops from the mirror in a :func:`relay_tree`."""
    depths: dict[str, int] = {}

    def depth(name: str) -> int:
        if name not in depths:
            depths[name] = depth(parents[name]) + 1 if name in parents else 0
        return depths[name]

    for name in parents:
        depth(name)
    return depths
