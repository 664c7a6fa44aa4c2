"""Every service's question "your source toward X?" to a host: one command per host per run."""

from __future__ import annotations

import gevent
import pytest

from sparkfleet import fleet, perrun, remote
from sparkfleet.mirrors import Mirror
from sparkfleet.routes import RouteSource, RouteSources, SshServerAddress


class Host:
    """A host whose facts are a table: its SSH address and its routes {toward: source}."""

    def __init__(self, name: str, ssh: str, routes: dict[str, str]):
        self.name, self.ssh, self.routes, self.asked = name, ssh, routes, []
        self.connector_data, self.data = {}, {}

    def get_fact(self, cls, **kwargs):
        self.asked.append(cls)
        gevent.sleep(0.001)  # a round trip: the other steps' greenlets run meanwhile
        if cls is SshServerAddress:
            return self.ssh
        assert kwargs.pop("_sudo") is False  # the kernel answers any login: no sudo, no password check
        if cls is RouteSources:
            return {a: self.routes[a] for a in kwargs["addresses"] if a in self.routes}
        if cls is RouteSource:
            return self.routes.get(kwargs["address"], "")
        raise AssertionError(cls)


class State:
    """pyinfra's State, as the fleet's questions read it."""


@pytest.fixture
def four(monkeypatch):
    """spark-1 the mirror, spark-2 the endpoint, spark-3 the monitor; all on 10.0.0.0/24."""
    hosts = [Host(f"spark-{i}", f"10.0.0.1{i}", {f"10.0.0.1{j}": f"10.0.0.1{i}" for j in range(1, 5) if j != i})
             for i in range(1, 5)]
    by_name = {h.name: h for h in hosts}
    state = State()  # the per-run store keeps a weak reference to it
    state.inventory = type("Inventory", (), {"__iter__": lambda self: iter(hosts),
                                             "get_host": staticmethod(by_name.__getitem__)})()
    state.activated_hosts = state.active_hosts = set(hosts)
    state.failed_hosts = set()
    mirror = Mirror("spark-1", None, 8090, 5000, False, serves=("spark-2", "spark-3", "spark-4"))
    monkeypatch.setattr(perrun, "current_state", lambda: state)
    # The run's sudo check, each host's first command, tells its SSH address.
    monkeypatch.setattr(remote, "check_sudo", lambda host, then=None: host.connector_data.update({remote.SSH_ADDRESS: host.ssh}))
    monkeypatch.setattr(fleet, "all_settings", lambda: {})
    monkeypatch.setattr(fleet, "chosen_endpoint", lambda hosts, settings: ("spark-2", []))
    monkeypatch.setattr(fleet, "chosen_monitor", lambda hosts, settings: ("spark-3", []))
    monkeypatch.setattr(fleet, "all_mirrors", lambda: {h.name: mirror for h in hosts})
    return hosts


def test_the_mirror_the_endpoint_and_the_monitor_cost_a_host_one_command(four):
    first, endpoint, monitor, last = four
    asked = [(step, member, toward) for step, toward in (("firewall", "10.0.0.11"), ("endpoint", endpoint.ssh),
                                                          ("monitor", monitor.ssh))
             for member in four]
    # All at once, as pyinfra plans every host in its own greenlet.
    got = [gevent.spawn(fleet.source_toward, member, toward) for _, member, toward in asked]
    gevent.joinall(got, raise_error=True)
    assert [g.value for g in got] == [member.routes.get(toward, "") for _, member, toward in asked]
    assert last.asked == [RouteSources]  # one answers all three
    assert endpoint.asked.count(RouteSources) == 1 and monitor.asked.count(RouteSources) == 1
    # The mirror: its own address found once (toward its peers), then its own routes.
    assert first.asked.count(RouteSources) == 2 and RouteSource not in first.asked


def test_an_address_no_service_has_is_asked_alone(four):
    last = four[-1]
    assert fleet.source_toward(last, "10.0.0.99") == ""
    assert last.asked == [RouteSource]


def test_the_routes_are_one_ip_batch_read_as_each_route_get_says(tmp_path):
    """The command, run by sh here: the kernel's source toward each address asked (loopback
    in two spellings), nothing for a name (which would end ip's batch) or an address without
    a route; the answer of a batch that skipped an unreachable address still maps each line."""
    import shutil
    import subprocess

    if shutil.which("ip") is None:
        pytest.fail("iproute2's ip is needed here (DGX OS has it)")
    asked = ["127.0.0.1", "spark-9.local", "0:0:0:0:0:0:0:1"]
    command = RouteSources().command(addresses=asked)
    assert command.count("ip ") == 1 and "spark-9.local" not in command.split("printf")[1]
    said = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=30).stdout
    found = RouteSources().process(said.splitlines())
    assert found["127.0.0.1"] == "127.0.0.1" and "spark-9.local" not in found
    if "::1" in said:  # a host without IPv6 answers nothing for it
        assert found["0:0:0:0:0:0:0:1"] == "::1"
    skipped = ["asked 10.0.0.5 2001:db8::1 10.0.0.7",
               "10.0.0.5 dev eth0 src 10.0.0.11 uid 1000 \\    cache ",
               "10.0.0.7 via 10.0.0.1 dev eth0 src 10.0.0.11 uid 1000 \\    cache "]
    assert RouteSources().process(skipped) == {"10.0.0.5": "10.0.0.11", "10.0.0.7": "10.0.0.11"}
    assert RouteSource().process(skipped[:2]) == "10.0.0.11" and RouteSource().process(["asked x"]) == ""
