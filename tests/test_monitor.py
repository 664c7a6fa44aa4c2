"""The fleet monitor without a fleet: which host runs Prometheus, the configuration and the
alert rules it renders, checked by the package's own promtool (the deploy checks them on the
host the same way; tests/e2e/test_endpoint_monitor.py runs them)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.fleetdata import defaults, fleet

from sparkfleet import monitor
from sparkfleet.config import ConfigError, validate_host_data
from sparkfleet.fleet import chosen_monitor, validate_fleet

#: Prometheus' own checker, as the monitor host runs it; `make deps` puts it in the venv.
PROMTOOL = shutil.which("promtool", path=os.pathsep.join([str(Path(sys.prefix) / "bin"), os.environ.get("PATH", "")]))


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    assert PROMTOOL, "promtool is missing: `make deps` takes it from Debian's prometheus package"
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def chosen(hosts):
    return chosen_monitor(hosts, validate_fleet(hosts))[0]


def settings(**data):
    return validate_host_data("spark-1", {**defaults(), **data})


def test_auto_is_the_monitor_group_else_the_endpoint_host_else_none():
    assert chosen(fleet(("spark-1", {}), ("spark-2", {}))) is None
    assert chosen(fleet(("spark-1", {}), ("spark-2", {}), groups={"endpoint": ["spark-2"]})) == "spark-2"
    assert chosen(fleet(("spark-1", {}), ("spark-2", {}), groups={"endpoint": ["spark-2"], "monitor": ["spark-1"]})) \
        == "spark-1"
    assert chosen(fleet(*[(n, {"fleet_monitor": "spark-2"}) for n in ("spark-1", "spark-2")])) == "spark-2"
    off = fleet(*[(n, {"fleet_monitor": "none"}) for n in ("spark-1", "spark-2")], groups={"endpoint": ["spark-1"]})
    assert chosen(off) is None


def test_an_unknown_or_disputed_monitor_is_refused_before_anything_runs():
    with pytest.raises(ConfigError, match=r"spark-2: `fleet_monitor` = 'spark-9' is not a host of the inventory"):
        validate_fleet(fleet(("spark-1", {}), ("spark-2", {"fleet_monitor": "spark-9"})))
    with pytest.raises(ConfigError, match=r"different fleet monitors \(spark-1: spark-1, spark-2: none\)"):
        validate_fleet(fleet(("spark-1", {"fleet_monitor": "spark-1"}), ("spark-2", {"fleet_monitor": "none"})))
    with pytest.raises(ConfigError, match=r"`monitor_bind_address` = 'everywhere'"):
        settings(monitor_bind_address="everywhere")


JOBS = [
    monitor.Job("engine", "engines", True, (monitor.Target("spark-1", "10.0.0.11:8000"),
                                            monitor.Target("spark-2", "10.0.0.12:8000"))),
    monitor.Job("haproxy", "endpoint", True, (monitor.Target("spark-1", "10.0.0.11:8405"),)),
    monitor.Job("node", "nodes", False, (monitor.Target("spark-1", "10.0.0.11:9100"),
                                         monitor.Target("spark-2", "[fd00::12]:9100"))),
]


def test_an_unreachable_host_keeps_the_address_the_running_configuration_has():
    """The node job's targets, read back from what was rendered: a host that cannot be
    asked this run keeps its address, so the configuration does not change."""
    text = monitor.render_config(settings(), JOBS)
    assert monitor.current_addresses(text) == {"spark-1": "10.0.0.11", "spark-2": "fd00::12"}
    assert monitor.current_addresses("") == {}


def test_the_exporter_s_address_is_read_back_from_its_defaults_file():
    """With the monitor host unreachable, a node exporter keeps listening where it does."""
    for address in ("10.0.0.12", "fd00::12"):
        found = monitor.LISTENING.search(monitor.node_exporter_args(address, 9100))
        assert found and found["address"] == address


def test_the_configuration_names_every_target_by_host_and_holds_no_key():
    text = monitor.render_config(settings(), JOBS)
    assert text.count("job_name:") == 3 and text.count("credentials_file: /etc/prometheus/sparkfleet-api-key") == 2
    assert 'targets: ["[fd00::12]:9100"]' in text and 'labels: {host: "spark-2"}' in text
    assert "scrape_interval: 15s" in text and "scrape_timeout: 10s" in text
    fast = monitor.render_config(settings(monitor_scrape_interval_s=2), JOBS)
    assert "scrape_timeout: 2s" in fast  # never longer than the interval: Prometheus refuses that
    # A job without targets (no endpoint) is left out rather than rendered empty.
    assert "haproxy" not in monitor.render_config(settings(), [JOBS[0], monitor.Job("haproxy", "-", True, ())])


def test_where_prometheus_and_the_node_exporter_listen():
    assert 'ARGS="--web.listen-address=127.0.0.1:9090"' in monitor.prometheus_args(settings())
    assert 'ARGS="--web.listen-address=10.0.0.12:9100"' in monitor.node_exporter_args("10.0.0.12", 9100)
    assert "[fd00::12]:9100" in monitor.node_exporter_args("fd00::12", 9100)




def test_promtool_accepts_the_configuration_and_the_rules(tmp_path: Path):
    (tmp_path / "key").write_text("sf-test-key\n")
    (tmp_path / "rules.yml").write_text(monitor.render_rules(settings()))
    (tmp_path / "prometheus.yml").write_text(monitor.render_config(
        settings(), JOBS, key_file=str(tmp_path / "key"), rules_file=str(tmp_path / "rules.yml")))
    rules = promtool("check", "rules", "rules.yml", cwd=tmp_path)
    assert rules.returncode == 0 and "SUCCESS: 8 rules found" in rules.stdout, rules.stdout + rules.stderr
    config = promtool("check", "config", "prometheus.yml", cwd=tmp_path)
    assert config.returncode == 0, config.stdout + config.stderr


#: Synthetic series, 15 s apart, and when each alert must (not yet, then) fire: spark-1 is
#: healthy throughout, spark-2 has each fault from the first sample on.
RULE_TESTS = """
rule_files: [rules.yml]
evaluation_interval: 15s
tests:
  - interval: 15s
    input_series:
      - series: 'up{job="engine",host="spark-1"}'
        values: '1x40'
      - series: 'up{job="engine",host="spark-2"}'
        values: '0x40'
      - series: 'vllm:num_requests_running{host="spark-1"}'
        values: '2x40'
      - series: 'vllm:num_requests_running{host="spark-2"}'
        values: '2x40'
      - series: 'vllm:num_requests_waiting{host="spark-1"}'
        values: '0x40'
      - series: 'vllm:num_requests_waiting{host="spark-2"}'
        values: '1x40'
      - series: 'vllm:generation_tokens_total{host="spark-1"}'
        values: '0+500x40'
      - series: 'vllm:generation_tokens_total{host="spark-2"}'
        values: '700x40'
      - series: 'vllm:prompt_tokens_total{host="spark-1"}'
        values: '0+100x40'
      - series: 'vllm:prompt_tokens_total{host="spark-2"}'
        values: '300x40'
      - series: 'vllm:spec_decode_num_drafts_total{host="spark-1"}'
        values: '0+10x40'
      - series: 'vllm:spec_decode_num_drafts_total{host="spark-2"}'
        values: '0+10x40'
      - series: 'vllm:spec_decode_num_accepted_tokens_total{host="spark-1"}'
        values: '0+70x40'
      - series: 'vllm:spec_decode_num_accepted_tokens_total{host="spark-2"}'
        values: '0+2x40'
      - series: 'node_memory_MemAvailable_bytes{host="spark-1"}'
        values: '23622320128x40'
      - series: 'node_memory_MemAvailable_bytes{host="spark-2"}'
        values: '6442450944x40'
      - series: 'haproxy_server_status{host="spark-1",proxy="members",server="spark-2",state="DOWN"}'
        values: '1x40'
      - series: 'haproxy_server_status{host="spark-1",proxy="members",server="spark-1",state="DOWN"}'
        values: '0x40'
    alert_rule_test:
      - eval_time: 1m
        alertname: SparkfleetEngineDown
        exp_alerts: []
      - eval_time: 3m
        alertname: SparkfleetEngineDown
        exp_alerts:
          - exp_labels: {severity: critical, job: engine, host: spark-2}
            exp_annotations:
              summary: "spark-2: the engine does not answer /metrics (stopped, dead or hung)"
      - eval_time: 3m
        alertname: SparkfleetNoProgress
        exp_alerts:
          - exp_labels: {severity: critical, host: spark-2}
            exp_annotations:
              summary: "spark-2: requests running or waiting, no token for 300 s"
      - eval_time: 3m
        alertname: SparkfleetAcceptanceLow
        exp_alerts:
          - exp_labels: {severity: warning, host: spark-2}
            exp_annotations:
              summary: "spark-2: acceptance length 1.20 below its floor 1.5 (the drafter costs more than it gives)"
      - eval_time: 3m
        alertname: SparkfleetMemoryLow
        exp_alerts:
          - exp_labels: {severity: warning, host: spark-2}
            exp_annotations:
              summary: "spark-2: 6GiB available (alert under 12 GiB; the watchdog stops the engine under 8 GiB)"
      - eval_time: 3m
        alertname: SparkfleetMemberOutOfRotation
        exp_alerts:
          - exp_labels: {severity: critical, host: spark-1, proxy: members, server: spark-2, state: DOWN}
            exp_annotations:
              summary: "the fleet endpoint on spark-1 took spark-2 out of rotation"
"""


def test_each_alert_fires_on_its_fault_after_its_time_and_not_on_a_healthy_host(tmp_path: Path):
    (tmp_path / "rules.yml").write_text(monitor.render_rules(settings()))
    (tmp_path / "tests.yml").write_text(RULE_TESTS)
    ran = promtool("test", "rules", "tests.yml", cwd=tmp_path)
    assert ran.returncode == 0, ran.stdout + ran.stderr
