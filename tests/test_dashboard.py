"""dashboards/sparkfleet.json, for the operator's Grafana, and the alert rules name only
metrics that exist: the engine's (vLLM's names, as the simulated engine renders them), the
node exporter's and HAProxy's (the metric families of the versions the hosts install,
tests/fixtures/metrics/), and Prometheus' own (``up``, ``ALERTS``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.fleetdata import defaults

from sparkfleet import monitor
from sparkfleet.config import validate_host_data
from sparkfleet.testbed.engine.metrics import Metrics

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "dashboards" / "sparkfleet.json"
FIXTURES = ROOT / "tests" / "fixtures" / "metrics"

#: PromQL's own words: functions are told apart by their "(", these by name.
KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
            "inf", "nan"}
PROMETHEUS_OWN = {"up", "ALERTS", "ALERTS_FOR_STATE", "scrape_duration_seconds", "scrape_samples_scraped"}
SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count", ""), "counter": ("",),
            "gauge": ("",), "untyped": ("",)}


def exporter_metrics(name: str) -> set[str]:
    names = set()
    for line in (FIXTURES / name).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            family, kind = line.split()
            names.update(family + suffix for suffix in SUFFIXES[kind])
    return names


def engine_metrics() -> set[str]:
    engine = Metrics("qwen", num_spec_tokens=12)  # a speculative profile: every family there is
    engine.decode_step(3)
    return {sample.name for family in text_string_to_metric_families(engine.render()) for sample in family.samples}


KNOWN = (engine_metrics() | exporter_metrics("node-exporter-1.5.0.types") | exporter_metrics("haproxy-2.6.12.types")
         | PROMETHEUS_OWN)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (Grafana's $variables removed)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings (label values, regexes)
    text = re.sub(r"\$\w+", "1", text)  # Grafana's variables ($__rate_interval, $host)
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)  # label lists
    found = set()
    for match in re.finditer(r"(?<![\w.])([A-Za-z_:][\w:]*)(\s*\()?", text):
        word, call = match.group(1), match.group(2)
        if not call and word.lower() not in KEYWORDS:
            found.add(word)
    return found


def test_the_parser_finds_the_metrics_and_nothing_else():
    expr = ('histogram_quantile(0.95, sum by (host, le) (rate(vllm:e2e_request_latency_seconds_bucket{host=~"$host"}'
            '[$__rate_interval]))) / on (host) group_left up{job="x"} > bool 1e3')
    assert metric_names(expr) == {"vllm:e2e_request_latency_seconds_bucket", "up"}
    assert not metric_names("rate(vllm:generation_token_total[5m])") <= KNOWN  # a typo is seen


def panels() -> list[dict]:
    out = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        out += panel.get("panels", []) + [panel]  # rows hold panels
    return [p for p in out if p.get("targets")]


def test_the_dashboard_loads_and_every_panel_has_a_query():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] == "sparkfleet" and dashboard["__inputs"][0]["pluginId"] == "prometheus"
    found = panels()
    assert len(found) >= 10 and all(t.get("expr") for p in found for t in p["targets"])
    assert len({p["id"] for p in found}) == len(found)


@pytest.mark.parametrize("panel", panels(), ids=lambda p: p["title"])
def test_every_panel_names_only_metrics_that_exist(panel):
    for target in panel["targets"]:
        names = metric_names(target["expr"])
        assert names and names <= KNOWN, f"{panel['title']}: {sorted(names - KNOWN)} exist nowhere"


def test_the_dashboard_shows_each_source():
    exprs = " ".join(t["expr"] for p in panels() for t in p["targets"])
    assert "vllm:" in exprs and "node_" in exprs and "haproxy_" in exprs and "ALERTS" in exprs


def test_every_alert_rule_names_only_metrics_that_exist():
    rules = monitor.render_rules(validate_host_data("spark-1", defaults()))
    exprs = re.findall(r"expr: (?:>-\n((?:          .*\n)+)|(.*)\n)", rules)
    assert len(exprs) == 8
    for folded, line in exprs:
        names = metric_names(folded or line)
        assert names and names <= KNOWN, f"{sorted(names - KNOWN)} exist nowhere: {folded or line}"
