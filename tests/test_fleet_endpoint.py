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


def members():
    return [endpoint.Target("spark-01", "spark-01", "10.0.0.11", 8000),
            endpoint.Target("spark 02", haproxy.server_name("spark 02"), "fd00::12", 8001)]


def test_the_config_asks_for_the_key_everywhere_and_checks_with_it():
    s = validate_host_data("spark-01", {**defaults(), "served_model_name": "qwen.v2"})
    text = endpoint.render(s, members(), KEY)
    assert text.count(f'req.hdr(authorization) -m str "Bearer {KEY}"') == 2  # the API and the metrics
    assert text.count("http-request return status 401") == 2
    assert f'http-check send meth GET uri /v1/models ver HTTP/1.1 hdr Host sparkfleet-endpoint hdr Authorization "Bearer {KEY}"' in text
    assert "http-check expect rstring '\"id\": ?\"qwen\\.v2\"'" in text
    assert "    server spark-01 10.0.0.11:8000\n" in text and "    server spark_02 [fd00::12]:8001\n" in text
    assert "balance leastconn" in text and "default-server check inter 1s fall 2 rise 2" in text
    assert "timeout server 14400s" in text and "timeout client 14400s" in text and "hard-stop-after 14400s" in text
    assert endpoint.MARKER in text.splitlines()[0]


def test_without_a_key_nothing_asks_for_one():
    s = validate_host_data("spark-01", {**defaults(), "api_key": "none"})
    text = endpoint.render(s, members(), None)
    assert "Authorization" not in text and "status 401" not in text and "Bearer" not in text


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
        "kv_cache": 0.25, "acceptance_length": 4.5,
    }
    down = status.parse_host("== unit\nActiveState=failed\n== models\n\n== metrics\n".splitlines(), s)
    assert down["ready"] is False and down["uptime_s"] is None and down["acceptance_length"] is None
    table = status.table({"hosts": [{"host": "spark-01", "reachable": True, "endpoint": "DRAIN", **row},
                                    {"host": "spark-02", "reachable": False}], "endpoint": None})
    assert re.search(r"^spark-01\s+dflash\s+sha256:abc123\s+main@0123456789\s+active\s+1h05m\s+yes\s+DRAIN"
                     r"\s+2\s+1\s+25%\s+4\.50$", table, re.M), table
    assert re.search(r"^spark-02\s+unreachable", table, re.M) and "fleet endpoint: none" in table
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
