"""The preflight's ports, firewalls and driver: what the facts make of hosts' answers, what
each finding says, and the whole preflight on @fake hosts (no fleet)."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from pyinfra.context import ctx_host
from support.fleetdata import fake_state

from sparkfleet import preflight
from sparkfleet.fleet import fleet_settings
from sparkfleet.gpu import Gpu
from sparkfleet.ports import ALL, Firewall, Listeners, in_container
from sparkfleet.preflight import Listen

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "fake_fleet.py"


# --- the facts ------------------------------------------------------------------------------


def test_one_read_names_every_ports_holders_and_whether_they_are_our_container():
    cid = "4f1c" * 16
    got = in_container(Listeners().process([
        f"listen 8000 901 /system.slice/docker-{cid}.scope vllm",
        f"listen 8000 901 /system.slice/docker-{cid}.scope vllm",  # its IPv6 socket
        "listen 8080 77 /system.slice/open-webui.service open-webui",
        "listen 8009 1 /init.scope systemd",
    ]), cid)
    assert got == {8000: [{"name": "vllm", "pid": 901, "unit": f"docker-{cid}.scope",
                           "cgroup": f"/system.slice/docker-{cid}.scope", "container": True}],
                   8080: [{"name": "open-webui", "pid": 77, "unit": "open-webui.service",
                           "cgroup": "/system.slice/open-webui.service", "container": False}],
                   8009: [{"name": "systemd", "pid": 1, "unit": "init.scope", "cgroup": "/init.scope",
                           "container": False}]}
    # No container of ours: nothing is ours by id; a port nobody holds is absent.
    holders = Listeners().process(["listen 8000 5 /user.slice/x.scope python3"])
    assert in_container(holders, "")[8000][0]["container"] is False
    command = Listeners().command(ports=[8009, 8000, 8000])
    assert command.count("ss -Hltnp") == 1 and "'( sport = :8000 or sport = :8009 )'" in command


def test_the_holders_cgroup_and_name_come_from_proc_in_one_awk():
    """ss's line for a process in, its cgroup (as /proc lists it) and name out: this test's own."""
    pid = os.getpid()
    ss = (f"LISTEN 0 128 0.0.0.0:8000 0.0.0.0:* users:((\"py\",pid={pid},fd=3),(\"py\",pid={pid},fd=4))\n"
          f"LISTEN 0 128 [::]:8000 [::]:* users:((\"py\",pid={pid},fd=5))\n")
    command = Listeners().command(ports=[8000]).split(" | ", 1)[1]
    out = subprocess.run(command, shell=True, input=ss, capture_output=True, text=True, check=True).stdout
    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    cgroup = next(line.split(":", 2)[2] for line in lines if line.startswith("0::") or ":name=systemd:" in line)
    assert Listeners().process(out.splitlines()) == {8000: [{
        "name": Path(f"/proc/{pid}/comm").read_text().strip(), "pid": pid,
        "unit": cgroup.rstrip("/").rsplit("/", 1)[-1], "cgroup": cgroup}]}


UFW_ACTIVE = ["## ufw", "Status: active", "Logging: on (low)", "Default: deny (incoming), allow (outgoing), disabled (routed)",
              "New profiles: skip", "", "To                         Action      From",
              "--                         ------      ----",
              "22/tcp                     ALLOW IN    Anywhere",
              "8000/tcp                   ALLOW IN    192.168.1.0/24",
              "5000:5010/tcp              ALLOW IN    Anywhere",
              "9000/udp                   ALLOW IN    Anywhere",
              "OpenSSH                    ALLOW IN    Anywhere",
              "22/tcp (v6)                ALLOW IN    Anywhere (v6)"]


def test_ufw_is_read_from_its_status():
    ufw = Firewall().process(UFW_ACTIVE)["ufw"]
    assert ufw["active"] and ufw["incoming"] == "deny"
    assert [(r.start, r.stop - 1) for r in ufw["allowed"]] == [(22, 22), (8000, 8000), (5000, 5010), (22, 22)]
    assert Firewall().process(["## ufw", "Status: inactive"])["ufw"]["active"] is False
    assert Firewall().process(["## ufw", "ERROR: You need to be root to run this script"])["ufw"] is None
    assert Firewall().process([]) == {"ufw": None, "chains": []}


NFT = """table inet filter {
	chain input {
		type filter hook input priority filter; policy drop;
		ct state established,related accept
		iif "lo" accept
		tcp dport 22 accept
		tcp dport { 5000, 8090 } accept
		jump fleet
	}
	chain fleet {
		tcp dport 8000-8009 accept
	}
	chain forward {
		type filter hook forward priority filter; policy drop;
	}
}
table ip nat {
	chain POSTROUTING {
		type nat hook postrouting priority srcnat; policy accept;
	}
}""".splitlines()


def test_an_nftables_input_chain_that_drops_is_read_with_what_it_accepts():
    chains = Firewall().process(["## nft", *NFT])["chains"]
    assert [c["chain"] for c in chains] == ["inet filter input"] and chains[0]["policy"] == "drop"
    opened = chains[0]["accepted"]
    assert all(any(p in r for r in opened) for p in (22, 5000, 8090, 8000, 8009))
    assert not any(8080 in r for r in opened)
    # A rule it cannot read (a named set) counts as open: only a sure block is reported.
    fuzzy = Firewall().process(["## nft", "table inet f {", "chain input {",
                                "type filter hook input priority 0; policy drop;", "tcp dport @fleet accept", "}", "}"])
    assert fuzzy["chains"][0]["accepted"] == list(ALL)
    # An input chain whose policy accepts (docker's, our mirror's) blocks nothing.
    assert Firewall().process(["## nft", "table ip filter {", "chain INPUT {",
                               "type filter hook input priority filter; policy accept;", "}", "}"])["chains"] == []


def test_iptables_without_nft_is_read_from_its_input_chain():
    chains = Firewall().process(["## iptables", "-P INPUT DROP", "-P FORWARD DROP", "-P OUTPUT ACCEPT",
                                 "-A INPUT -i lo -j ACCEPT", "-A INPUT -p tcp -m tcp --dport 22 -j ACCEPT",
                                 "-A INPUT -p tcp -m multiport --dports 8000,8009 -j ACCEPT"])["chains"]
    assert chains[0]["chain"] == "iptables INPUT"
    assert [p for p in (22, 8000, 8009, 8080) if any(p in r for r in chains[0]["accepted"])] == [22, 8000, 8009]


MISMATCH = ["Failed to initialize NVML: Driver/library version mismatch", "NVML library version: 580.126",
            "kernel_module=580.95.05"]


def test_the_gpu_fact_sees_a_driver_updated_without_a_reboot():
    assert Gpu().process(MISMATCH)["mismatch"] == {"kernel_module": "580.95.05", "library": "580.126"}
    assert Gpu().process(["NVIDIA GB10, 12.1, 580.95.05"]) == {"name": "NVIDIA GB10", "compute_cap": "12.1",
                                                               "driver_version": "580.95.05"}
    assert Gpu().process(["NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."]) is None


# --- the findings -----------------------------------------------------------------------------

SERVE = Listen(8000, "the engine's API", "port", container=True)
AGENT = Listen(8009, "the watchdog's agent-check answer", "watchdog_agent_port", agent_socket=True)
FRONT = Listen(8080, "the fleet endpoint (HAProxy)", "endpoint_port", units=("haproxy.service",),
               reached_from="<clients' subnet>")
HF = Listen(8090, "the mirror's HF mirror (olah)", "mirror_hf_port", units=("sparkfleet-hf-mirror.service",))


def holder(name: str, pid: int, unit: str, container: bool = False) -> dict:
    return {"name": name, "pid": pid, "unit": unit, "container": container}


def test_a_port_held_by_a_process_not_ours_names_it_the_key_and_nvidias_habit():
    problems = preflight.port_problems([SERVE, FRONT], {8080: [holder("open-webui", 77, "open-webui.service")]})
    assert problems == [
        "port 8080, the fleet endpoint (HAProxy), is held by open-webui (pid 77) (NVIDIA's DGX Spark playbooks run "
        "their own services on 8080 and 8090): stop that process, or choose another port with --data endpoint_port=N"]
    problems = preflight.port_problems([SERVE], {8000: [holder("python3", 5, "session-1.scope")]})
    assert problems == ["port 8000, the engine's API, is held by python3 (pid 5): stop that process, or choose "
                        "another port with --data port=N"]


def test_our_own_holders_are_no_problem():
    ours = {8000: [holder("vllm", 9, "docker-ab.scope", container=True)],
            8009: [holder("systemd", 1, "init.scope")],
            8080: [holder("haproxy", 70, "haproxy.service")],
            8090: [holder("olah-cli", 80, "sparkfleet-hf-mirror.service")]}
    assert preflight.port_problems([SERVE, AGENT, FRONT, HF], ours, agent_listens={8009}) == []
    # systemd on the agent's port is ours only while our socket unit listens there: a socket
    # inactive, or moved to another port (a changed watchdog_agent_port), is not.
    assert "8009" in preflight.port_problems([AGENT], ours, agent_listens=set())[0]
    assert "8009" in preflight.port_problems([AGENT], ours, agent_listens={8010})[0]
    # While it listens there, whoever holds the socket got it from systemd: its accept
    # helper, caught in PID 1's init.scope, the socket's or an instance's cgroup (CI caught
    # two of them), whatever systemd names it.
    for unit in ("init.scope", "sparkfleet-agent.socket", "sparkfleet-agent@7-10.0.0.1:8009-10.0.0.9:40000.service"):
        forked = {8009: [holder("(sd-accept)", 9694, unit)]}
        assert preflight.port_problems([AGENT], forked, agent_listens={8009}) == []
        assert preflight.port_problems([AGENT], forked, agent_listens=set())


def test_a_socket_units_ports_are_read_from_systemds_listen_while_it_is_active():
    assert preflight.socket_ports({"ActiveState": "active", "Listen": "[::]:8009 (Stream)"}) == {8009}
    assert preflight.socket_ports({"ActiveState": "active", "Listen": "0.0.0.0:8010 (Stream)"}) == {8010}
    assert preflight.socket_ports({"ActiveState": "inactive", "Listen": "[::]:8009 (Stream)"}) == set()
    assert preflight.socket_ports({}) == set()


def test_a_units_holder_is_ours_only_on_that_units_ports():
    # haproxy is ours on the endpoint's ports, not on the engine's.
    assert preflight.port_problems([SERVE], {8000: [holder("haproxy", 70, "haproxy.service")]})


def test_a_container_started_between_the_snapshots_answers_is_asked_about_again():
    new = "c0ffee" * 10 + "abcd"
    engine = {"name": "vllm", "pid": 9, "unit": f"docker-{new}.scope", "cgroup": f"/system.slice/docker-{new}.scope"}
    asked = []

    def again():
        asked.append("again")
        return {8000: [engine]}, [{"Id": new}]

    # The snapshot read the container before systemd's restart made a new one, the port after.
    holders = preflight.port_holders(lambda: ({8000: [engine]}, []), again)
    assert asked == ["again"] and holders[8000][0]["container"]
    assert preflight.port_problems([SERVE], holders) == []
    # Another container on the port stays another's after the second read.
    other = dict(engine, cgroup="/system.slice/docker-" + "1" * 64 + ".scope")
    held = preflight.port_holders(lambda: ({8000: [other]}, [{"Id": new}]), lambda: ({8000: [other]}, [{"Id": new}]))
    assert "held by vllm (pid 9)" in preflight.port_problems([SERVE], held)[0]
    # A holder that is no container's, or is ours already, costs no second read.
    asked.clear()
    session = {"name": "python3", "pid": 5, "unit": "session-1.scope", "cgroup": "/user.slice/session-1.scope"}
    preflight.port_holders(lambda: ({8000: [session]}, [{"Id": new}]), again)
    preflight.port_holders(lambda: ({8000: [engine]}, [{"Id": new}]), again)
    assert asked == []


def test_two_roles_on_one_port_are_a_problem():
    clash = Listen(8000, "the fleet endpoint (HAProxy)", "endpoint_port", units=("haproxy.service",))
    assert preflight.port_problems([SERVE, clash], {}) == [
        "port 8000 is wanted by the engine's API (port) and by the fleet endpoint (HAProxy) (endpoint_port): give "
        "one another port, e.g. --data endpoint_port=N"]


def test_an_active_ufw_without_a_rule_names_the_ports_and_the_rule_to_add():
    ports = [SERVE, AGENT, FRONT, Listen(8009, "x", "k", reached_from="")]
    problems = preflight.firewall_problems(ports[:3], Firewall().process(UFW_ACTIVE))
    assert problems == [
        "ufw is active (incoming: deny) and allows no connection to port 8009 (the watchdog's agent-check answer), "
        "port 8080 (the fleet endpoint (HAProxy)): the fleet cannot reach them; allow them: "
        "`sudo ufw allow from <fleet subnet> to any port 8009 proto tcp && "
        "sudo ufw allow from <clients' subnet> to any port 8080 proto tcp`"]
    # 8000 has its rule; ufw inactive or allowing incoming blocks nothing; a port only this host uses needs none.
    assert preflight.firewall_problems([SERVE], Firewall().process(UFW_ACTIVE)) == []
    assert preflight.firewall_problems(ports, Firewall().process(["## ufw", "Status: inactive"])) == []
    assert preflight.firewall_problems([ports[3]], Firewall().process(UFW_ACTIVE)) == []


def test_an_input_chain_that_drops_names_the_ports_and_the_rule_to_add():
    problems = preflight.firewall_problems([SERVE, FRONT, HF], Firewall().process(["## nft", *NFT]))
    assert problems == [
        "the firewall (inet filter input, policy drop) has no accept for port 8080 (the fleet endpoint (HAProxy)): "
        "the fleet cannot reach them; add one (and keep it in the firewall's saved rules): "
        "`sudo nft insert rule inet filter input tcp dport { 8080 } accept`"]


def test_a_driver_mismatch_says_reboot():
    assert preflight.driver_mismatch_problem({"kernel_module": "580.95.05", "library": "580.126"}) == (
        "the NVIDIA driver was updated without a reboot (kernel module 580.95.05, library 580.126): nvidia-smi "
        "says \"Failed to initialize NVML: Driver/library version mismatch\" and every new GPU container would "
        "fail: reboot the host (`sudo reboot`), then deploy again")
    assert "(library 580.126)" in preflight.driver_mismatch_problem({"kernel_module": "", "library": "580.126"})


# --- the ports each role serves ----------------------------------------------------------------


def settings_with(monkeypatch, name: str = "spark-1", pair=None, mirror=None, endpoint_name=None, **data):
    from support.fleetdata import fleet

    from sparkfleet.fleet import validate_fleet

    monkeypatch.setattr(preflight, "host", SimpleNamespace(name=name))
    monkeypatch.setattr(preflight, "host_pair", lambda: pair)
    monkeypatch.setattr(preflight, "host_mirror", lambda: mirror)
    monkeypatch.setattr(preflight.endpoint, "endpoint_name", lambda state: endpoint_name)
    return validate_fleet(fleet((name, data)))[name]


def test_each_role_adds_its_ports(monkeypatch):
    from sparkfleet.mirrors import Mirror

    plain = preflight.listens(settings_with(monkeypatch))
    assert [(p.port, p.key, bool(p.reached_from)) for p in plain] == [(8000, "port", True),
                                                                      (8009, "watchdog_agent_port", False)]
    everything = preflight.listens(settings_with(monkeypatch, mirror=Mirror("spark-1", None, 8090, 5000, True),
                                                 endpoint_name="spark-1"))
    assert [p.port for p in everything] == [8000, 8009, 5000, 8090, 8080, 8405]
    assert all(p.reached_from for p in everything)  # the endpoint reaches the agent; clients the rest
    local = preflight.listens(settings_with(monkeypatch, bind_address="127.0.0.1"))
    assert not local[0].reached_from
    head = SimpleNamespace(headless=False, is_head=True, port=29500)
    rank1 = SimpleNamespace(headless=True, is_head=False, port=29500)
    assert [p.port for p in preflight.listens(settings_with(monkeypatch, pair=head))] == [8000, 29500, 8009]
    assert [p.port for p in preflight.listens(settings_with(monkeypatch, pair=rank1))] == [8009]


# --- the whole preflight, on @fake hosts --------------------------------------------------------


def fake_kind(kind: str) -> dict:
    spec = importlib.util.spec_from_file_location("fake_fleet_kinds", FIXTURE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._kinds[kind]


@pytest.mark.parametrize("kind, expected", [
    ("mismatch", "the NVIDIA driver was updated without a reboot (kernel module 580.95.05, library 580.126)"),
    ("busy", "port 8000, the engine's API, is held by open-webui (pid 4242)"),
    ("ufw", "ufw is active (incoming: deny) and allows no connection to port 8000 (the engine's API)"),
])
def test_the_preflight_stops_a_host_with_each_finding(kind, expected):
    with fake_state(["@fake/spark-1"], {"fake_responses": fake_kind(kind), "fleet_mirror": None}) as state:
        with ctx_host.use(state.inventory.get_host("@fake/spark-1")):
            found = preflight.host_findings(fleet_settings())
    assert any(problem.startswith(expected) for problem in found.problems), found.problems
    assert len(found.problems) == 1, found.problems  # nothing else is wrong with that host


# --- never a crash loop: the unit skips a start into a mismatch ---------------------------------


def exec_condition(tmp_path: Path, switches: dict | None) -> subprocess.CompletedProcess:
    from pyinfra.api.util import get_template

    from sparkfleet.testbed import simhw

    text = get_template(str(Path(__file__).resolve().parents[1] / "templates" / "sparkfleet-serve.service.j2")).render(
        container="c", serve_env="/e", secrets_env="/s", hf_home="/hf", runtime_dir="/r", revision_file="/rv",
        started_file="/st", image="i", gpu_flag="--gpus all", rdma_devices=None, model_dir=None)
    line = next(line for line in text.splitlines() if line.startswith("ExecCondition="))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if switches is not None:  # the simulated host's nvidia-smi, with its switches
        (tmp_path / "switches.json").write_text(json.dumps(switches))
        smi = bin_dir / "nvidia-smi"
        smi.write_text(f"#!/bin/sh\nexec {sys.executable} {simhw.HERE / 'nvidia_smi.py'} \"$@\"\n")
        smi.chmod(0o755)
    return subprocess.run(shlex.split(line.split("=", 1)[1]), capture_output=True, text=True, timeout=60,
                          env={"PATH": f"{bin_dir}:/usr/bin:/bin", "SPARKFLEET_SIM_DIR": str(tmp_path)})


def test_the_unit_skips_its_start_on_a_mismatch_with_the_fix_in_the_journal(tmp_path):
    skipped = exec_condition(tmp_path, {"driver_mismatch": True})
    # 1..254: systemd skips the start and does not restart it (Restart= does not apply).
    assert skipped.returncode == 1
    assert "updated without a reboot; reboot the host" in skipped.stderr


@pytest.mark.parametrize("switches", [{}, None], ids=["healthy", "no nvidia-smi"])
def test_the_unit_starts_on_a_healthy_host_or_without_nvidia_smi(tmp_path, switches):
    assert exec_condition(tmp_path, switches).returncode == 0
