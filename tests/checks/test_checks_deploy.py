"""checks/ through pyinfra: settings, the host command, and whole runs on @local.

The whole-run tests use pyinfra's @local connector with ``bench_runner=host`` (the
program runs with this machine's python3) against the fake server on 127.0.0.1, so the
real deploy-file path — upload, run, progress, fetch, placeholder results for failed
hosts, the report — runs here; the simulated fleet covers the docker runner over SSH.
"""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from sparkfleet.bench import deploy as checks_deploy
from sparkfleet.bench.onhost.schema import ProgramSettings
from sparkfleet.bench.settings import bench_settings, parse_check_names, run_id_for
from sparkfleet.testbed.engine.api import Faults
from sparkfleet.testbed.engine.local import SimServer

REPO = Path(__file__).resolve().parents[2]


# --- settings --------------------------------------------------------------------------------


def test_settings_defaults_and_parsing():
    s = bench_settings({"checks": "smoke, decode", "port": "8100"})
    assert s.checks == ["smoke", "decode"]
    assert s.bench == ["smoke", "tools", "decode", "e2e"]
    assert s.port == 8100 and s.served_model_name == "qwen"
    assert s.base_url == "http://127.0.0.1:8100"
    assert bench_settings({"bind_address": "::"}).base_url == "http://127.0.0.1:8000"
    assert bench_settings({"bind_address": "10.0.0.5"}).base_url == "http://10.0.0.5:8000"
    assert parse_check_names(None) == [] and parse_check_names(["e2e", "e2e"]) == ["e2e"]


@pytest.mark.parametrize("data,match", [
    ({"checks": "smoke,nope"}, "unknown check"),
    ({"run_id": "../etc"}, "run_id"),
    ({"bench_runner": "ssh"}, "bench_runner"),
    ({"bench_dir": "relative"}, "absolute"),
])
def test_bad_settings_are_refused_with_the_key(data, match):
    with pytest.raises(ValueError, match=match):
        bench_settings(data)


def test_one_run_id_per_process_unless_given():
    s = bench_settings({})
    assert run_id_for(s) == run_id_for(bench_settings({}))
    assert run_id_for(bench_settings({"run_id": "nightly-1"})) == "nightly-1"


# --- the command that runs on the host ----------------------------------------------------------


def _fake_bin(tmp_path: Path) -> Path:
    """``docker`` and ``flock`` stand-ins that record the argv they were given."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "docker").write_text(
        "#!/bin/sh\n"
        'if [ "$1" = inspect ]; then case "$3" in *Image*) echo sha256:feed;; *) echo true;; esac; exit 0; fi\n'
        f'{sys.executable} -c \'import json,sys; json.dump(sys.argv[1:], open("{tmp_path}/argv.json","w"))\' "$@"\n'
    )
    (bindir / "flock").write_text('#!/bin/sh\nshift 4\nexec "$@"\n')
    for f in bindir.iterdir():
        f.chmod(f.stat().st_mode | stat.S_IEXEC)
    return bindir


def test_docker_command_runs_the_serving_image_with_every_value_quoted(tmp_path):
    nasty = "it's; rm -rf / $(reboot) `x` \"q\""
    s = bench_settings({"bench_prompt": nasty, "bench_dir": str(tmp_path / "b"), "port": 8123})
    script = checks_deploy.bench_command(s, ["smoke", "decode", "agent"], "r1", "spark-1")
    assert "VLLM_API_KEY" not in script  # the key travels as a read-only file, never argv
    env = dict(os.environ, PATH=f"{_fake_bin(tmp_path)}:{os.environ['PATH']}")
    proc = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    argv = json.loads((tmp_path / "argv.json").read_text())
    image = argv.index("sha256:feed")  # the serving container's image, by ID
    docker_opts, program = argv[:image], argv[image + 1:]
    assert docker_opts[:5] == ["run", "--rm", "--network", "host", "--entrypoint"]
    assert f"{tmp_path}/b/code/sparkfleet_onhost:/opt/sparkfleet-bench/sparkfleet_onhost:ro" in docker_opts
    assert program[:3] == ["-m", "sparkfleet_onhost", "--settings"] and len(program) == 4
    doc = ProgramSettings.from_json(program[3])  # one document, complete and valid
    assert doc.prompt == nasty  # verbatim through two shells
    assert doc.base_url == "http://127.0.0.1:8123"
    assert doc.checks == ["smoke", "decode", "agent"]
    assert doc.state_db == f"{tmp_path}/b/state.db"
    assert doc.out == f"{tmp_path}/b/results/r1.json"
    assert doc.secrets_file == "/run/sparkfleet/secrets.env"
    assert (doc.runs, doc.warmup, doc.max_tokens) == (s.bench_runs, s.bench_warmup, s.bench_max_tokens)


def test_docker_command_without_a_serving_container_says_so(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "docker").write_text("#!/bin/sh\nexit 1\n")
    (bindir / "docker").chmod(0o755)
    s = bench_settings({"bench_dir": str(tmp_path / "b")})
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}")
    proc = subprocess.run(["sh", "-c", checks_deploy.bench_command(s, ["smoke"], "r", "h")],
                          env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 3
    assert "no sparkfleet-serve container on this host" in proc.stderr


def test_state_db_snapshot_includes_what_is_still_in_the_wal(tmp_path):
    live = tmp_path / "state.db"
    writer = sqlite3.connect(live)
    writer.execute("PRAGMA journal_mode=WAL")
    writer.execute("PRAGMA wal_autocheckpoint=0")
    writer.execute("CREATE TABLE sessions (id TEXT)")
    writer.executemany("INSERT INTO sessions VALUES (?)", [(f"s{i}",) for i in range(50)])
    writer.commit()  # still open: the rows live in state.db-wal, not in state.db
    assert (tmp_path / "state.db-wal").stat().st_size > 0
    snap = checks_deploy.snapshot_state_db(str(live))
    writer.close()
    assert oct(os.stat(snap).st_mode & 0o777) == "0o600"
    assert sqlite3.connect(snap).execute("SELECT COUNT(*) FROM sessions").fetchone() == (50,)
    assert not os.path.exists(snap + "-wal")
    with pytest.raises(ValueError, match="no such file"):
        checks_deploy.snapshot_state_db(str(tmp_path / "missing.db"))


# --- whole runs through pyinfra --------------------------------------------------------------


def _pyinfra(tmp_path: Path, inventory: str, deploy: str, port: int, *data: str, dry: bool = False):
    args = [
        sys.executable, "-m", "pyinfra", inventory, deploy, "-y",
        "--data", "bench_runner=host", "--data", f"bench_dir={tmp_path}/host",
        "--data", f"port={port}", "--data", f"results_dir={tmp_path}/results", "--data", "run_id=r1",
        "--data", "bench_runs=1", "--data", "bench_warmup=0", "--data", "bench_max_tokens=16",
    ]
    for d in data:
        args += ["--data", d]
    if dry:
        args.append("--dry")
    return subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=240)


def test_bench_deploy_file_runs_collects_and_reports(tmp_path):
    env = {"SIM_DECODE_TOK_S": "2000", "SIM_TTFT_S": "0.01"}
    with SimServer(env=env) as srv:
        proc = _pyinfra(tmp_path, "@local", "checks/bench.py", srv.port, "bench=smoke,tools,decode,e2e")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    result = json.loads((tmp_path / "results/r1/_local.json").read_text())
    assert result["status"] == "ok" and result["host"] == "@local" and result["runner"] == "host"
    assert set(result["checks"]) == {"smoke", "tools", "decode", "e2e"}
    assert "[@local] [bench" in out  # progress lines streamed, prefixed by host
    assert "decode/prose run 1/1" in out
    assert "sparkfleet fleet report" in out and "e2e (albond)" in out
    for ext in ("txt", "csv", "json", "png"):
        assert (tmp_path / f"results/r1/fleet-report.{ext}").exists()
    # the program went to the host's bench dir, root-only
    assert (tmp_path / "host/code/sparkfleet_onhost/runner.py").exists()
    assert oct((tmp_path / "host").stat().st_mode & 0o777) == "0o700"


def test_smoke_deploy_file_fails_a_wrong_answer_with_the_answer(tmp_path):
    with SimServer(faults=Faults(wrong_answer=" Lyon")) as srv:
        proc = _pyinfra(tmp_path, "@local", "checks/smoke.py", srv.port)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    result = json.loads((tmp_path / "results/r1/_local.json").read_text())
    assert result["status"] == "failed" and result["checks"]["smoke"]["answer"] == " Lyon"
    assert "checks failed: smoke: answer does not contain Paris: 'Lyon'" in out


def test_an_unreachable_host_and_a_dead_server_are_reported_as_failed(tmp_path):
    inventory = tmp_path / "inventory.py"
    inventory.write_text(
        "hosts = [\n"
        "    '@local',\n"
        "    ('spark-gone', {'ssh_hostname': '127.0.0.1', 'ssh_port': 1, 'ssh_connect_retries': 0}),\n"
        "]\n"
    )
    with SimServer() as srv:
        dead_port = srv.port  # nothing listens there once the server is gone
    proc = _pyinfra(tmp_path, str(inventory), "checks/smoke.py", dead_port)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    local = json.loads((tmp_path / "results/r1/_local.json").read_text())
    assert local["status"] == "failed" and "connection refused" in local["reason"]
    gone = json.loads((tmp_path / "results/r1/spark-gone.json").read_text())
    assert gone["status"] == "failed" and "unreachable" in gone["reason"]
    report = (tmp_path / "results/r1/fleet-report.txt").read_text()
    assert "spark-gone" in report and "unreachable" in report and "connection refused" in report


def test_the_tools_check_names_the_missing_parser(tmp_path):
    with SimServer(tool_call_parser=None) as srv:
        proc = _pyinfra(tmp_path, "@local", "checks/bench.py", srv.port, "bench=smoke,tools")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    result = json.loads((tmp_path / "results/r1/_local.json").read_text())
    assert result["checks"]["smoke"]["status"] == "ok"
    assert "tools: the server has no tool-call parser" in result["reason"]
    assert "tool_call_parser" in result["checks"]["tools"]["reason"]
    assert "tools (function-call round trip)" in out and "FAIL  the server has no tool-call parser" in out


def test_a_dry_run_writes_no_results(tmp_path):
    proc = _pyinfra(tmp_path, "@local", "checks/smoke.py", 9, dry=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not (tmp_path / "results").exists()
