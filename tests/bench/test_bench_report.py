"""The fleet report rebuilt from saved results: table, CSV, JSON, PNG, flags, failures."""

from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path

import pytest

from sparkfleet.bench import report
from sparkfleet.bench.results import failed_result, load_run, result_path, write_json


def _workload(tok_s: float, ttft_ms: float, acc: float) -> dict:
    return {
        "status": "ok",
        "decode_tok_s": {"n": 3, "median": tok_s, "mean": tok_s, "min": tok_s, "max": tok_s},
        "ttft_ms": {"n": 3, "median": ttft_ms, "mean": ttft_ms, "min": ttft_ms, "max": ttft_ms},
        "acceptance": {"mean_length": acc, "drafts": 10, "accepted": 10 * (acc - 1)},
    }


def _host(name: str, prose: float, code: float, e2e: float, agent: float) -> dict:
    return {
        "schema": "sparkfleet.bench/1", "host": name, "run_id": "run-1", "status": "ok", "reason": None,
        "checks": {
            "smoke": {"status": "ok", "passed": True, "answer": " Paris."},
            "tools": {"status": "ok", "passed": True, "function": "get_weather", "arguments": {"city": "Paris"}},
            "decode": {"status": "ok", "workloads": {
                "prose": _workload(prose, 410.0, 2.3), "code": _workload(code, 420.0, 5.4)}},
            "e2e": {"status": "ok", "tok_s": e2e, "prompts": {}, "acceptance": {"mean_length": 6.5}},
            "agent": {"status": "ok", "decode_tok_s": {"median": agent}, "ttft_ms": {"median": 900.0},
                      "acceptance": {"mean_length": 8.3}},
        },
    }


@pytest.fixture
def run(tmp_path) -> Path:
    d = tmp_path / "results" / "run-1"
    write_json(result_path(d, "spark-1"), _host("spark-1", 33.2, 54.5, 53.7, 81.0))
    write_json(result_path(d, "spark-2"), _host("spark-2", 33.0, 54.0, 53.5, 80.0))
    # 15% below the others on code: flagged; 5% below on e2e: not flagged
    third = _host("spark-3", 33.1, 46.0, 50.9, 80.5)
    third["checks"]["tools"] = {"status": "failed", "passed": False,
                                "reason": "the server has no tool-call parser, so it cannot return tool calls"}
    write_json(result_path(d, "spark-3"), third)
    wrong = _host("spark-4", 0, 0, 0, 0)
    wrong.update(status="failed", reason="smoke: answer does not contain Paris: 'London'")
    wrong["checks"] = {"smoke": {"status": "failed", "passed": False, "answer": " London",
                                 "reason": "answer does not contain Paris: 'London'"},
                       "decode": {"status": "skipped", "reason": "smoke check failed"}}
    write_json(result_path(d, "spark-4"), wrong)
    write_json(result_path(d, "spark-5"), failed_result("spark-5", "run-1", "unreachable: pyinfra could not connect"))
    return d


def test_report_table_shows_every_host_workload_flag_and_failure(run, capsys):
    assert report.main([str(run)]) == 0
    table = capsys.readouterr().out
    for host in ("spark-1", "spark-2", "spark-3", "spark-4", "spark-5"):
        assert host in table
    for title in ("decode/prose", "decode/code", "e2e (albond)", "agent (Hermes)"):
        assert title in table
    # spark-3 code: 46.0 vs median 54.0 -> -14.8% flagged; its e2e -4.9% is not
    code_line = next(line for line in table.splitlines() if "spark-3" in line and "46.00" in line)
    assert "FLAG" in code_line and "-14.8%" in code_line
    e2e_line = next(line for line in table.splitlines() if "spark-3" in line and "50.90" in line)
    assert "FLAG" not in e2e_line
    # failed hosts appear as failed, with the reason and the answer they gave
    assert "spark-4  FAILED  smoke: answer does not contain Paris: 'London'" in table
    assert "spark-5  FAILED  unreachable" in table
    assert re.search(r"spark-4 +FAIL +answer ' London'", table)
    assert "spark-1  PASS" in table
    assert "51.58" in table and "81" in table
    # the tools check beside smoke: pass with the call, fail with the reason
    assert re.search(r"spark-1 +PASS +get_weather\(\{'city': 'Paris'\}\) -> answered", table)
    assert re.search(r"spark-3 +FAIL +the server has no tool-call parser", table)
    # every workload row shows the published numbers it compares with
    assert "published" in table and "dflash code 54.5" in table and "dense e2e 59" in table


def test_report_files_csv_json_png(run):
    rep = report.write_and_print(run, stream=io.StringIO())
    files = {p.name for p in run.iterdir()}
    assert {"fleet-report.txt", "fleet-report.csv", "fleet-report.json", "fleet-report.png"} <= files
    assert (run / "fleet-report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run / "fleet-report.png").stat().st_size > 10_000

    rows = list(csv.DictReader((run / "fleet-report.csv").open()))
    by = {(r["host"], r["workload"]): r for r in rows}
    assert float(by[("spark-1", "decode/prose")]["tok_s"]) == pytest.approx(33.2)
    assert float(by[("spark-1", "decode/prose")]["ttft_ms"]) == pytest.approx(410.0)
    assert float(by[("spark-1", "agent")]["acceptance"]) == pytest.approx(8.3)
    assert by[("spark-3", "decode/code")]["flagged"] == "True"
    assert by[("spark-5", "")]["host_status"] == "failed"
    assert "unreachable" in by[("spark-5", "")]["reason"]

    data = json.loads((run / "fleet-report.json").read_text())
    assert data["run_id"] == "run-1"
    assert sorted(data["failed"]) == ["spark-4", "spark-5"]
    assert data["flagged"] == [{"host": "spark-3", "workload": "decode/code", "tok_s": 46.0,
                                "median": 54.0, "vs_median": pytest.approx(46 / 54 - 1)}]
    assert data["workloads"]["e2e"]["median_tok_s"] == pytest.approx(53.5)
    assert {r["tok_s"] for r in data["references"]} >= {28.2, 51.58, 33.2, 54.5, 124.5, 53.7, 59.0, 81.0}
    assert rep.medians["decode/code"] == pytest.approx(54.0)


def test_report_files_are_not_read_back_as_hosts(run):
    report.write_and_print(run, stream=io.StringIO())
    assert sorted(load_run(run)) == ["spark-1", "spark-2", "spark-3", "spark-4", "spark-5"]


def test_flag_threshold_is_ten_percent_below_the_median(tmp_path):
    d = tmp_path / "r"
    # median 100: 90.5 is 9.5% below (kept), 89.5 is 10.5% below (flagged)
    for name, code in (("a", 100.0), ("b", 100.0), ("e", 100.0), ("c", 90.5), ("d", 89.5)):
        write_json(result_path(d, name), _host(name, 10, code, 10, 10))
    rep = report.build(d)
    flagged = {(h, w) for h, w, _ in rep.flagged}
    assert flagged == {("d", "decode/code")}


def test_strict_and_empty(run, tmp_path, capsys):
    assert report.main([str(run), "--strict", "--no-plot"]) == 1
    assert not (run / "fleet-report.png").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert report.main([str(empty)]) == 2
    assert "no host results" in capsys.readouterr().err


def test_a_fleet_where_every_host_failed_still_reports(tmp_path, capsys):
    d = tmp_path / "r"
    write_json(result_path(d, "x"), failed_result("x", "r", "bench did not run: no sparkfleet-serve container"))
    assert report.main([str(d)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"x +FAILED +bench did not run", out)
    assert (d / "fleet-report.png").exists()
