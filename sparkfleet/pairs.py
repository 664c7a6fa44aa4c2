"""Pairs: Sparks cabled by their ConnectX-7 that serve one model together, as inventory data.

An inventory group ``pair_<name>`` is a pair; its hosts' order in the inventory is their
rank order (the first is the head, which serves HTTP). :func:`fleet_pairs` gives each
member its :class:`Pair` and says what would keep the members from running one engine.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sparkfleet.config import FIXES, Settings

#: An inventory group whose name starts so is a pair: its hosts serve one model together.
PAIR_GROUP_PREFIX = "pair_"
#: What every member of a pair must agree on, besides the serving command itself.
_PAIR_AGREED = ("profile", "model_repo", "image", "serving", "pair_subnet", "pair_master_port", "pair_mtu",
                "pair_check_port", "pair_min_busbw_gbs")


@dataclass(frozen=True)
class Pair:
    """Hosts cabled by their ConnectX-7 that serve one model with vLLM's multi-node tensor
    parallelism, as the current host sees it. Rank 0 (the head) serves HTTP; the others
    run headless."""

    group: str  # the inventory group, e.g. pair_a
    members: tuple[str, ...]  # inventory names, in rank order
    rank: int  # the current host's
    addresses: tuple[str, ...]  # each member's address on the link, in rank order
    prefix_len: int
    port: int  # the head's rendezvous port (--master-port)

    @property
    def head(self) -> str:
        return self.members[0]

    @property
    def is_head(self) -> bool:
        return self.rank == 0

    @property
    def headless(self) -> bool:
        """Ranks above 0 run ``--headless``: they serve no HTTP."""
        return not self.is_head

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def address(self) -> str:
        return self.addresses[self.rank]

    @property
    def master_addr(self) -> str:
        return self.addresses[0]

    @property
    def peer_addresses(self) -> tuple[str, ...]:
        return tuple(a for r, a in enumerate(self.addresses) if r != self.rank)


@dataclass(frozen=True)
class PairMember:
    """One member's part of its pair's engine: the ``pair.*`` values of serve.env."""

    pair: Pair
    interface: str  # the CX7 netdev NCCL, Gloo and vLLM use (link.resolved)
    hcas: str  # NCCL_IB_HCA: the RoCE devices of the cabled port
    gid_index: str = ""  # NCCL_IB_GID_INDEX: the RoCE v2 GID of the link's address ("": not set)
    enforce_eager: bool | None = None  # pair_enforce_eager (None: not rendered)
    disable_custom_all_reduce: bool | None = None  # pair_disable_custom_all_reduce (None: not rendered)
    ib_disable: str = "0"
    ignore_cpu_affinity: str = "1"

    def value(self, name: str) -> Any:
        """A ``pair.*`` value of serve.env: this member's own, else its Pair's."""
        return getattr(self, name) if name in self.__dataclass_fields__ else getattr(self.pair, name)


def _group_members(hosts: Any, group: str) -> list[str]:
    """The group's hosts in inventory order, which is their rank order: pyinfra keeps one
    order of hosts (where each is first listed), not a group's own."""
    return [h.name for h in hosts if group in (getattr(h, "groups", None) or ())]


def _pair_value(s: Settings, key: str) -> Any:
    return getattr(s, key) if key != "model_repo" else f"{s.model_repo}@{s.revision(s.model_repo)}"


def fleet_pairs(hosts: Iterable[Any], settings: dict[str, Settings]) -> tuple[dict[str, Pair], list[str]]:
    """Each pair member's Pair, from the inventory's pair_* groups, and what is wrong with
    them: a host in two pairs, a pair of one, members that would not run one engine."""
    listed = list(hosts)
    groups = sorted({g for h in listed for g in (getattr(h, "groups", None) or ())
                     if str(g).startswith(PAIR_GROUP_PREFIX)})
    pairs: dict[str, Pair] = {}
    problems: list[str] = []
    seen: dict[str, str] = {}
    for group in groups:
        members = [n for n in _group_members(hosts, group) if n in settings]
        for name in members:
            if name in seen:
                problems.append(f"{name}: is in two pairs, {seen[name]} and {group}. Fix: a Spark has one "
                                "ConnectX-7 cable to one peer: list it in one pair_* group")
            seen.setdefault(name, group)
        if len(members) < 2:
            problems.append(f"{group}: a pair needs two hosts, the inventory lists {', '.join(members) or 'none'}. "
                            f"Fix: add its peer to {group}, or rename the group (pair_* groups are pairs)")
            continue
        head = settings[members[0]]
        head_env = head.serve_env()
        for name in members[1:]:
            s = settings[name]
            differ_in = [key for key in _PAIR_AGREED if _pair_value(s, key) != _pair_value(head, key)]
            for key in differ_in:
                shown = "model@revision" if key == "model_repo" else key
                problems.append(
                    f"{group}: {members[0]} and {name} differ in `{shown}` ({_pair_value(head, key)!r} vs "
                    f"{_pair_value(s, key)!r}); a pair runs one engine. Fix: give both hosts the same {shown} "
                    f"(set it in group_data/{group}.py)")
            env = s.serve_env()
            differ = sorted(k for k in head_env.keys() | env.keys() if head_env.get(k) != env.get(k))
            if differ and not differ_in:
                problems.append(f"{group}: {members[0]} and {name} would start different engines ({', '.join(differ)} "
                                f"differ). Fix: give both hosts the same serving settings (group_data/{group}.py)")
        net = ipaddress.IPv4Network(head.pair_subnet)
        if len(members) > net.num_addresses - 2:
            problems.append(f"{group}: pair_subnet {net} has no address for each of its {len(members)} hosts. "
                            f"Fix: {FIXES['pair_subnet']}")
            continue
        addresses = tuple(str(net.network_address + 1 + r) for r in range(len(members)))
        for rank, name in enumerate(members):
            if name not in pairs:
                pairs[name] = Pair(group, tuple(members), rank, addresses, net.prefixlen, head.pair_master_port)
    return pairs, problems

