"""The fleet's per-run store (``perrun.once``) and what the fleet decides once per run from a
real pyinfra State: every host validated together, the mirror among the hosts the
controller reached (no fleet: @fake hosts; choices already covered by
tests/mirror/test_mirror_choice.py, tests/test_fleet_endpoint.py and
tests/test_pair_config.py are not repeated)."""

from __future__ import annotations

import gc
import weakref

import gevent
import pytest
from pyinfra.context import ctx_host
from support.fleetdata import fake_state

from sparkfleet import fleet, perrun, remote

NAMES = ["@fake/spark-1", "@fake/spark-2", "@fake/spark-3"]


class Answer:
    """A computed answer (weak-referenceable, to see when the store lets go of it)."""


@pytest.fixture()
def state():
    with fake_state(NAMES) as current:
        yield current


def test_hosts_asking_at_once_wait_for_one_computation(state):
    calls: list[str] = []
    answer = Answer()

    def compute(asker):
        def lookup():
            calls.append(asker)
            gevent.sleep(0.02)  # a fact's round trip: every other greenlet asks meanwhile
            return answer
        return lookup

    askers = [gevent.spawn(perrun.once, "mirror address", compute(f"host-{i}")) for i in range(8)]
    gevent.joinall(askers, timeout=5, raise_error=True)
    assert [g.value for g in askers] == [answer] * 8
    assert calls == ["host-0"]  # the first to ask computed it; nobody else looked it up
    assert perrun.once("mirror address", compute("later")) is answer and calls == ["host-0"]


def test_an_error_is_computed_once_and_raised_to_every_caller(state):
    calls = []

    def failing():
        calls.append(1)
        gevent.sleep(0.02)
        raise ValueError("the mirror has no address the other hosts can reach")

    askers = [gevent.spawn(perrun.once, "mirror address", failing) for _ in range(5)]
    gevent.joinall(askers, timeout=5)
    errors = [g.exception for g in askers]
    assert all(isinstance(e, ValueError) for e in errors) and len({id(e) for e in errors}) == 1
    with pytest.raises(ValueError, match="no address"):
        perrun.once("mirror address", failing)  # a host asking later gets it too, not a second try
    assert calls == [1]


def test_empty_answers_are_kept_and_each_key_has_its_own(state):
    calls = []

    def lookup(value):
        def compute():
            calls.append(value)
            return value
        return compute

    for _ in range(3):  # "" (no SSH address) or None is an answer, not a miss
        assert perrun.once(("ssh address", "@fake/spark-1"), lookup("")) == ""
        assert perrun.once(("ssh address", "@fake/spark-2"), lookup(None)) is None
    assert calls == ["", None]


def test_each_run_has_its_own_store_gone_with_its_state():
    calls = []

    def compute():
        calls.append(1)
        return Answer()

    with fake_state(NAMES) as first:
        answer = perrun.once("fleet", compute)  # the current State's (ctx_state)
        assert perrun.once("fleet", compute, first) is answer
        kept = weakref.ref(answer)
    with fake_state(NAMES) as second:
        assert perrun.once("fleet", compute) is not answer  # a new run computes again
        assert perrun.once("fleet", compute, second) is not answer
    assert len(calls) == 2
    del first, second, answer
    gc.collect()
    assert kept() is None  # nothing of an ended run is kept (a State's id may be reused)


def test_the_fleet_is_validated_once_per_run_and_each_hosts_sudo_checked_once(monkeypatch):
    validated, sudo = [], []
    real = fleet.validate_fleet
    monkeypatch.setattr(fleet, "validate_fleet", lambda hosts, **kw: validated.append(1) or real(hosts, **kw))

    def check_sudo(host, then=None):
        sudo.append(host.name)
        gevent.sleep(0.01)

    monkeypatch.setattr(remote, "check_sudo", check_sudo)
    hosts = [("@fake/spark-1", {"port": 8001}), ("@fake/spark-2", {"port": 8002}), ("@fake/spark-3", {"port": 8003})]
    with fake_state(hosts) as current:
        def plan(name):
            with ctx_host.use(current.inventory.get_host(name)):
                return [fleet.fleet_settings().port for _ in range(3)] + [len(fleet.all_mirrors())]

        greenlets = [gevent.spawn(plan, name) for name in NAMES]
        gevent.joinall(greenlets, timeout=5, raise_error=True)
    assert [g.value for g in greenlets] == [[8001] * 3 + [3], [8002] * 3 + [3], [8003] * 3 + [3]]
    assert validated == [1] and sorted(sudo) == NAMES


def test_auto_skips_a_host_of_the_run_the_controller_could_not_reach(state, caplog):
    state.activated_hosts.discard(state.inventory.get_host("@fake/spark-1"))  # its SSH connection failed
    mirrors = fleet._planned(state)["mirrors"]
    assert {name: m.host for name, m in mirrors.items()} == {n: "@fake/spark-2" for n in NAMES}
    assert mirrors["@fake/spark-2"].is_self
    assert "@fake/spark-1 is unreachable, so @fake/spark-2 serves the mirror" in caplog.text


def test_a_host_outside_limit_is_not_connected_to_and_still_serves_the_mirror(state):
    state.limit_hosts = [state.inventory.get_host(n) for n in NAMES[1:]]  # --limit spark-2,spark-3
    state.activated_hosts.discard(state.inventory.get_host("@fake/spark-1"))
    mirrors = fleet._planned(state)["mirrors"]
    assert {m.host for m in mirrors.values()} == {"@fake/spark-1"}
    assert not mirrors["@fake/spark-2"].is_self

