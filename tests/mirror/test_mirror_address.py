"""The mirror's address when the inventory's names mean nothing to the hosts (SSH
aliases, .local names): found on the hosts, one for the fleet, or a clear error."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sparkfleet.config import ConfigError, Mirror
from sparkfleet.facts import RouteSource, SshServerAddress
from sparkfleet.mirror.names import located


class FakeHost:
    """A pyinfra host whose facts are a table: SSH address and routes {peer: source}."""

    def __init__(self, name: str, ssh: str, routes: dict[str, str] | None = None):
        self.name, self.ssh, self.routes, self.asked = name, ssh, routes or {}, []

    def get_fact(self, cls, **kwargs):
        self.asked.append((cls, kwargs))
        if cls is SshServerAddress:
            assert kwargs == {"_sudo": False}  # sudo drops $SSH_CONNECTION
            return self.ssh
        if cls is RouteSource:
            return self.routes.get(kwargs["address"], "")
        raise AssertionError(cls)


def fake_state(*hosts: FakeHost):
    by_name = {h.name: h for h in hosts}
    return SimpleNamespace(inventory=SimpleNamespace(get_host=by_name.__getitem__), active_hosts=set(hosts))


def mirrors_for(names, address=None):
    return {n: Mirror(names[0], address, 8090, 5000, n == names[0]) for n in names}


def test_the_address_is_the_mirrors_source_on_its_route_to_the_peers():
    # The controller reaches the mirror at a VPN address; the peers are on the LAN.
    m = FakeHost("spark-1.local", "100.64.0.1", {"192.168.1.12": "192.168.1.11", "192.168.1.13": "192.168.1.11"})
    peers = [FakeHost("spark-2.local", "192.168.1.12"), FakeHost("spark-3.local", "192.168.1.13")]
    state = fake_state(m, *peers)
    mirrors = mirrors_for([m.name] + [p.name for p in peers])
    for h in (m, *peers):
        got = located(state, h, mirrors)
        assert got.address == "192.168.1.11", h.name
        assert got.hf_endpoint == "http://192.168.1.11:8090"
    assert sum(1 for cls, _ in m.asked if cls is RouteSource) == 2  # found once per run


def test_an_ipv6_route_is_bracketed():
    m = FakeHost("a", "fd00::1", {"fd00::2": "fd00::1"})
    p = FakeHost("b", "fd00::2")
    got = located(fake_state(m, p), p, mirrors_for(["a", "b"]))
    assert got.address == "fd00::1" and got.registry == "[fd00::1]:5000"


def test_a_given_mirror_address_is_used_as_it_is():
    m, p = FakeHost("a", "10.0.0.1"), FakeHost("b", "10.0.0.2")
    assert located(fake_state(m, p), p, mirrors_for(["a", "b"], "mirror.lan")).address == "mirror.lan"
    assert m.asked == [] and p.asked == []


def test_no_route_to_any_peer_fails_naming_mirror_address():
    # Reached over loopback (a tunnel) and no route from the mirror to the peers.
    m, p = FakeHost("a", "127.0.0.1"), FakeHost("b", "10.9.9.9")
    with pytest.raises(ConfigError, match=r"a: the mirror has no address the other hosts can reach.*mirror_address"):
        located(fake_state(m, p), p, mirrors_for(["a", "b"]))


def test_a_fleet_of_one_uses_its_own_address():
    m = FakeHost("a", "")
    assert located(fake_state(m), m, mirrors_for(["a"])).address == "127.0.0.1"
