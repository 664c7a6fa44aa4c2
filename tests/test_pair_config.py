"""Pairs as inventory data: pair_* groups, their ranks and addresses, and what validation
refuses before any host changes (no fleet)."""

from __future__ import annotations

import pytest
from support.fleetdata import fleet

from sparkfleet import fleet as fleet_module
from sparkfleet.config import ConfigError
from sparkfleet.fleet import validate_fleet
from sparkfleet.mirrors import Mirror
from sparkfleet.pairs import Pair, fleet_pairs


def pairs(hosts) -> dict[str, Pair]:
    return fleet_pairs(hosts, validate_fleet(hosts))[0]


def four(**data) -> list:
    names = ("spark-1", "spark-2", "spark-3", "spark-4")
    return fleet(*[(n, data.get(n, {})) for n in names],
                 groups={"pair_a": ["spark-1", "spark-2"], "pair_b": ["spark-3", "spark-4"]})


def test_a_pair_group_ranks_its_hosts_and_gives_them_link_addresses():
    got = pairs(four())
    assert set(got) == {"spark-1", "spark-2", "spark-3", "spark-4"}
    head, worker = got["spark-1"], got["spark-2"]
    assert (head.group, head.members, head.rank, head.is_head) == ("pair_a", ("spark-1", "spark-2"), 0, True)
    assert (worker.rank, worker.is_head, worker.head) == (1, False, "spark-1")
    assert head.addresses == ("192.168.100.1", "192.168.100.2") and head.prefix_len == 24
    assert worker.address == "192.168.100.2" and worker.master_addr == "192.168.100.1"
    assert worker.peer_addresses == ("192.168.100.1",) and head.port == 29500
    # Each pair is its own cable: the second pair reuses the plan.
    assert got["spark-3"].addresses == head.addresses and got["spark-4"].head == "spark-3"


def test_hosts_outside_pairs_serve_alone():
    hosts = fleet(("spark-1", {}), ("spark-2", {}), ("spark-3", {}), groups={"pair_x": ["spark-1", "spark-2"]})
    assert "spark-3" not in pairs(hosts)


def test_members_that_differ_in_profile_model_revision_or_image_are_refused_naming_both():
    for data, key in [({"profile": "dflash"}, "profile"),
                      ({"model_revisions": {"bleysg/Qwen3.5-122B-A10B-int4-fp8-hybrid": "abc123"}}, "model@revision"),
                      ({"image": "registry.example/vllm:other"}, "image")]:
        with pytest.raises(ConfigError) as err:
            validate_fleet(four(**{"spark-4": data}))
        message = str(err.value)
        assert "nothing was changed on any host" in message
        assert f"pair_b: spark-3 and spark-4 differ in `{key}`" in message, message
        assert "pair_a" not in message  # the good pair is not blamed


def test_members_that_would_start_different_engines_are_refused():
    with pytest.raises(ConfigError, match=r"pair_a: spark-1 and spark-2 would start different engines "
                                          r"\(SF_MAX_MODEL_LEN differ\)"):
        validate_fleet(four(**{"spark-2": {"max_model_len": 4096}}))


def test_a_host_in_two_pairs_and_a_pair_of_one_are_refused():
    hosts = fleet(("spark-1", {}), ("spark-2", {}), ("spark-3", {}),
                  groups={"pair_a": ["spark-1", "spark-2"], "pair_b": ["spark-2", "spark-3"], "pair_c": ["spark-1"]})
    with pytest.raises(ConfigError) as err:
        validate_fleet(hosts)
    message = str(err.value)
    assert "spark-2: is in two pairs, pair_a and pair_b" in message
    assert "pair_c: a pair needs two hosts, the inventory lists spark-1" in message


def test_pair_settings_are_validated():
    for key, value in [("pair_subnet", "300.1.2.0/24"), ("pair_subnet", "10.0.0.0/31"), ("pair_mtu", 100),
                       ("pair_interface", "eth0; reboot"), ("pair_master_port", 0)]:
        with pytest.raises(ConfigError, match=f"spark-1: `{key}`"):
            validate_fleet(fleet(("spark-1", {key: value})))


def test_ranks_follow_the_inventory_order_of_a_real_pyinfra_inventory():
    """pyinfra keeps one order of hosts: a group listed in another order does not reorder it."""
    from pyinfra.api import Inventory
    from support.fleetdata import defaults

    inventory = Inventory((["@fake/spark-1", "@fake/spark-2", "@fake/spark-3"], defaults()),
                          pair_x=(["@fake/spark-3", "@fake/spark-2"], {}))
    got = fleet_pairs(inventory, validate_fleet(inventory))[0]
    assert got["@fake/spark-2"].is_head and got["@fake/spark-3"].rank == 1
    assert "@fake/spark-1" not in got


def test_a_member_reaches_a_mirror_in_its_pair_over_the_link(monkeypatch):
    monkeypatch.setattr(fleet_module, "all_pairs", lambda: pairs(four()))
    mirror = Mirror("spark-1", "10.213.0.11", 8090, 5000, False)
    assert fleet_module.mirror_route("spark-2", mirror) == ("192.168.100.2", "192.168.100.1")  # (source, via)
    assert fleet_module.mirror_route("spark-1", mirror) is None  # the mirror itself
    assert fleet_module.mirror_route("spark-3", mirror) is None  # another pair: the management network
    assert fleet_module.mirror_route("spark-5", mirror) is None  # serves alone
    assert fleet_module.mirror_route("spark-2", Mirror("spark-1", "fd00::11", 8090, 5000, False)) is None  # IPv4 link
    assert fleet_module.mirror_route("spark-4", Mirror("spark-3", "10.213.0.13", 8090, 5000, False)) == (
        "192.168.100.2", "192.168.100.1")
