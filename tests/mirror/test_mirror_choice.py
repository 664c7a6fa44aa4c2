"""Which host is the mirror, for whom, and how its settings are validated (no fleet)."""

from __future__ import annotations

import pytest
from support.fleetdata import defaults, fleet

from sparkfleet.config import ConfigError, validate_host_data
from sparkfleet.fleet import validate_fleet
from sparkfleet.mirrors import Mirror, fleet_mirrors


def mirrors(hosts) -> dict:
    return fleet_mirrors(hosts, validate_fleet(hosts))


def test_auto_is_the_first_host_and_everyone_uses_it():
    hosts = fleet(("spark-1", {"ssh_hostname": "10.0.0.11"}), ("spark-2", {}), ("spark-3", {}))
    got = mirrors(hosts)
    # No mirror_address: the address is found on the hosts (mirror.names.located), never
    # taken from the controller's name or ssh_hostname for it.
    served = ("spark-2", "spark-3")
    assert got["spark-1"] == Mirror("spark-1", None, 8090, 5000, True, 8089, serves=served)
    assert got["spark-2"] == Mirror("spark-1", None, 8090, 5000, False, 8089, serves=served)
    given = fleet(("spark-1", {"mirror_address": "10.0.0.11"}), ("spark-2", {}))
    assert mirrors(given)["spark-2"].hf_endpoint == "http://10.0.0.11:8090"
    assert mirrors(given)["spark-2"].registry == "10.0.0.11:5000"


def test_an_ipv6_mirror_address_is_bracketed_in_urls_and_registry_names():
    given = fleet(("spark-1", {"mirror_address": "fd00::11"}), ("spark-2", {}))
    mirror = mirrors(given)["spark-2"]
    assert mirror.address == "fd00::11"
    assert mirror.hf_endpoint == "http://[fd00::11]:8090" and mirror.registry == "[fd00::11]:5000"


def test_a_mirror_group_or_a_name_picks_the_host():
    hosts = fleet(("spark-1", {}), ("spark-2", {}), ("spark-3", {"mirror_address": "fast.lan"}),
                  groups={"mirror": ["spark-3"]})
    assert {s.host for s in mirrors(hosts).values()} == {"spark-3"}
    assert mirrors(hosts)["spark-1"].address == "fast.lan"
    named = fleet(*[(n, {"fleet_mirror": "spark-2"}) for n in ("spark-1", "spark-2")])
    assert mirrors(named)["spark-1"].host == "spark-2" and mirrors(named)["spark-2"].is_self


def test_none_turns_it_off_for_every_host_or_one():
    off = fleet(("spark-1", {"fleet_mirror": "none"}), ("spark-2", {"fleet_mirror": None}))
    assert mirrors(off) == {"spark-1": None, "spark-2": None}
    one = fleet(("spark-1", {}), ("spark-2", {"fleet_mirror": "off"}))
    assert mirrors(one)["spark-2"] is None and mirrors(one)["spark-1"].is_self


def test_an_unknown_mirror_or_a_mirror_that_does_not_use_itself_is_refused():
    with pytest.raises(ConfigError, match=r"spark-2: `fleet_mirror` = 'spark-9' is not a host"):
        validate_fleet(fleet(("spark-1", {}), ("spark-2", {"fleet_mirror": "spark-9"})))
    with pytest.raises(ConfigError, match=r"spark-2: serves the mirror for spark-1, so it must use it too"):
        validate_fleet(fleet(("spark-1", {"fleet_mirror": "spark-2"}), ("spark-2", {"fleet_mirror": None})))


@pytest.mark.parametrize("key,value,needle", [
    ("mirror_olah", "olah==0.5.4; rm -rf /", "not a pip requirement"),
    ("mirror_address", "spark 1", "host name, an IPv4 or an IPv6 address"),
    ("mirror_dir", "relative/dir", "absolute path"),
    ("mirror_hf_port", 0, "greater than or equal to 1"),
    ("apt_repo", "http://apt.lan/", "both apt_repo and apt_key_url"),
])
def test_mirror_settings_are_validated(key, value, needle):
    with pytest.raises(ConfigError, match=needle):
        validate_host_data("spark-1", {**defaults(), key: value})


def test_auto_skips_a_host_the_controller_cannot_reach(caplog):
    hosts = fleet(("spark-1", {}), ("spark-2", {}), ("spark-3", {}))
    got = fleet_mirrors(hosts, validate_fleet(hosts), unreachable={"spark-1"})
    assert {m.host for m in got.values()} == {"spark-2"} and got["spark-2"].is_self
    assert "spark-1 is unreachable, so spark-2 serves the mirror" in caplog.text
    grouped = fleet(("spark-1", {}), ("spark-2", {}), ("spark-3", {}), groups={"mirror": ["spark-2", "spark-3"]})
    got = fleet_mirrors(grouped, validate_fleet(grouped), unreachable={"spark-2"})
    assert {m.host for m in got.values()} == {"spark-3"}  # the group's next reachable host first
    # Every host of the group gone: any reachable host, rather than none.
    got = fleet_mirrors(grouped, validate_fleet(grouped), unreachable={"spark-2", "spark-3"})
    assert got["spark-3"].host == "spark-1"


def test_a_named_mirror_that_is_unreachable_stops_the_run_naming_the_key():
    named = fleet(*[(n, {"fleet_mirror": "spark-1"}) for n in ("spark-1", "spark-2", "spark-3")])
    with pytest.raises(ConfigError) as caught:
        fleet_mirrors(named, validate_fleet(named), unreachable={"spark-1"})
    message = str(caught.value)
    assert "nothing was changed on any host" in message
    assert "spark-1: `fleet_mirror` names it as the mirror of spark-2, spark-3, but it is unreachable" in message
    assert "fleet_mirror=auto" in message and "fleet_mirror=none" in message
    # An unreachable host that is no one's mirror changes nothing.
    assert fleet_mirrors(named, validate_fleet(named), unreachable={"spark-3"})["spark-2"].host == "spark-1"


def test_past_the_fanout_hosts_fetch_from_relays_breadth_first():
    names = [f"spark-{i}" for i in range(1, 17)]
    got = mirrors(fleet(*[(n, {}) for n in names]))
    def source(name: str) -> str:  # the host it fetches from
        return got[name].upstream.host if got[name].is_self else got[name].host

    # The mirror serves 3 hosts; each of those (a relay: its own mirror) serves 3 more.
    assert [n for n in names[1:] if source(n) == "spark-1"] == ["spark-2", "spark-3", "spark-4"]
    for relay in ("spark-2", "spark-3", "spark-4", "spark-5"):
        assert got[relay].is_self and got[relay].host == relay
        assert len(got[relay].serves) <= 3 and got[relay].hf_offline_port == 0
    assert got["spark-5"].depth == 2 and got["spark-5"].upstream.host == "spark-2"
    leaf = got["spark-16"]
    assert (leaf.host, leaf.is_self, leaf.upstream.host) == ("spark-5", False, "spark-2")
    # A host whose relay fails turns to the fleet's mirror (the only one above that serves
    # it); a relay's own copy first to the mirror above it.
    assert [m.host for m in leaf.fallbacks] == ["spark-1"]
    assert [m.host for m in got["spark-5"].fallbacks] == ["spark-2", "spark-1"]
    assert got["spark-1"].fallbacks == () and [m.host for m in got["spark-2"].fallbacks] == ["spark-1"]
    # Every host's offline fallback is the fleet's mirror; it serves (as a fallback) everyone.
    assert leaf.root.hf_offline_port == 8089 and set(got["spark-1"].serves) == set(names[1:])
    # No NIC carries more than the fanout's copies: count who each host serves.
    sources = [source(n) for n in names[1:]]
    assert max(sources.count(h) for h in names) == 3


def test_a_fanout_of_one_is_a_chain_and_fanout_must_agree():
    names = ["a", "b", "c"]
    got = mirrors(fleet(*[(n, {"fleet_fanout": 1}) for n in names]))
    assert got["c"].host == "b" and got["b"].is_self and got["b"].upstream.host == "a"
    with pytest.raises(ConfigError, match="fleet_fanout"):
        mirrors(fleet(("a", {"fleet_fanout": 1}), ("b", {"fleet_fanout": 2})))


def test_a_pairs_other_member_fetches_from_its_partner_outside_the_fanout():
    from sparkfleet.mirrors import relay_tree

    pairs = {"s1": ("s1", "s2"), "s2": ("s1", "s2"), "s3": ("s3", "s4"), "s4": ("s3", "s4")}
    assert relay_tree(["s1", "s2", "s3", "s4", "s5"], 2, pairs) == {"s2": "s1", "s3": "s1", "s4": "s3", "s5": "s1"}


def test_a_host_that_is_down_or_does_not_serve_is_never_a_relay():
    names = [f"spark-{i}" for i in range(1, 9)]
    hosts = fleet(*[(n, {"serving": n != "spark-3"}) for n in names])
    got = fleet_mirrors(hosts, validate_fleet(hosts), unreachable={"spark-2"})
    relays = {n for n in names if got[n] and got[n].is_self}
    assert "spark-2" not in relays and "spark-3" not in relays, relays
    assert got["spark-2"].host == got["spark-3"].host == "spark-1"  # when they next fetch: the mirror
    assert relays == {"spark-1", "spark-4"}, relays


def test_a_relay_is_reached_at_its_own_mirror_address_and_one_address_for_all_is_refused():
    names = ["a", "b", "c"]
    given = {"a": "10.0.0.1", "b": "10.0.0.2"}
    got = mirrors(fleet(*[(n, {"fleet_fanout": 1, **({"mirror_address": given[n]} if n in given else {})})
                          for n in names]))
    # a -> b -> c: c fetches from b at b's address, b copies from a at a's.
    assert got["c"].host == "b" and got["c"].hf_endpoint == "http://10.0.0.2:8090"
    assert got["b"].upstream.registry == "10.0.0.1:5000" and got["c"].root.address == "10.0.0.1"
    # Set for the whole fleet, the mirror's address would be every relay's too.
    with pytest.raises(ConfigError, match=r"a, b: each serves .* `mirror_address` = 10.0.0.1\. Fix: set "
                                          r"mirror_address in each one's host data"):
        mirrors(fleet(*[(n, {"fleet_fanout": 1, "mirror_address": "10.0.0.1"}) for n in names]))
    # A star (no relay) takes it for the mirror, as before.
    assert mirrors(fleet(*[(n, {"mirror_address": "10.0.0.1"}) for n in names]))["c"].address == "10.0.0.1"
