"""The mirror's registry and HF mirrors answer the fleet's hosts only: nftables rules.

Why nftables and not the services' own access control: olah has none; the registry's
(htpasswd or token auth) would put one more credential on every host and in every
pull; systemd's ``IPAddressAllow=`` filters a unit's outbound traffic too, and olah
reaches the hub by a name behind a CDN, with no fixed address to allow. So the mirror
host gets one nftables table of its own, ``inet sparkfleet_mirror`` (nftables from the
distribution's archives): new connections to the two ports are accepted from loopback
and from the address each fleet host reaches the mirror from (its source address on its
route to the mirror, ``ip route get``), and reset from anywhere else. Its chain's policy
is accept and it matches those ports only: docker's own rules and any host firewall are
left alone. A oneshot unit loads it at boot, before both services (not
/etc/nftables.conf, whose ``flush ruleset`` would remove docker's rules); a new rule
file is swapped in atomically (``nft -f``), without a window with no rules.
Measured on the testbed's hosts (systemd-nspawn, docker with iptables-nft beside it): a
fleet host gets 200 from the HF mirror, the controller and an address outside the
fleet get a reset.
"""

from __future__ import annotations

import ipaddress
import re

from pyinfra import host, state
from pyinfra.api import operation
from pyinfra.operations import systemd

from sparkfleet import snapshot
from sparkfleet.fleet import mirror_route, source_toward
from sparkfleet.hostpaths import (
    FIREWALL_RULES,
    FIREWALL_UNIT,
    FIREWALL_UNIT_PATH,
    HF_MIRROR_OFFLINE_UNIT,
    HF_MIRROR_UNIT,
    REGISTRY_UNIT,
)
from sparkfleet.mirrors import Mirror

TABLE = "sparkfleet_mirror"


def fleet_sources(mirror: Mirror) -> list[str]:
    """The addresses the hosts ``mirror`` serves reach it from, sorted."""
    users = mirror.serves
    found, unreachable = set(), False
    for name in users:
        peer = state.inventory.get_host(name)
        if peer not in state.active_hosts:
            unreachable = True
            continue
        # A member of the mirror's pair comes over the link, which its own link step routes
        # (after this is planned): its link address, not where its packets come from now.
        route = mirror_route(name, mirror)
        source = route[0] if route else source_toward(peer, str(mirror.address))
        try:
            found.add(str(ipaddress.ip_address(source)))
        except ValueError:
            pass
    if unreachable:  # it keeps the address the rules give it: a host that is down changes nothing
        found |= current_sources()
    return sorted(found, key=lambda a: (":" in a, a))


def current_sources() -> set[str]:
    """The fleet addresses the rules on this host allow now."""
    text = snapshot.text(FIREWALL_RULES) or ""
    return {a.strip() for group in re.findall(r"elements = \{([^}]*)\}", text) for a in group.split(",") if a.strip()}


def rules(sources: list[str], ports: list[int]) -> str:
    """The table, replacing its former self in one transaction."""
    v4 = [a for a in sources if ":" not in a]
    v6 = [a for a in sources if ":" in a]
    dports = "{ " + ", ".join(str(p) for p in ports) + " }"

    def named_set(name: str, kind: str, members: list[str]) -> str:
        elements = f" elements = {{ {', '.join(members)} }};" if members else ""
        return f"    set {name} {{ type {kind};{elements} }}"

    return "\n".join([
        "# Rendered by sparkfleet: the mirror's registry and HF mirror answer the fleet's hosts only.",
        f"table inet {TABLE} {{}}",
        f"delete table inet {TABLE}",
        f"table inet {TABLE} {{",
        named_set("fleet4", "ipv4_addr", v4),
        named_set("fleet6", "ipv6_addr", v6),
        "    chain input {",
        "        type filter hook input priority filter; policy accept;",
        f"        tcp dport {dports} iif lo accept",
        f"        tcp dport {dports} ip saddr @fleet4 accept",
        f"        tcp dport {dports} ip6 saddr @fleet6 accept",
        f"        tcp dport {dports} counter reject with tcp reset",
        "    }",
        "}",
        "",
    ])


UNIT_TEXT = f"""# Rendered by sparkfleet: the mirror's fleet-only rules ({FIREWALL_RULES}).
[Unit]
Description=sparkfleet: the mirror answers the fleet's hosts only (nftables table {TABLE})
Before={REGISTRY_UNIT} {HF_MIRROR_UNIT} {HF_MIRROR_OFFLINE_UNIT}

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/usr/sbin/nft -f {FIREWALL_RULES}
ExecReload=/usr/sbin/nft -f {FIREWALL_RULES}
ExecStop=/usr/sbin/nft delete table inet {TABLE}

[Install]
WantedBy=multi-user.target
"""


@operation()
def nftables_installed():
    """
    Install nftables from the host's apt sources when ``nft`` is missing (the lists the
    registry's install refreshed).
    """
    if snapshot.program("nft"):
        host.noop("nftables is installed")
        return
    yield "DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends nftables"


def fleet_only(mirror: Mirror) -> list:
    """The registry and HF mirror ports open to the fleet's hosts only. Returns the ops."""
    installed = nftables_installed(name="nftables installed")
    ports = [mirror.registry_port, mirror.hf_port, mirror.hf_offline_port]
    table = snapshot.file(FIREWALL_RULES, rules(fleet_sources(mirror), [p for p in ports if p]),
                          name="mirror firewall rules (fleet hosts only)")
    unit = snapshot.file(FIREWALL_UNIT_PATH, UNIT_TEXT, name=f"systemd unit {FIREWALL_UNIT}")
    systemd.daemon_reload(name=f"systemd reload for {FIREWALL_UNIT}", _if=unit.did_change)
    snapshot.service(FIREWALL_UNIT, name=f"{FIREWALL_UNIT} active")
    reloaded = systemd.service(
        name="mirror firewall rules swapped in", service=FIREWALL_UNIT, reloaded=True,
        _if=lambda: table.did_change() or unit.did_change(),
    )
    return [installed, table, unit, reloaded]
