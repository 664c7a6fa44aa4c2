"""A pair's ConnectX-7 link, deployed on a simulated pair: netplan gives each member its
address and the MTU, a converged re-run changes nothing, the peers answer over the link
with full-size unfragmented packets, and a pulled cable or a drifted MTU stops the host
with a message naming it and the fix.

Boots its own 2-host fleet cabled as one pair (it replaces any fleet of this instance)
and removes it at the end of the module. Needs root (marked e2e); fails - does not skip -
without it.
"""

from __future__ import annotations

import json
import re
import time

import pytest
from support.failures import changes

from tests.e2e.conftest import module_fleet

pytestmark = pytest.mark.e2e

DEPLOY = "tests/e2e/deploys/link_only.py"
HEAD, WORKER = "spark-1", "spark-2"
ADDRESS = {HEAD: "192.168.100.1", WORKER: "192.168.100.2"}  # group_data/all.py's pair_subnet, by rank
IFACE, TWIN = "enp1s0f1np1", "enP2p1s0f1np1"


@pytest.fixture(scope="module")
def tb():
    with module_fleet(2, n_pairs=1) as bed:  # as DGX OS sets a Spark up: a password-sudo user
        yield bed


def sh(tb, host: str, cmd: str) -> str:
    cp = tb.exec(host, cmd)
    assert cp.returncode == 0, f"{host}: {cmd!r} -> {cp.returncode}\n{cp.stdout}\n{cp.stderr}"
    return cp.stdout


def links(tb, host: str) -> dict[str, dict]:
    return {link["ifname"]: link for link in json.loads(sh(tb, host, "ip -j addr show"))}


def ipv4(link: dict) -> list[str]:
    return [f"{a['local']}/{a['prefixlen']}" for a in link["addr_info"] if a["family"] == "inet"]


def cabled(tb, up: bool, timeout: float = 10) -> None:
    """Wait until both members' ibdev2netdev show the port as the kernel now has it (the
    kernel's link watch reports carrier changes up to a second late)."""
    want = "Up" if up else "Down"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = [sh(tb, h, "ibdev2netdev") for h in (HEAD, WORKER)]
        if all(f"==> {IFACE} ({want})" in s and f"==> {TWIN} ({want})" in s for s in states):
            return
        time.sleep(0.3)
    raise AssertionError(f"the link is not {want} after {timeout} s: {states}")


def deploy(run_pyinfra, *args: str):
    t0 = time.monotonic()
    result = run_pyinfra(DEPLOY, *args, timeout=300)
    print(f"\n{DEPLOY} {' '.join(args)}: rc {result.returncode} in {time.monotonic() - t0:.1f}s")
    return result, result.stdout + result.stderr


def test_netplan_addresses_the_link_and_the_peer_answers_over_it(tb, deploy_run):
    # A ConnectX-7 comes up at MTU 1500: the deploy's netplan file sets pair_mtu.
    sh(tb, WORKER, f"ip link set {IFACE} mtu 1500 && ip link set {TWIN} mtu 1500")
    result, out = deploy(deploy_run)
    assert result.returncode == 0, out[-4000:]
    assert re.search(r"\| netplan apply \n(?:\s+\[spark-\d(?:\.local)?\] Success\n){2}", out), out[-4000:]
    for host in (HEAD, WORKER):
        assert sh(tb, host, "stat -c '%a %U' /etc/netplan/40-cx7.yaml").strip() == "600 root"
        text = sh(tb, host, "cat /etc/netplan/40-cx7.yaml")
        assert f"addresses: [{ADDRESS[host]}/24]" in text and text.count("mtu: 9000") == 2, text
        now = links(tb, host)
        assert ipv4(now[IFACE]) == [f"{ADDRESS[host]}/24"], now[IFACE]
        assert ipv4(now[TWIN]) == []  # the twin gets the MTU only
        assert now[IFACE]["mtu"] == now[TWIN]["mtu"] == 9000
        # The management interface, which the deploy's SSH uses, is as the testbed made it.
        assert ipv4(now["eth0"]) == [f"{tb.host(host).address}/24"]
        assert "default via" in sh(tb, host, "ip route show default")
    # Full-size frames cross the link unfragmented, both ways.
    for host, peer in ((HEAD, WORKER), (WORKER, HEAD)):
        sh(tb, host, f"ping -c 1 -W 2 -M do -s 8972 -I {IFACE} {ADDRESS[peer]}")


def test_a_converged_rerun_changes_nothing(tb, deploy_run):
    before = {h: sh(tb, h, "stat -c %Y /etc/netplan/40-cx7.yaml") for h in (HEAD, WORKER)}
    result, out = deploy(deploy_run, "-v")
    assert result.returncode == 0, out[-4000:]
    assert changes(out) == [], out[-4000:]  # no netplan apply, no check run
    assert {h: sh(tb, h, "stat -c %Y /etc/netplan/40-cx7.yaml") for h in (HEAD, WORKER)} == before
    for host, peer in ((HEAD, WORKER), (WORKER, HEAD)):
        assert re.search(rf"\[{host}(?:\.local)?\] noop: {IFACE} {ADDRESS[host]}/24 MTU 9000, answering: "
                         rf"{peer}(?:\.local)? \({ADDRESS[peer]}\)", out), out[-4000:]


def test_a_drifted_mtu_fails_the_check_naming_the_interface_and_the_fix(tb, deploy_run):
    sh(tb, HEAD, f"ip link set {IFACE} mtu 1500")  # the file is right, the live link is not
    try:
        result, out = deploy(deploy_run)
        assert result.returncode != 0, out[-4000:]
        assert re.search(rf"\[{HEAD}(?:\.local)?\] the link answers end to end: {IFACE} has MTU 1500, expected 9000 "
                         r"\(pair_mtu\): /etc/netplan/40-cx7.yaml has it; run `sudo netplan apply` on this host",
                         out), out[-4000:]
        # Its peer sees the same fault from its side: small pings pass, full-size ones do not.
        assert re.search(rf"\[{WORKER}(?:\.local)?\] the link answers end to end: {HEAD}(?:\.local)? "
                         rf"\({ADDRESS[HEAD]}\) answers "
                         rf"on {IFACE} but not 8972-byte unfragmented pings", out), out[-4000:]
    finally:
        sh(tb, HEAD, "netplan apply")


def test_a_pulled_cable_stops_the_preflight_naming_the_cable_and_the_peer(tb, deploy_run):
    sh(tb, WORKER, f"ip link set {IFACE} down && ip link set {TWIN} down")  # both ends lose carrier
    try:
        cabled(tb, up=False)
        result, out = deploy(deploy_run)
        assert result.returncode != 0, out[-4000:]
        for host, peer in ((WORKER, HEAD), (HEAD, WORKER)):
            assert re.search(rf"\[{host}(?:\.local)?\] .*preflight failed, nothing was changed on this host", out), \
                out[-4000:]
            assert re.search(rf"\[{host}(?:\.local)?\]\s+- no ConnectX-7 port is up \(ibdev2netdev: enp1s0f0np0 Down, {IFACE} Down, enP2p1s0f0np0 "
                             rf"Down, {TWIN} Down\): check the QSFP cable between this host and {peer}(?:\.local)? "
                             r"\(reseat both ends\)", out), out[-4000:]
    finally:
        sh(tb, WORKER, f"ip link set {IFACE} up && ip link set {TWIN} up")
        cabled(tb, up=True)
    # Cabled again, the link answers with nothing changed (networkd kept its address).
    result, out = deploy(deploy_run)
    assert result.returncode == 0, out[-4000:]
    assert changes(out) == [], out[-4000:]


def test_a_wrong_pair_interface_stops_the_preflight_naming_the_setting(tb, deploy_run):
    result, out = deploy(deploy_run, "--data", "pair_interface=enp9s0")
    assert result.returncode != 0, out[-4000:]
    for host in (HEAD, WORKER):
        assert re.search(rf"\[{host}(?:\.local)?\]\s+- pair_interface enp9s0 is not a network device here \(the "
                         r"ConnectX-7's are enp1s0f0np0, enp1s0f1np1\): set pair_interface to the cabled one, "
                         "or to auto", out), out[-4000:]
    assert sh(tb, HEAD, "grep -c enp1s0f1np1 /etc/netplan/40-cx7.yaml").strip() == "1"  # nothing was changed


def test_a_member_whose_peer_fails_its_preflight_changes_nothing_and_names_the_peer(tb, deploy_run):
    """A pair serves only when every member can: the head's link is good, its peer's RoCE
    devices are gone, and the head stops at the preflight too, naming the peer and why."""
    sh(tb, HEAD, "rm /etc/netplan/40-cx7.yaml")  # a head that went on would write it again
    sh(tb, WORKER, "mv /dev/infiniband /dev/infiniband.off")  # the worker alone fails its preflight
    try:
        result, out = deploy(deploy_run)
        assert result.returncode != 0, out[-4000:]
        missing = r"/dev/infiniband is missing \(NCCL's RoCE transport and the serving container need it\)"
        assert re.search(rf"\[{WORKER}(?:\.local)?\] .*preflight failed, nothing was changed on this host", out), \
            out[-4000:]
        assert re.search(rf"\[{WORKER}(?:\.local)?\]\s+- {missing}", out), out[-4000:]
        assert re.search(rf"\[{HEAD}(?:\.local)?\] .*its pair peer {WORKER}(?:\.local)? failed its preflight, so "
                         rf"nothing was changed on this host \(a pair serves only when every member can: fix "
                         rf"{WORKER}(?:\.local)?, then deploy both\)", out), out[-4000:]
        assert re.search(rf"\[{HEAD}(?:\.local)?\]\s+- {WORKER}(?:\.local)?: {missing}", out), out[-4000:]
        assert "no ConnectX-7 port is up" not in out and "netplan apply" not in out, out[-4000:]
        assert sh(tb, HEAD, "test -e /etc/netplan/40-cx7.yaml && echo written || echo absent").strip() == "absent"
    finally:
        sh(tb, WORKER, "mv /dev/infiniband.off /dev/infiniband")
    # Both pass again: the head writes its file, and its live link (kept by networkd) answers.
    result, out = deploy(deploy_run, "-v")
    assert result.returncode == 0, out[-4000:]
    assert f"addresses: [{ADDRESS[HEAD]}/24]" in sh(tb, HEAD, "cat /etc/netplan/40-cx7.yaml")
    assert re.search(rf"\[{HEAD}(?:\.local)?\] noop: preflight passed: pair_1 rank 0; pair_1: {WORKER}(?:\.local)? "
                     "passed too", out), out[-4000:]
