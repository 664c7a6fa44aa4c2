"""The mirror's address when the inventory's names mean nothing to the hosts (SSH
aliases, .local names): found on the hosts, one for the fleet, or a clear error."""

from __future__ import annotations

from types import SimpleNamespace

import gevent
import pytest

from sparkfleet import remote
from sparkfleet.config import ConfigError
from sparkfleet.fleet import located
from sparkfleet.mirrors import Mirror
from sparkfleet.routes import RouteSources, SshServerAddress


class FakeHost:
    """A pyinfra host whose facts are a table: SSH address and routes {peer: source}."""

    def __init__(self, name: str, ssh: str, routes: dict[str, str] | None = None, told: bool = True):
        self.name, self.ssh, self.routes, self.asked = name, ssh, routes or {}, []
        self.told, self.connector_data, self.data = told, {}, {}

    def get_fact(self, cls, **kwargs):
        self.asked.append((cls, kwargs))
        gevent.sleep(0.001)  # a fact is a round trip: other hosts' greenlets run meanwhile
        if cls is SshServerAddress:
            assert kwargs == {"_sudo": False}  # sudo drops $SSH_CONNECTION
            return self.ssh
        if cls is RouteSources:
            assert kwargs["_sudo"] is False  # the kernel answers any login: no password check
            return {a: self.routes[a] for a in kwargs["addresses"] if a in self.routes}
        raise AssertionError(cls)


class FakeState:
    """A pyinfra State as the fleet's per-run store sees it (one store per State object)."""

    def __init__(self, *hosts: FakeHost):
        by_name = {h.name: h for h in hosts}
        self.inventory = SimpleNamespace(get_host=by_name.__getitem__)
        self.active_hosts = set(hosts)


fake_state = FakeState


@pytest.fixture(autouse=True)
def sudo_checked(monkeypatch):
    """The run's sudo check, the first command on every host, tells its SSH address
    (a login without sudo is checked by nothing, and tells nothing)."""
    def check_sudo(host, then=None):
        if host.told:
            host.connector_data[remote.SSH_ADDRESS] = host.ssh

    monkeypatch.setattr(remote, "check_sudo", check_sudo)


def mirrors_for(names, address=None):
    return {n: Mirror(names[0], address, 8090, 5000, n == names[0], serves=tuple(names[1:])) for n in names}


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
    assert [cls for cls, _ in m.asked] == [RouteSources]  # one command on the mirror, once per run


def test_sixteen_hosts_planning_at_once_ask_the_mirror_one_command():
    # pyinfra plans every host in its own greenlet: all ask for the mirror's address at once.
    m = FakeHost("spark-1", "10.0.0.11", {f"10.0.0.{10 + i}": "10.0.0.11" for i in range(2, 17)})
    peers = [FakeHost(f"spark-{i}", f"10.0.0.{10 + i}") for i in range(2, 17)]
    state = fake_state(m, *peers)
    mirrors = mirrors_for([m.name] + [p.name for p in peers])
    found = gevent.joinall([gevent.spawn(located, state, h, mirrors) for h in (m, *peers)], raise_error=True)
    assert {g.value.address for g in found} == {"10.0.0.11"}
    assert len(m.asked) == 1  # not one per host, nor one per peer
    assert all(p.asked == [] for p in peers)  # each peer's SSH address: told by its sudo check


def test_a_host_whose_sudo_check_told_nothing_is_asked_its_address_once():
    m = FakeHost("spark-1", "10.0.0.11", {"10.0.0.12": "10.0.0.11"})
    p = FakeHost("spark-2", "10.0.0.12", told=False)
    state = fake_state(m, p)
    mirrors = mirrors_for([m.name, p.name])
    gevent.joinall([gevent.spawn(located, state, h, mirrors) for h in (m, p, p)], raise_error=True)
    assert p.asked == [(SshServerAddress, {"_sudo": False})]


def test_a_new_run_finds_the_address_again():
    m = FakeHost("a", "10.0.0.1", {"10.0.0.2": "10.0.0.1"})
    p = FakeHost("b", "10.0.0.2")
    located(fake_state(m, p), p, mirrors_for(["a", "b"]))
    m.routes = {"10.0.0.2": "10.0.0.5"}  # the mirror moved between runs
    assert located(fake_state(m, p), p, mirrors_for(["a", "b"])).address == "10.0.0.5"


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


def test_a_peer_asking_first_finds_the_mirrors_routes_in_the_mirrors_first_read(monkeypatch):
    """The mirror's address is asked by whichever host plans first, often a peer: the
    mirror's sudo check runs then, and its first read (with its hint: the route question
    of the last run) answers; no command of the mirror's own for it."""
    import json

    from sparkfleet import snapshot

    m = FakeHost("spark-1-first-read", "10.0.0.11", {"10.0.0.12": "10.0.0.11"})
    p = FakeHost("spark-2-first-read", "10.0.0.12")
    key, _ = snapshot._fact_entry(RouteSources, {"addresses": ["10.0.0.12"]})
    hint = snapshot._hint_path(m)
    hint.parent.mkdir(parents=True, exist_ok=True)
    hint.write_text(json.dumps({"facts": [key]}))
    checked = []

    def check_sudo(host, then=None):  # the first read, as the host would answer it
        checked.append(host.name)
        host.connector_data[remote.SSH_ADDRESS] = host.ssh
        asked = json.loads(then[-1])["facts"] if then else {}
        lines = ["asked 10.0.0.12", "10.0.0.12 dev eth0 src 10.0.0.11 uid 0"]
        return [json.dumps({"facts": {k: lines for k in asked if k == key}})] if then else None

    monkeypatch.setattr(remote, "check_sudo", check_sudo)
    monkeypatch.setattr(snapshot, "_FIRST", snapshot._Wanted(texts={"/etc/hostname"}))
    try:
        got = located(fake_state(m, p), p, mirrors_for([m.name, p.name]))
    finally:
        hint.unlink(missing_ok=True)
    assert got.address == "10.0.0.11"
    assert m.name in checked and m.asked == []
