"""The fleet: what one run decides for every host at once.

Imports run one way: one host's model (:mod:`sparkfleet.config`) -> the fleet (this
module) -> the steps. Here: the whole inventory validated together (every fleet-wide key
must agree), the fleet lock applied to every host (:mod:`sparkfleet.fleetlock`: the
bytes each tag and branch stands for, so a pair is checked on commits and digests),
which host serves the mirror and the endpoint, the pairs, and the mirror's address as
the other hosts reach it. Each answer is computed once per run
(:func:`~sparkfleet.perrun.once`, which the fleet's modules share).
"""

from __future__ import annotations

import ipaddress
import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from sparkfleet import fleetlock, lockfile, perrun, remote, snapshot, upstream
from sparkfleet.config import (
    FIXES,
    MEASURED_GPU_MEMORY_UTILIZATION,
    ConfigError,
    Settings,
    validate_host_data,
)
from sparkfleet.mirrors import Mirror, chosen_mirrors, fleet_mirrors
from sparkfleet.pairs import Pair, fleet_pairs
from sparkfleet.perrun import once

log = logging.getLogger("sparkfleet")

#: Keys a run applies to the fleet as a whole (the rollout's shape): every host must give
#: the same value, or which host's value wins would depend on which host plans first.
FLEET_WIDE = ("rollout", "rollout_batch", "drain_timeout_s", "fleet_lock_file", "fleet_lock_update", "fleet_fanout")


# --- the whole inventory, validated together ------------------------------------------------


def validate_fleet(hosts: Iterable[Any], check_pairs: bool = True) -> dict[str, Settings]:
    """Validate every host; one error lists all problems of all hosts. ``check_pairs``:
    pairs too, on the settings as asked (a deploy checks them on sparkfleet.lock's bytes,
    :func:`_planned`)."""
    hosts = list(hosts)
    settings: dict[str, Settings] = {}
    problems: list[str] = []
    for host in hosts:
        try:
            settings[host.name] = validate_host_data(host.name, host.data.dict())
        except ConfigError as exc:
            problems.extend(str(exc).split("\n  ")[1:])
    if not problems:
        problems = (_disagreements(settings) + chosen_mirrors(hosts, settings)[1]
                    + chosen_endpoint(hosts, settings)[1] + chosen_monitor(hosts, settings)[1])
    if not problems and check_pairs:
        problems = fleet_pairs(hosts, settings)[1]
    if problems:
        raise ConfigError(
            "\n  ".join(["invalid configuration, nothing was changed on any host:", *problems])
        )
    for name, s in settings.items():
        if s.gpu_memory_utilization > MEASURED_GPU_MEMORY_UTILIZATION:
            log.warning(
                "%s: gpu_memory_utilization=%s is above the %s the reference recipe measured as safe; "
                "a Spark's unified memory may swap and stall the host",
                name, s.gpu_memory_utilization, MEASURED_GPU_MEMORY_UTILIZATION,
            )
    return settings


def _disagreements(settings: dict[str, Settings]) -> list[str]:
    problems = []
    for key in FLEET_WIDE:
        values: dict[Any, list[str]] = {}
        for name, s in settings.items():
            value = getattr(s, key)
            values.setdefault(tuple(value) if isinstance(value, list) else value, []).append(name)
        if len(values) > 1:
            shown = "; ".join(f"{', '.join(map(str, value)) if isinstance(value, tuple) else repr(value)} on "
                              f"{', '.join(names)}" for value, names in values.items())
            problems.append(f"`{key}` differs between hosts ({shown}); it applies to the whole fleet. "
                            f"Fix: set {key} once for every host (group_data/all.py or --data {key}=...)")
    return problems


def _asked(state) -> dict[str, Any]:
    """The fleet as its data asks, before the lock: every host validated (its pairs as
    groups only: a pair is checked on the locked bytes), the mirrors, the pairs."""
    asked = validate_fleet(state.inventory, check_pairs=False)
    # Hosts outside --limit are not connected to, and count as reachable.
    unreachable = {h.name for h in state.inventory
                   if state.is_host_in_limit(h) and h not in state.activated_hosts}
    return {"settings": asked, "mirrors": fleet_mirrors(state.inventory, asked, unreachable),
            "pairs": fleet_pairs(state.inventory, asked)[0]}


def _planned(state) -> dict[str, Any]:
    """The fleet as it deploys: its settings with sparkfleet.lock's bytes, pairs checked on them."""
    asked = once("fleet asked", lambda: _asked(state), state)
    run, problems = _fleet_lock(state, asked["settings"])
    fleet = {name: fleetlock.locked(s, run.lock) for name, s in asked["settings"].items()}
    problems = problems or fleet_pairs(state.inventory, fleet)[1]
    if problems:
        raise ConfigError("\n  ".join(["invalid configuration, nothing was changed on any host:", *problems]))
    fleetlock.announce(run, bool(fleetlock.cli_params().get("dry")))
    return {**asked, "settings": fleet, "lock": run}


def _fleet_lock(state, asked: dict[str, Settings]) -> tuple[fleetlock.LockRun, list[str]]:
    """This run's fleet lock: the file completed for what the hosts ask (sparkfleet.fleetlock)."""
    first = next(iter(asked.values()))
    path = lockfile.lock_path(first.fleet_lock_file, fleetlock.cli_params().get("inventory"))
    lock, before = lockfile.read(path)
    planned = fleetlock.plan(
        asked, lock, set(first.fleet_lock_update), held=lambda names: _held(state, names, asked),
        upstream=upstream.Upstream(), pairs={n: p.group for n, p in fleet_pairs(state.inventory, asked)[0].items()},
    )
    writer = next((h.name for h in state.inventory if h in state.activated_hosts), None)
    return fleetlock.LockRun(path, planned.lock, before, planned.changes, writer), planned.problems


def sudo_checked(target, state=None) -> None:
    """``target``'s sudo checked (:func:`~sparkfleet.remote.check_sudo`), once per run,
    whoever asks first: its own planning, or another host's that needs its SSH address.
    The check's sudo runs the host's first snapshot read too: each sudo costs the host a
    password hash, the largest part of what a converged run costs it."""

    def checked() -> None:
        read = snapshot.first_read(target, state)
        lines = remote.check_sudo(target, then=read.argv if read else None)
        if read:
            read.took(lines)

    once(("sudo", target.name), checked, state)


def _held(state, names: list[str], asked: dict[str, Settings]) -> dict[str, fleetlock.Held]:
    """What the connected hosts among ``names`` hold from before the lock (one command each)."""
    from sparkfleet.facts import HeldArtifacts
    from sparkfleet.hostpaths import local_image

    found = {}
    for name in names:
        target = state.inventory.get_host(name)
        if target not in state.activated_hosts:
            continue
        sudo_checked(target, state)
        s = asked[name]
        facts = target.get_fact(HeldArtifacts, hf_home=s.hf_home, images=[local_image(s.image)])
        found[name] = fleetlock.Held(facts["markers"], facts["images"])
    return found


def _fleet(locked: bool = True) -> dict[str, Any]:
    from pyinfra import host

    sudo_checked(host)  # before any fact: sudo must not prompt mid-run
    state = perrun.current_state()
    if not locked:
        return once("fleet asked", lambda: _asked(state), state)
    return once("fleet", lambda: _planned(state), state)


def fleet_settings(locked: bool = True) -> Settings:
    """The current host's settings, validating the whole inventory once per run: its image
    and revisions as sparkfleet.lock pins them, or (``locked=False``, for what reads
    neither: the checks) as its data asks, without reading or completing the lock."""
    from pyinfra import host

    return _fleet(locked)["settings"][host.name]


def all_settings() -> dict[str, Settings]:
    """Every host's settings by inventory name (validated and locked once per run)."""
    return _fleet()["settings"]


def fleet_lock() -> fleetlock.LockRun:
    """This run's fleet lock (sparkfleet.lock completed for the inventory, once per run)."""
    return _fleet()["lock"]


def all_mirrors() -> dict[str, Mirror | None]:
    """Every host's mirror by inventory name, as chosen once per run (among the reachable
    hosts): without their addresses, which :func:`host_mirror` finds."""
    return _fleet(locked=False)["mirrors"]


def all_pairs() -> dict[str, Pair]:
    """Every pair member's Pair by inventory name (hosts outside a pair are absent)."""
    return _fleet(locked=False)["pairs"]


def host_pair(name: str | None = None) -> Pair | None:
    """The pair the current host (or the host ``name``) belongs to, None if it serves alone."""
    from pyinfra import host

    return all_pairs().get(name or host.name)


def mirror_route(name: str, mirror: Mirror) -> tuple[str, str] | None:
    """(source, via) when pair member ``name`` reaches ``mirror`` over its pair's link: the
    mirror is another member of the pair, so the image and the weights cross the link (200
    Gb/s) rather than the management network. link.netplan routes the mirror's fleet address
    via the mirror's link address, and ``name``'s packets then come from its own link address
    (what the mirror's firewall allows). None otherwise, or when that address is not IPv4
    (the link has IPv4 only)."""
    pair = all_pairs().get(name)
    if pair is None or mirror.host == name or mirror.host not in pair.members:
        return None
    try:
        if ipaddress.ip_address(str(mirror.address)).version != 4:
            return None
    except ValueError:
        return None
    return pair.address, pair.addresses[pair.members.index(mirror.host)]


def host_mirror() -> Mirror | None:
    """The mirror the current host downloads the image and model files from (None: upstream),
    with the address the fleet reaches it at."""
    from pyinfra import host

    return located(perrun.current_state(), host, all_mirrors())


def located(state, current, mirrors: dict[str, Mirror | None]) -> Mirror | None:
    """``current``'s mirror (and the ones above it) with the address every host uses for
    it: ``mirror_address``, else found on the hosts once per run (:func:`_fleet_address`)."""
    mirror = mirrors.get(current.name)
    return _addressed(state, mirror) if mirror else None


def _addressed(state, mirror: Mirror) -> Mirror:
    upstream = _addressed(state, mirror.upstream) if mirror.upstream else None
    address = mirror.address or once(("mirror address", mirror.host), lambda: _fleet_address(state, mirror), state)
    return replace(mirror, address=address, upstream=upstream)


def ssh_address(target, state=None) -> str:
    """The address ``target``'s SSH connection reached ($SSH_CONNECTION's third field), or
    "": told by its sudo check (the run's first command on it), else asked once per run."""
    from sparkfleet.remote import SSH_ADDRESS
    from sparkfleet.routes import SshServerAddress

    def ask() -> str:
        sudo_checked(target, state)
        told = target.connector_data.get(SSH_ADDRESS)
        return told if told is not None else target.get_fact(SshServerAddress, _sudo=False)

    return once(("ssh address", target.name), ask, state)


def reached_at(target) -> str:
    """How the controller reaches ``target``, for the URLs the deploy prints: ``ssh_hostname``,
    else the address its SSH connection reached (curl cannot resolve an SSH alias, nor a
    ``.local`` name without mDNS), else its name."""
    given = target.data.get("ssh_hostname")
    if given or not target.connected:  # a host this run could not reach: its name
        return str(given or target.name)
    return ssh_address(target) or target.name


def source_toward(member, address: str) -> str:
    """``member``'s source address on its route to ``address`` ("" when it has none).

    The fleet's services ask this of every host while planning: the mirrors (whom their
    firewall lets in), the endpoint and the monitor (where they reach each member). One
    command per host per run answers for all of their addresses."""
    from sparkfleet.routes import RouteSource

    state = perrun.current_state()
    wanted = once("service addresses", lambda: _service_addresses(state), state)
    if address not in wanted:
        return member.get_fact(RouteSource, address=address, _sudo=False)
    routes = once(("routes", member.name), lambda: _routes(member, wanted, state), state)
    return routes.get(address, "")


def _routes(target, addresses: list[str], state) -> dict[str, str]:
    """``target``'s source address toward each of ``addresses`` (routes.RouteSources): with
    its first read, which its sudo check (first, whichever host asks) takes along."""
    from sparkfleet.routes import RouteSources

    sudo_checked(target, state)
    return snapshot.fact_of(target, RouteSources, state, addresses=addresses, _sudo=False)


def _service_addresses(state) -> list[str]:
    """Where the hosts' routes lead while planning: every mirror's fleet address, and the
    endpoint's and the monitor's host as this run reached them. A host this run could not
    reach, or a mirror with no address, adds none (asking for it alone then still works)."""
    hosts = list(state.inventory)
    up = [h for h in hosts if h in state.activated_hosts and h not in state.failed_hosts]
    settings = all_settings()
    services = {chosen_endpoint(hosts, settings)[0], chosen_monitor(hosts, settings)[0]}
    found = {ssh_address(h, state) for h in up if h.name in services}
    mirrors = all_mirrors()
    for current in up:
        try:
            mirror = located(state, current, mirrors)
        except ConfigError:
            continue
        while mirror:
            found.add(str(mirror.address))
            mirror = mirror.upstream
    return sorted(a for a in found if _usable(a))


def _usable(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return not (ip.is_loopback or ip.is_link_local or ip.is_unspecified)


def _fleet_address(state, mirror: Mirror) -> str:
    """The address every host of the fleet uses for the mirror.

    The controller's name for the mirror (an SSH alias, a ``.local`` name) may resolve
    nowhere else, and a host-network container has no mDNS. So unless ``mirror_address``
    says, the address is the mirror's own source address on its route to each peer (``ip
    route get <peer>`` on the mirror, the peer being where the controller reached it):
    the address the peer's packets come back from, which a name or the controller's
    view of the mirror (a VPN, an SSH alias) need not be. One address for the fleet:
    olah writes it into redirects and the registry certificate names it. Every host
    checks that it answers before it pulls or downloads (mirror.clients). One command on
    the mirror answers for every peer.
    """
    mirror_name = mirror.host
    server = state.inventory.get_host(mirror_name)
    peers = [state.inventory.get_host(n) for n in mirror.serves]
    peers = [p for p in peers if p in state.active_hosts]
    reached = {peer.name: ssh_address(peer, state) for peer in peers}
    asked = sorted({a for a in reached.values() if _usable(a)})
    routes = _routes(server, asked, state) if asked else {}
    seen = {name: (routes.get(a, "") if _usable(routes.get(a, "")) else "") or f"none (reached at {a or '?'})"
            for name, a in reached.items()}
    sources = Counter(a for a in seen.values() if _usable(a))
    if sources:
        return sources.most_common(1)[0][0]
    own = ssh_address(server, state)
    if _usable(own) or not peers:
        return own if _usable(own) else "127.0.0.1"  # a fleet of one reaches itself
    shown = "; ".join(f"to {name}: {a}" for name, a in seen.items())
    raise ConfigError(
        f"{mirror_name}: the mirror has no address the other hosts can reach ({shown}), nothing was "
        f"changed on any host. Fix: set mirror_address (host data of {mirror_name}) to an address of it "
        "every host reaches, or deploy with --data fleet_mirror=none"
    )


#: An inventory group of this name picks the fleet endpoint for fleet_endpoint="auto".
ENDPOINT_GROUP = "endpoint"


def _chosen_host(hosts: list[Any], settings: dict[str, Settings], key: str, group: str,
                 otherwise: str | None, what: str) -> tuple[str | None, list[str]]:
    """The one host every host's ``key`` names (``auto``: the first of inventory ``group``,
    else ``otherwise``), and what is wrong: a name outside the inventory, or hosts that
    disagree."""
    names = [h.name for h in hosts]
    grouped = [h.name for h in hosts if group in (getattr(h, "groups", None) or ())]
    chosen: dict[str, str | None] = {}
    problems: list[str] = []
    for name in names:
        want = getattr(settings[name], key)
        if want == "auto":
            chosen[name] = (grouped or [otherwise])[0]
        elif want is None or want in names:
            chosen[name] = want
        else:
            problems.append(f"{name}: `{key}` = {want!r} is not a host of the inventory "
                            f"({', '.join(names)}). Fix: {FIXES[key]}")
    if not problems and len(set(chosen.values())) > 1:
        problems.append(f"the hosts name different {what} ("
                        + ", ".join(f"{n}: {c or 'none'}" for n, c in chosen.items())
                        + f"). Fix: give every host the same {key}")
    return (next(iter(chosen.values()), None) if not problems else None), problems


def chosen_endpoint(hosts: list[Any], settings: dict[str, Settings]) -> tuple[str | None, list[str]]:
    """The host that serves the fleet endpoint (None: none), and what is wrong. ``auto``
    is the first host of the inventory group ``endpoint``, else none: a router is a new
    port and a new way in on a host, so the inventory opts in."""
    return _chosen_host(hosts, settings, "fleet_endpoint", ENDPOINT_GROUP, None, "fleet endpoints")


#: An inventory group of this name picks the fleet monitor for fleet_monitor="auto".
MONITOR_GROUP = "monitor"


def chosen_monitor(hosts: list[Any], settings: dict[str, Settings]) -> tuple[str | None, list[str]]:
    """The host that runs Prometheus for the fleet (None: none), and what is wrong. ``auto``
    is the first host of the inventory group ``monitor``, else the fleet endpoint's host
    (the inventory opted in to a router there), else none."""
    endpoint = chosen_endpoint(hosts, settings)[0]
    return _chosen_host(hosts, settings, "fleet_monitor", MONITOR_GROUP, endpoint, "fleet monitors")
