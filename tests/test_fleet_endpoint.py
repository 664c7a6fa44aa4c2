"""The fleet endpoint without a fleet: which host serves it, the HAProxy configuration it
renders (tests/e2e/test_endpoint.py runs it), and the status table built from what hosts
print."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support.fleetdata import defaults, fleet

from sparkfleet import endpoint, haproxy, status
from sparkfleet.config import ConfigError, validate_host_data
from sparkfleet.fleet import chosen_endpoint, validate_fleet

ROOT = Path(__file__).resolve().parents[1]
KEY = "sf-0123456789abcdef_XYZ"


def chosen(hosts):
    return chosen_endpoint(hosts, validate_fleet(hosts))[0]


def test_auto_is_the_endpoint_group_else_none():
    assert chosen(fleet(("spark-1", {}), ("spark-2", {}))) is None
    assert chosen(fleet(("spark-1", {}), ("spark-2", {}), groups={"endpoint": ["spark-2"]})) == "spark-2"
    named = fleet(*[(n, {"fleet_endpoint": "spark-1"}) for n in ("spark-1", "spark-2")])
    assert chosen(named) == "spark-1"
    off = fleet(("spark-1", {"fleet_endpoint": "none"}), ("spark-2", {"fleet_endpoint": "off"}),
                groups={"endpoint": ["spark-1"]})
    assert chosen(off) is None


def test_an_unknown_or_disputed_endpoint_is_refused_before_anything_runs():
    with pytest.raises(ConfigError, match=r"spark-2: `fleet_endpoint` = 'spark-9' is not a host of the inventory"):
        validate_fleet(fleet(("spark-1", {}), ("spark-2", {"fleet_endpoint": "spark-9"})))
    with pytest.raises(ConfigError, match=r"different fleet endpoints \(spark-1: spark-1, spark-2: none\).*same fleet_endpoint"):
        validate_fleet(fleet(("spark-1", {"fleet_endpoint": "spark-1"}), ("spark-2", {"fleet_endpoint": "none"})))
    with pytest.raises(ConfigError, match=r"`endpoint_timeout_s` = 5"):
        validate_host_data("spark-1", {**defaults(), "endpoint_timeout_s": 5})


def members(key=KEY, model="qwen.v2"):
    return [endpoint.Target("spark-01", "spark-01", "10.0.0.11", 8000, model, key),
            endpoint.Target("spark 02", haproxy.server_name("spark 02"), "fd00::12", 8001, model, key)]


def test_the_config_asks_for_the_key_everywhere_and_checks_with_it():
    s = validate_host_data("spark-01", {**defaults(), "served_model_name": "qwen.v2"})
    text = endpoint.render(s, members(), KEY)
    assert text.count(f'req.hdr(authorization) -m str "Bearer {KEY}"') == 2  # the API and the metrics
    assert text.count("http-request return status 401") == 2
    assert f'http-check send meth GET uri /v1/models ver HTTP/1.1 hdr Host sparkfleet-endpoint hdr Authorization "Bearer {KEY}"' in text
    assert "http-check expect rstring '\"id\": ?\"(qwen\\.v2)\"'" in text
    assert "    server spark-01 10.0.0.11:8000  # serves qwen.v2\n" in text
    assert "    server spark_02 [fd00::12]:8001  # serves qwen.v2\n" in text
    assert text.count("\nbackend ") == 1
    assert "balance leastconn" in text and "default-server check inter 1s fall 2 rise 2" in text
    assert "timeout server 14400s" in text and "timeout client 14400s" in text and "hard-stop-after 14400s" in text
    assert endpoint.MARKER in text.splitlines()[0]


def test_without_a_key_nothing_asks_for_one():
    s = validate_host_data("spark-01", {**defaults(), "api_key": "none"})
    text = endpoint.render(s, members(key=None), None)
    assert "Authorization" not in text and "status 401" not in text and "Bearer" not in text
    assert "backend members\n" in text


def test_a_key_change_in_flight_routes_each_key_to_the_members_that_run_it():
    """Mid-rotation: spark-01 runs the new key, spark 02 the old one. Each key's clients
    reach the members that accept it, each backend checks with its own key: nobody is
    taken out of rotation for the key they do not run yet."""
    s = validate_host_data("spark-01", {**defaults(), "served_model_name": "qwen.v2"})
    old, new = "OLDkey-0123456789abcdef0123456789", KEY
    mixed = [members(new)[0], members(old)[1]]
    text = endpoint.render(s, mixed, new)
    new_be, old_be = endpoint.backend_of(new), endpoint.backend_of(old)
    assert text.count("\nbackend ") == 2
    assert f"use_backend {new_be} if key_{endpoint.key_id(new)}" in text
    assert f"use_backend {old_be} if key_{endpoint.key_id(old)}" in text
    assert f"default_backend {new_be}" in text  # the fleet's own key first
    assert f"unless key_{endpoint.key_id(new)} || key_{endpoint.key_id(old)}" in text
    sections = {part.split("\n", 1)[0]: part for part in re.split(r"\n(?=backend |frontend )", text)}
    new_part, old_part = sections[f"backend {new_be}"], sections[f"backend {old_be}"]
    assert f'"Bearer {new}"' in new_part and "server spark-01 " in new_part and old not in new_part
    assert f'"Bearer {old}"' in old_part and "server spark_02 " in old_part and new not in old_part
    # The metrics answer the fleet's key only.
    assert text.split("frontend metrics")[1].count("Bearer") == 1 and new in text.split("frontend metrics")[1]


def test_what_a_configuration_says_its_members_run_reads_back():
    s = validate_host_data("spark-01", {**defaults(), "served_model_name": "qwen.v2"})
    mixed = [members()[0], endpoint.Target("spark 02", "spark_02", "fd00::12", 9001, "renamed", "OLD-key-0123456789")]
    found = endpoint.running_members(endpoint.render(s, mixed, KEY), {"spark_02": "spark 02"})
    assert found == {m.server: m for m in mixed}
    assert "OLD-key" not in repr(found)  # a Target never shows its key


def test_a_moved_members_saved_state_is_left_out_of_the_next_reload():
    """HAProxy restores a saved member's address and port over the new configuration's:
    a member that moved (port, address, key) must start from its checks instead."""
    import subprocess

    command = haproxy.save_state_command(("spark 02",))
    program = re.search(r"awk '([^']*)'", command).group(1)
    state = ("1\n# be_id be_name srv_id srv_name srv_addr\n"
             "3 members 1 spark-01 10.0.0.11 2 0 1 1\n3 members 2 spark_02 fd00::12 2 1 1 1\n")
    kept = subprocess.run(["awk", program], input=state, capture_output=True, text=True, check=True).stdout
    assert kept.splitlines() == state.splitlines()[:3]
    assert "awk" not in haproxy.save_state_command()


HOST_OUTPUT = """== unit
ActiveState=active
SubState=running
ActiveEnterTimestampMonotonic=100000000
NRestarts=1
== uptime
4000.25
== env
SF_PROFILE=dflash
SF_MODEL=Intel/Qwen3.5-122B-A10B-int4-AutoRound
SF_REVISION=main
== image
ghcr.io/aeon-7/aeon-vllm-ultimate@sha256:abc123
== models
{"object": "list", "data": [{"id": "qwen", "object": "model"}]}
== metrics
vllm:num_requests_running{engine="0",model_name="qwen"} 2.0
vllm:num_requests_waiting{engine="0",model_name="qwen"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="qwen"} 0.25
vllm:spec_decode_num_drafts_total{engine="0",model_name="qwen"} 100.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="qwen"} 350.0
== refs
/var/lib/sparkfleet/hf/hub/models--Intel--Qwen3.5-122B-A10B-int4-AutoRound/refs/main 0123456789abcdef0123456789abcdef01234567
/var/lib/sparkfleet/hf/hub/models--z-lab--Qwen3.5-122B-A10B-DFlash/refs/main fedcba9876543210fedcba9876543210fedcba98
"""


def test_a_host_row_from_what_it_printed():
    s = validate_host_data("spark-01", {**defaults(), "profile": "dflash"})
    row = status.parse_host(HOST_OUTPUT.splitlines(), s)
    assert row == {
        "unit": "active", "restarts": 1, "uptime_s": 3900, "profile": "dflash", "image_digest": "sha256:abc123",
        "model": "Intel/Qwen3.5-122B-A10B-int4-AutoRound", "revision": "main",
        "commit": "0123456789abcdef0123456789abcdef01234567", "ready": True, "running": 2, "waiting": 1,
        "kv_cache": 0.25, "acceptance_length": 4.5, "pending": None, "operator_lock": None, "link": None,
        "agent": None, "watchdog": None, "stack": {}, "stack_drift": [], "kernel": "", "kernel_pinned": False,
        "rebooted": None,
    }
    down = status.parse_host("== unit\nActiveState=failed\n== models\n\n== metrics\n".splitlines(), s)
    assert down["ready"] is False and down["uptime_s"] is None and down["acceptance_length"] is None
    table = status.table({"hosts": [{"host": "spark-01", "reachable": True, "endpoint": "DRAIN", **row},
                                    {"host": "spark-02", "reachable": False}], "endpoint": None})
    assert re.search(r"^spark-01\s+dflash\s+sha256:abc123\s+main@0123456789\s+active\s+1h05m\s+yes\s+DRAIN"
                     r"\s+2\s+1\s+25%\s+4\.50$", table, re.M), table
    assert re.search(r"^spark-02\s+unreachable", table, re.M) and "fleet endpoint: none" in table
    # What runs, not what is on disk: a rollout that stopped left dense files under a dflash engine.
    behind = status.parse_host((HOST_OUTPUT + "== on disk\nSF_PROFILE=dense\n").splitlines(), s)
    assert (behind["profile"], behind["pending"]) == ("dflash", "dense")
    # A deploy in progress (or one that died holding the lock) is named, with the way out.
    held = status.parse_host((HOST_OUTPUT + '== lock\n{"run": "1a2b3c", "user": "ana", "controller": "laptop-2", '
                              '"pid": 4242, "since": 1764675000}\n').splitlines(), s)
    shown = status.table({"hosts": [{"host": "spark-01", "reachable": True, **held}], "endpoint": None})
    assert re.search(r"deploy lock on spark-01: held by ana@laptop-2 \(pyinfra pid 4242, run 1a2b3c\) since .*"
                     r"sparkfleet unlock", shown), shown
    assert "deploy lock" not in status.table({"hosts": [{"host": "spark-01", "reachable": True, **row}],
                                              "endpoint": None})
    # A pair's head shows the link's last measurement: transport and bandwidth.
    measured = status.parse_host((HOST_OUTPUT + '== link\n{"ok": true, "pair": "pair_1", "rank": 0, '
                                  '"transport": "IB", "busbw_gbs": 23.0, "floor_gbs": 21.875, '
                                  '"checked_at": "2026-12-02T12:40:01+00:00"}\n').splitlines(), s)
    assert "pair_1: link RoCE 23.0 GB/s (floor 21.875), measured 2026-12-02T12:40:01+00:00" in status.table(
        {"hosts": [{"host": "spark-01", "reachable": True, **measured}], "endpoint": None})
    assert "dflash (on disk: dense)" in status.table({"hosts": [{"host": "spark-01", "reachable": True, **behind}],
                                                      "endpoint": None})
    # A pair: its column, the head's READY for the headless member.
    paired = status.table({"hosts": [{"host": "spark-01", "reachable": True, "pair": "pair_a rank 0", **row},
                                     {"host": "spark-02", "reachable": True, "pair": "pair_a rank 1",
                                      **{**row, "endpoint": "via spark-01"}}], "endpoint": None})
    assert re.search(r"^spark-01\s+pair_a rank 0\s+dflash", paired, re.M), paired
    assert re.search(r"^spark-02\s+pair_a rank 1\s+dflash.*via spark-01", paired, re.M), paired


def test_an_unreachable_endpoint_host_is_an_operation_error_not_a_traceback():
    # A rolling change with the endpoint's host down: the drain asks its runtime API.
    from types import SimpleNamespace

    from pyinfra.api.exceptions import OperationError


    down = SimpleNamespace(name="spark-1.local", connected=False)
    with pytest.raises(OperationError, match="spark-1.local: the fleet endpoint's host is not reachable"):
        haproxy.members_of(down)


def test_the_url_of_an_unreachable_host_is_its_name():
    from types import SimpleNamespace

    from sparkfleet.fleet import reached_at

    down = SimpleNamespace(name="spark-9.local", connected=False, data=SimpleNamespace(get=lambda key: None))
    assert reached_at(down) == "spark-9.local"


def test_a_member_serving_another_name_is_checked_out_unless_that_name_still_rolls():
    s = validate_host_data("spark-01", {**defaults(), "served_model_name": "qwen"})
    mixed = [members(model="qwen")[0], members(model="old-name")[1]]
    assert "rstring '\"id\": ?\"(qwen)\"'" in endpoint.render(s, mixed, KEY)  # old-name stays out
    rolling = endpoint.render(s, mixed, KEY, frozenset({"old-name", "qwen"}))
    assert "rstring '\"id\": ?\"(old\\-name|qwen)\"'" in rolling, rolling


def test_an_agent_checked_members_state_reads_as_without_the_agent():
    """HAProxy suffixes " (agent)" to every DRAIN and DOWN of a server with an agent-check
    (the watchdog's): the rollout and status read the state itself."""
    stat = [{"pxname": haproxy.BACKEND, "svname": name, "status": status, "addr": "10.0.0.1:8000"}
            for name, status in (("a", "DRAIN (agent)"), ("b", "DOWN (agent)"), ("c", "UP"))]
    states = {name: m.state for name, m in haproxy.members_of(None, stat).items()}
    assert states == {"a": "DRAIN", "b": "DOWN", "c": "UP"}
    assert haproxy.members_of(None, stat)["c"].in_rotation


def test_a_batch_draining_at_once_never_opens_more_runtime_channels_than_it_may(monkeypatch):
    """Sixteen hosts polling the endpoint together (rollout_batch=16) share its host's one
    SSH connection, whose sshd refuses an eleventh channel (MaxSessions 10): the runtime
    API is asked at most haproxy.AT_ONCE at a time."""
    import gevent
    from support.fleetdata import fake_state

    from sparkfleet import remote

    open_now, most = [0], [0]

    def answering(target, command, **kwargs):
        open_now[0] += 1
        most[0] = max(most[0], open_now[0])
        gevent.sleep(0.01)
        open_now[0] -= 1
        return remote.Result(True, ["# pxname,svname,status", "members,spark-2,UP"], [])

    monkeypatch.setattr(remote, "run", answering)
    with fake_state(["@fake/spark-1"]) as state:
        ep = state.inventory.get_host("@fake/spark-1")
        gevent.joinall([gevent.spawn(haproxy.show_stat, ep) for _ in range(16)], raise_error=True)
    assert most[0] == haproxy.AT_ONCE
