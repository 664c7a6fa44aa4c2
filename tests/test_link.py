"""The ConnectX-7 link: ibdev2netdev as the fact reads it, the interface and RoCE devices
it picks, the netplan file, and the preflight's messages (the e2e suite runs them for real)."""

from __future__ import annotations

from types import SimpleNamespace

import yaml

from sparkfleet import link
from sparkfleet.mirrors import Mirror
from sparkfleet.pairs import Pair
from sparkfleet.routes import Answers, RoceGids, RoceNetdevs, RouteSource

# A Spark cabled on its second QSFP port, as mlx5's ibdev2netdev prints it.
IBDEV2NETDEV = [
    "rocep1s0f0 port 1 ==> enp1s0f0np0 (Down)",
    "rocep1s0f1 port 1 ==> enp1s0f1np1 (Up)",
    "roceP2p1s0f0 port 1 ==> enP2p1s0f0np0 (Down)",
    "roceP2p1s0f1 port 1 ==> enP2p1s0f1np1 (Up)",
]
ROCE = RoceNetdevs().process(IBDEV2NETDEV)
NETDEVS = {d["netdev"]: {"state": "UP" if d["up"] else "DOWN", "mtu": 1500} for d in ROCE}
PAIR = Pair(group="pair_a", members=("spark-1", "spark-2"), rank=1, addresses=("192.168.100.1", "192.168.100.2"),
            prefix_len=24, port=29500)


def test_ibdev2netdev_is_read_device_by_device():
    assert ROCE[1] == {"hca": "rocep1s0f1", "netdev": "enp1s0f1np1", "up": True}
    assert [d["up"] for d in ROCE] == [False, True, False, True]
    # Anything else it may print (a warning, an empty line) is not a device.
    assert RoceNetdevs().process(["", "mlx5: warning", "rocep1s0f0 port 1 ==> enp1s0f0np0 (Down)"]) == [ROCE[0]]
    assert RoceNetdevs().default() == []


def test_auto_picks_the_cabled_ports_enp_netdev_and_its_up_roce_devices():
    assert link.pick(ROCE, "auto", "auto") == ("enp1s0f1np1", ("enp1s0f1np1", "enP2p1s0f1np1"),
                                               "rocep1s0f1,roceP2p1s0f1")
    # Both ports cabled: the first port's interface, every Up device for NCCL.
    both = RoceNetdevs().process([line.replace("(Down)", "(Up)") for line in IBDEV2NETDEV])
    interface, netdevs, hcas = link.pick(both, "auto", "auto")
    assert (interface, netdevs) == ("enp1s0f0np0", ("enp1s0f0np0", "enP2p1s0f0np0"))
    assert hcas == "rocep1s0f0,rocep1s0f1,roceP2p1s0f0,roceP2p1s0f1"
    # Nothing cabled: no interface (the preflight says why).
    none = RoceNetdevs().process([line.replace("(Up)", "(Down)") for line in IBDEV2NETDEV])
    assert link.pick(none, "auto", "auto") == ("", (), "")


def test_settings_override_what_auto_finds():
    assert link.pick(ROCE, "enP2p1s0f1np1", "rocep1s0f1") == ("enP2p1s0f1np1", ("enP2p1s0f1np1", "enp1s0f1np1"),
                                                             "rocep1s0f1")
    assert link.twin("enp1s0f1np1") == "enP2p1s0f1np1" and link.twin("enP2p1s0f0np0") == "enp1s0f0np0"
    assert link.twin("enP7s7") == ""


def _link(**changes) -> link.Link:
    base = dict(interface="enp1s0f1np1", netdevs=("enp1s0f1np1", "enP2p1s0f1np1"), hcas="rocep1s0f1,roceP2p1s0f1",
                address="192.168.100.2", prefix_len=24, mtu=9000, peers=(("spark-1", "192.168.100.1"),))
    return link.Link(**{**base, **changes})


def test_the_netplan_file_addresses_the_interface_and_gives_both_netdevs_the_mtu():
    text = link.netplan(_link(), "pair_a")
    assert text.startswith("# Rendered by sparkfleet (link.py): the ConnectX-7 link of pair_a.\n")
    assert yaml.safe_load(text) == {"network": {"version": 2, "ethernets": {
        "enp1s0f1np1": {"dhcp4": False, "addresses": ["192.168.100.2/24"], "mtu": 9000, "optional": True},
        "enP2p1s0f1np1": {"dhcp4": False, "mtu": 9000, "optional": True},
    }}}
    assert "mtu: 1500" in link.netplan(_link(mtu=1500), "pair_a")


def test_a_peer_that_is_the_fleet_mirror_is_routed_over_the_link():
    text = link.netplan(_link(routes=(("10.213.0.11", "192.168.100.1"),)), "pair_a")
    port = yaml.safe_load(text)["network"]["ethernets"]["enp1s0f1np1"]
    assert port["routes"] == [{"to": "10.213.0.11/32", "via": "192.168.100.1"}]
    assert "routes" not in yaml.safe_load(text)["network"]["ethernets"]["enP2p1s0f1np1"]


class Target:
    """A host whose link is up and answers; ``source`` is its route's to the mirror."""

    def __init__(self, source: str) -> None:
        self.source = source

    def get_fact(self, fact, **kwargs):
        if fact is RouteSource:
            return self.source
        if fact is Answers:
            return True
        ipv4 = {"address": "192.168.100.2", "mask_bits": 24}
        return {"enp1s0f1np1": {"state": "UP", "mtu": 9000, "ipv4": ipv4}, "enP2p1s0f1np1": {"mtu": 9000}}


def test_the_link_check_fails_while_the_mirror_is_reached_past_the_link():
    routed = _link(routes=(("10.213.0.11", "192.168.100.1"),))
    assert link.link_problem(Target("192.168.100.2"), routed) is None
    problem = link.link_problem(Target("10.213.0.12"), routed)
    assert problem.startswith("the fleet mirror 10.213.0.11 is reached from 10.213.0.12, expected over "
                              "enp1s0f1np1 via 192.168.100.1 from 192.168.100.2"), problem
    assert "netplan apply" in problem


def test_ping_fact_sends_one_bounded_ping_out_of_the_interface():
    command = Answers().command("enp1s0f1np1", "192.168.100.1", size=8972, dont_fragment=True)
    assert "ping -c 1 -W 2 -M do -s 8972 -I enp1s0f1np1 192.168.100.1" in command
    assert "-M do" not in Answers().command("enp1s0f1np1", "192.168.100.1")
    assert Answers().process(["yes"]) and not Answers().process(["no"]) and not Answers().process([])


def judged(roce=ROCE, devices=None, rdma=True, interface="auto", hcas="auto") -> list[str]:
    return link.judged(roce, NETDEVS if devices is None else devices, rdma, interface, hcas, PAIR)


def test_a_cabled_host_has_no_problems():
    assert judged() == []
    assert judged(interface="enp1s0f1np1", hcas="rocep1s0f1,roceP2p1s0f1") == []


def test_no_port_up_names_the_cable_and_the_peer():
    none = RoceNetdevs().process([line.replace("(Up)", "(Down)") for line in IBDEV2NETDEV])
    [problem] = judged(roce=none)
    assert problem.startswith("no ConnectX-7 port is up (ibdev2netdev: enp1s0f0np0 Down, enp1s0f1np1 Down")
    assert "check the QSFP cable between this host and spark-1 (reseat both ends)" in problem
    assert "reboot" in problem


def test_a_named_interface_must_exist_have_a_roce_device_and_be_up():
    [absent] = judged(interface="enp9s0")
    assert absent == ("pair_interface enp9s0 is not a network device here (the ConnectX-7's are enp1s0f0np0, "
                      "enp1s0f1np1): set pair_interface to the cabled one, or to auto")
    [no_roce] = judged(devices={**NETDEVS, "enP7s7": {"state": "UP"}}, interface="enP7s7")
    assert no_roce.startswith("pair_interface enP7s7 has no RoCE device (ibdev2netdev: ")
    [down] = judged(interface="enp1s0f0np0")
    assert down.startswith("pair_interface enp1s0f0np0 is Down") and "QSFP cable" in down


def test_roce_devices_and_dev_infiniband_are_required():
    [hca] = judged(hcas="rocep1s0f1,mlx5_7")
    assert hca.startswith("pair_hcas names mlx5_7, which ibdev2netdev does not list (")
    assert hca.endswith("fix pair_hcas, or set it to auto")
    [dev] = judged(rdma=False)
    assert dev.startswith("/dev/infiniband is missing") and "modprobe mlx5_ib" in dev
    no_tool = judged(roce=[], rdma=False)
    assert len(no_tool) == 2 and no_tool[0].startswith("ibdev2netdev lists no RoCE device")


class Host:
    """Just enough of a pyinfra host: the facts link.resolved reads."""

    def __init__(self, roce, gids=()):
        self.roce, self.gids, self.name = roce, list(gids), "spark-2"

    def get_fact(self, fact, **_):
        assert fact in (RoceNetdevs, RoceGids)
        return self.roce if fact is RoceNetdevs else self.gids


def test_resolved_is_this_members_end_of_the_pair(monkeypatch):
    settings = SimpleNamespace(pair_interface="auto", pair_hcas="auto", pair_mtu=9000, pair_gid_index="auto")
    monkeypatch.setattr(link, "host", Host(ROCE, GIDS))
    monkeypatch.setattr(link, "host_mirror", lambda: None)
    end = link.resolved(settings, PAIR)
    assert (end.interface, end.hcas) == ("enp1s0f1np1", "rocep1s0f1,roceP2p1s0f1")  # what serve.env is given
    assert (end.address, end.prefix_len, end.mtu, end.gid_index) == ("192.168.100.2", 24, 9000, 5)
    assert end.peers == (("spark-1", "192.168.100.1"),)
    settings.pair_hcas = "rocep1s0f1"
    assert link.resolved(settings, PAIR).hcas == "rocep1s0f1"
    assert end.routes == ()
    # The pair's head is the fleet mirror: this member routes its address over the link.
    monkeypatch.setattr(link, "host_mirror", lambda: Mirror("spark-1", "10.213.0.11", 8090, 5000, False))
    monkeypatch.setattr(link, "mirror_route", lambda name, mirror: ("192.168.100.2", "192.168.100.1"))
    assert link.resolved(settings, PAIR).routes == (("10.213.0.11", "192.168.100.1"),)


# show_gids on a Spark whose link port also has IPv6 GIDs: the RoCE v2 GID of the IPv4 address at 5.
SHOW_GIDS = """DEV\tPORT\tINDEX\tGID\t\t\t\t\tIPv4  \t\tVER\tDEV
---\t----\t-----\t---\t\t\t\t\t------------  \t---\t---
rocep1s0f1\t1\t0\tfe80:0000:0000:0000:0200:4b1e:00aa:0001\t\t\tv1\tenp1s0f1np1
rocep1s0f1\t1\t1\tfe80:0000:0000:0000:0200:4b1e:00aa:0001\t\t\tv2\tenp1s0f1np1
rocep1s0f1\t1\t2\tfd00:0000:0000:0000:0200:4b1e:00aa:0001\t\t\tv1\tenp1s0f1np1
rocep1s0f1\t1\t3\tfd00:0000:0000:0000:0200:4b1e:00aa:0001\t\t\tv2\tenp1s0f1np1
rocep1s0f1\t1\t4\t0000:0000:0000:0000:0000:ffff:c0a8:6402\t192.168.100.2  \tv1\tenp1s0f1np1
rocep1s0f1\t1\t5\t0000:0000:0000:0000:0000:ffff:c0a8:6402\t192.168.100.2  \tv2\tenp1s0f1np1
n_gids_found=6""".splitlines()
GIDS = RoceGids().process(SHOW_GIDS)


def test_show_gids_is_read_with_its_empty_ipv4_column():
    assert len(GIDS) == 6
    assert GIDS[1] == {"hca": "rocep1s0f1", "port": 1, "index": 1, "gid": "fe80:0000:0000:0000:0200:4b1e:00aa:0001",
                       "ipv4": "", "version": "v2", "netdev": "enp1s0f1np1"}
    assert (GIDS[5]["ipv4"], GIDS[5]["version"]) == ("192.168.100.2", "v2")


def test_gid_index_is_the_roce_v2_gid_of_the_links_address():
    hcas = "rocep1s0f1,roceP2p1s0f1"
    assert link.gid_index(GIDS, hcas, "192.168.100.2", "auto") == 5
    assert link.gid_index(GIDS[:4], hcas, "192.168.100.2", "auto") == link.SPARK_GID_INDEX  # not applied yet
    assert link.gid_index(GIDS, hcas, "192.168.100.2", 3) == 3  # pair_gid_index wins


def _measured_link():
    return link.Link(interface="enp1s0f1np1", netdevs=("enp1s0f1np1",), hcas="rocep1s0f1", address="192.168.100.2",
                     prefix_len=24, mtu=9000, peers=(("spark-1", "192.168.100.1"),), gid_index=1)


def test_measurement_names_the_transport_the_figure_and_the_cause():
    gid = link.judged_measurement({"transport": "Socket", "busbw_gbs": 4.0, "mtu": 9000}, _measured_link(), 21.875, 3)
    assert "NET/Socket, not RoCE, at 4 GB/s (floor 21.875 GB/s" in gid
    assert "NCCL_IB_GID_INDEX=1, but this host's RoCE v2 GID of 192.168.100.2 is index 3" in gid
    assert "pair_gid_index=3" in gid
    mtu = link.judged_measurement({"transport": "Socket", "busbw_gbs": 4.0, "mtu": 1500}, _measured_link(), 21.875, 1)
    assert "MTU 1500 on enp1s0f1np1 (pair_mtu)" in mtu and "pair_mtu=9000" in mtu
    slow = link.judged_measurement({"transport": "IB", "busbw_gbs": 12.5, "speed_mbps": 100000}, _measured_link(), 21.875, 1)
    assert "over RoCE reached 12.5 GB/s, below the floor of 21.875" in slow and "100000 Mb/s" in slow
    assert link.judged_measurement({"transport": "IB", "busbw_gbs": 23.0}, _measured_link(), 21.875, 1) is None
