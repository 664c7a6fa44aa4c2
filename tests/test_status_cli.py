"""`sparkfleet status` on an inventory that cannot be read: one line naming the missing file
and the fix, a non-zero exit, no traceback (no fleet).

Each runs the command in its own process, as a user does: in the suite's process, with
gevent and pyinfra state left by earlier tests, an import inside the command once waited
forever on a module lock that another greenlet held."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from sparkfleet.testbed import state as testbed_state

CHECKOUT = Path(__file__).resolve().parents[1]


def status(*args: str, cwd: Path = CHECKOUT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sparkfleet.cli", "status", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_a_torn_down_testbeds_inventory_names_the_file_and_testbed_up(tmp_path):
    # `testbed down` removes an instance's hosts.json and the inventory beside it; pyinfra
    # would take the path for a host name and fail its DNS lookup with a UnicodeError.
    inventory = tmp_path / ".testbed" / "instance-7" / "inventory.py"
    done = status(str(inventory))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (f"sparkfleet status: inventory {inventory} does not exist: boot the "
                                   "simulated fleet with `SPARKFLEET_TESTBED_INSTANCE=7 sparkfleet testbed up`, which writes it")


def test_an_inventory_whose_hosts_json_is_missing_names_hosts_json(tmp_path):
    inventory = tmp_path / ".testbed" / "instance-7" / "inventory.py"
    inventory.parent.mkdir(parents=True)
    inventory.write_text(testbed_state._INSTANCE_INVENTORY.format(instance=7))
    done = status(str(inventory))
    err = done.stderr
    assert done.returncode == 2, err
    assert f"reads {inventory.parent / 'hosts.json'}, which does not exist" in err, err
    assert "`SPARKFLEET_TESTBED_INSTANCE=7 sparkfleet testbed up`" in err and "Traceback" not in err, err


def test_a_missing_inventory_file_elsewhere_names_an_example(tmp_path):
    done = status(str(tmp_path / "sparks.py"))
    assert done.returncode == 2, done.stderr
    assert "does not exist: give the path of an inventory file, e.g. inventory/sparks.py" in done.stderr


def test_a_fleet_where_no_host_answers_is_a_table_of_unreachable_hosts(tmp_path):
    # pyinfra raises "No hosts remaining!" when it reaches none: the table says it instead.
    inventory = tmp_path / "sparks.py"
    inventory.write_text('sparks = ["spark-gone.invalid"]\n')
    done = status(str(inventory))  # from the checkout: its group_data/
    assert done.returncode == 1, done.stdout + done.stderr
    out = done.stdout
    assert out.splitlines()[1].split()[:2] == ["spark-gone.invalid", "unreachable"], out
    # A reader that stops early (`| head`) ends it quietly, as other tools end.
    r, w = os.pipe()
    os.close(r)
    with os.fdopen(w, "w") as closed:
        ended = subprocess.run([sys.executable, "-m", "sparkfleet.cli", "status", str(inventory)], cwd=CHECKOUT,
                               stdout=closed, stderr=subprocess.PIPE, text=True, timeout=120)
    assert ended.returncode == 1 and "Traceback" not in ended.stderr and "Broken" not in ended.stderr, ended.stderr


def test_a_host_row_reads_metrics_with_prometheus_parser():
    from support.fleetdata import defaults

    from sparkfleet.config import validate_host_data
    from sparkfleet.status import parse_host

    s = validate_host_data("spark-1", {**defaults(), "bind_address": "10.0.0.5"})
    lines = ["== unit", "ActiveState=active", "== models", json.dumps({"data": [{"id": s.served_model_name}]}),
             "== metrics",
             'vllm:num_requests_running{engine="0",model_name="m"} 2.0',
             'vllm:num_requests_running{engine="1",model_name="m"} 1.0',
             'vllm:num_requests_waiting{engine="0",model_name="m"} 4.0',
             'vllm:spec_decode_num_drafts_total{engine="0"} 10.0',
             'vllm:spec_decode_num_accepted_tokens_total{engine="0"} 25.0']
    row = parse_host(lines, s)
    assert row["ready"] and row["running"] == 3 and row["waiting"] == 4
    assert row["acceptance_length"] == 3.5


class _Answers(ThreadingHTTPServer):
    """An HTTP server (dockerd's API on a unix socket, or the engine's on TCP) that answers
    ``answers[path]`` as JSON (404 otherwise) and keeps each request's path and headers."""

    daemon_threads = True

    def __init__(self, address, answers: dict, family=socket.AF_INET):
        self.address_family = family
        self.answers, self.asked = answers, []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(handler):  # noqa: N805 - the handler's self
                self.asked.append((handler.path, dict(handler.headers)))
                body = self.answers.get(handler.path)
                data = (body if isinstance(body, str) else json.dumps(body)).encode() if body is not None else b""
                handler.send_response(200 if body is not None else 404)
                handler.send_header("Content-Length", str(len(data)))
                handler.end_headers()
                handler.wfile.write(data)

            def log_message(self, *args):
                pass

        super().__init__(address, Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def server_bind(self):
        if self.address_family == socket.AF_UNIX:
            self.socket.bind(self.server_address)
            self.server_name, self.server_port = "docker", 0
        else:
            super().server_bind()


def test_a_host_is_asked_where_and_with_the_key_its_engine_runs(tmp_path, monkeypatch):
    """The status program, run by python3 here against a dockerd and an engine of the test's:
    the API is asked at the address and port of the running container's environment (not
    serve.env, which a change to come rewrote) and with the last good key when the engine
    started on it; dockerd once for the whole row."""
    import subprocess

    from support.fleetdata import defaults

    from sparkfleet import status as st
    from sparkfleet.config import validate_host_data

    s = validate_host_data("spark-1", {**defaults(), "port": 9001})
    engine = _Answers(("127.0.0.1", 0), {"/v1/models": {"data": [{"id": s.served_model_name}]},
                                         "/metrics": "vllm:num_requests_running{engine=\"0\"} 2.0\nother 1\n"})
    port = engine.server_address[1]
    # The running container: started with dflash, bound to one address, on the engine's port;
    # its image by its local name, made from the digest.
    dockerd = _Answers(str(tmp_path / "docker.sock"), {f"/containers/{st.CONTAINER}/json": {
        "Config": {"Env": ["PATH=/usr/bin", "SF_PROFILE=dflash", "SF_HOST=127.0.0.1", f"SF_PORT={port}"],
                   "Image": "localhost/sparkfleet/serve:sha256-abc"}, "Image": "sha256:0123"}}, socket.AF_UNIX)
    try:
        lg = tmp_path / "last-good"
        lg.mkdir()
        paths = {"SERVE_ENV": tmp_path / "serve.env", "STARTED_FILE": tmp_path / "started.rev",
                 "LAST_GOOD_DIR": lg, "AUTH_HEADER": tmp_path / "api-auth.header",
                 "DOCKER_SOCKET": tmp_path / "docker.sock"}
        for name, path in paths.items():
            monkeypatch.setattr(st, name, str(path))
        paths["SERVE_ENV"].write_text("SF_PROFILE=dense\nSF_HOST=0.0.0.0\nSF_PORT=9001\n")  # the change to come
        paths["AUTH_HEADER"].write_text("Authorization: Bearer new\n")
        paths["STARTED_FILE"].write_text("rev-1\n")
        (lg / "serving.rev").write_text("rev-1\n")
        (lg / "api-auth.header").write_text("Authorization: Bearer old\n")
        done = subprocess.run(["sh", "-c", st._host_command(s)], capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        assert [(path, headers.get("Authorization")) for path, headers in engine.asked] == [
            ("/v1/models", "Bearer old"), ("/metrics", "Bearer old")]
        row = st.parse_host(done.stdout.splitlines(), s)
        assert (row["profile"], row["pending"], row["ready"], row["running"]) == ("dflash", "dense", True, 2)
        assert row["image_digest"] == "sha256:abc" and "#image" not in done.stdout
        assert [path for path, _ in dockerd.asked] == [f"/containers/{st.CONTAINER}/json"]
        # Another image (not pinned): its digests as dockerd lists them; no container: serve.env.
        dockerd.answers = {f"/containers/{st.CONTAINER}/json": {"Config": {
            "Env": [f"SF_PORT={port}", "SF_PROFILE=dflash"], "Image": "vllm:latest"}, "Image": "sha256:0123"},
            "/images/sha256:0123/json": {"RepoDigests": ["vllm@sha256:def"]}}
        row = st.parse_host(subprocess.run(["sh", "-c", st._host_command(s)], capture_output=True, text=True,
                                           timeout=30).stdout.splitlines(), s)
        assert row["image_digest"] == "sha256:def"
        dockerd.answers = {}
        row = st.parse_host(subprocess.run(["sh", "-c", st._host_command(s)], capture_output=True, text=True,
                                           timeout=30).stdout.splitlines(), s)
        assert (row["profile"], row["pending"], row["image_digest"]) == ("dense", None, None)
    finally:
        for server in (engine, dockerd):
            server.shutdown()
            server.server_close()


def test_a_host_row_shows_the_watchdogs_last_event_and_a_member_it_keeps_out():
    from support.fleetdata import defaults

    from sparkfleet.config import validate_host_data
    from sparkfleet.status import parse_host, table

    s = validate_host_data("spark-1", defaults())
    event = "2026-12-02T12:00:00Z wedge no progress: 3 request(s) running or waiting and no token for 300 s"
    row = parse_host(["== unit", "ActiveState=active", "== watchdog", event, "down#wedged"], s)
    assert row["watchdog"] == event and row["agent"] == "down#wedged"
    shown = table({"hosts": [{**row, "host": "spark-1", "reachable": True}], "endpoint": None})
    assert f"watchdog on spark-1: {event} — out of rotation: wedged" in shown
    quiet = parse_host(["== unit", "ActiveState=active", "== watchdog"], s)
    assert quiet["watchdog"] is None and "watchdog on" not in table(
        {"hosts": [{**quiet, "host": "spark-1", "reachable": True}], "endpoint": None})


def test_a_host_row_names_a_reboot_since_the_last_deploy_and_the_errors_before_it():
    from support.fleetdata import defaults

    from sparkfleet.config import validate_host_data
    from sparkfleet.status import parse_host, table

    s = validate_host_data("spark-1", defaults())
    xid = "2026-12-04T06:00:01+00:00 spark-1 kernel: NVRM: Xid (PCI:000f:01:00): 79, GPU has fallen off the bus."
    row = parse_host(["== unit", "ActiveState=active", "== boot", "boot 22222222-b", "seen 11111111-a", xid], s)
    assert row["rebooted"] == {"boot": "22222222-b", "seen": "11111111-a", "errors": [xid]}
    shown = table({"hosts": [{**row, "host": "spark-1", "reachable": True}], "endpoint": None})
    assert "spark-1: rebooted since the last deploy (boot 11111111 -> 22222222); the previous boot's last kernel" in shown
    assert f"    {xid}" in shown
    for same in (["boot 1-a", "seen 1-a"], ["boot 1-a", "seen "]):  # the same boot; no deploy saw one yet
        quiet = parse_host(["== unit", "ActiveState=active", "== boot", *same], s)
        assert quiet["rebooted"] is None
        assert "rebooted:" not in table({"hosts": [{**quiet, "host": "spark-1", "reachable": True}], "endpoint": None})


#: Prometheus 2.42's /api/v1/alerts answer: one firing, one pending (not yet past its `for:`).
ALERTS = {"status": "success", "data": {"alerts": [
    {"labels": {"alertname": "SparkfleetEngineDown", "host": "spark-3", "job": "engine", "severity": "critical"},
     "annotations": {"summary": "spark-3: the engine does not answer /metrics (stopped, dead or hung)"},
     "state": "firing", "activeAt": "2026-12-02T12:00:01.5Z", "value": "0e+00"},
    {"labels": {"alertname": "SparkfleetMemoryLow", "host": "spark-2", "severity": "warning"},
     "annotations": {"summary": "spark-2: 11GiB available"}, "state": "pending", "activeAt": "2026-12-02T12:00:09Z",
     "value": "1.1e+10"}]}}


def test_the_monitor_hosts_row_carries_the_alerts_that_fire_and_the_table_shows_them():
    from support.fleetdata import defaults

    from sparkfleet.config import validate_host_data
    from sparkfleet.status import _host_command, alerts_url, parse_alerts, parse_host, table

    assert alerts_url(validate_host_data("spark-1", defaults())) == "http://127.0.0.1:9090/api/v1/alerts"
    prometheus = _Answers(("127.0.0.1", 0), {"/api/v1/alerts": ALERTS})
    try:
        s = validate_host_data("spark-1", {**defaults(), "monitor_port": prometheus.server_address[1]})
        asked = subprocess.run(["sh", "-c", _host_command(s, alerts=True)], capture_output=True, text=True,
                               timeout=30).stdout
        assert "== alerts" not in subprocess.run(["sh", "-c", _host_command(s)], capture_output=True, text=True,
                                                 timeout=30).stdout
    finally:
        prometheus.shutdown()
        prometheus.server_close()
    assert [path for path, _ in prometheus.asked] == ["/api/v1/alerts"]
    row = parse_host(asked.splitlines(), s)
    assert row["alerts"] == [{"name": "SparkfleetEngineDown", "host": "spark-3", "severity": "critical",
                              "since": "2026-12-02T12:00:01.5Z",
                              "summary": "spark-3: the engine does not answer /metrics (stopped, dead or hung)"}]
    doc = {"hosts": [], "endpoint": None,
           "monitor": {"host": "spark-1", "prometheus": "127.0.0.1:9090", "alerts": row["alerts"]}}
    shown = table(doc)
    assert "fleet monitor on spark-1 (Prometheus 127.0.0.1:9090): 1 alert firing" in shown
    assert ("    SparkfleetEngineDown spark-3 (critical, since 2026-12-02T12:00:01.5Z): spark-3: the engine does "
            "not answer /metrics") in shown
    # Prometheus not answering (stopped, curl refused) is said, not taken for a quiet fleet.
    assert parse_alerts("") is None and parse_alerts("<html>") is None
    assert "Prometheus 127.0.0.1:9090): not answering" in table({**doc, "monitor": {**doc["monitor"], "alerts": None}})
    assert "no alert firing" in table({**doc, "monitor": {**doc["monitor"], "alerts": []}})


def test_the_digest_is_read_from_a_pinned_or_a_local_name_only():
    from sparkfleet.hostpaths import digest_of, local_image

    pinned = "10.0.0.1:5000/sparkfleet/vllm-sim:0.23.0@sha256:" + "a" * 64
    assert digest_of(pinned) == "sha256:" + "a" * 64
    assert digest_of(local_image(pinned)) == "sha256:" + "a" * 64  # the name hosts run it by
    for other in ("10.0.0.1:5000/sparkfleet/vllm-sim:0.23.0", local_image("ghcr.io/x/y:latest"), "sha256:0123"):
        assert digest_of(other) is None, other


def test_the_endpoint_lists_the_members_that_need_a_look_and_sums_up_the_others():
    from sparkfleet.status import table

    def member(n, state="UP", errors=0, check="L7OK", requests=40):
        return {"state": state, "in_flight": 1, "requests": requests, "errors": errors, "check": check,
                "address": f"10.0.0.{n}:8000"}

    ep = {"host": "spark-1", "url": "http://10.0.0.1:8080/v1", "state": "running", "metrics": "m",
          "requests": 0, "in_flight": 0, "refused_401": 0, "errors_5xx": 0, "errors": 0}
    members = {f"spark-{n}": member(n, requests=40 + n % 3) for n in range(1, 33)}
    members["spark-7"] = member(7, state="DRAIN")
    members["spark-9"] = member(9, errors=2)
    members["spark-12"] = member(12, state="DOWN", check="L4CON")
    shown = table({"hosts": [], "endpoint": {**ep, "members": members}})
    assert "30/32 members in rotation" in shown  # spark-9 serves, with errors
    assert "    spark-7 10.0.0.7:8000: DRAIN, in flight 1, requests 40, errors 0, last check L7OK" in shown
    assert "    spark-9 10.0.0.9:8000: UP, in flight 1, requests 40, errors 2, last check L7OK" in shown
    assert "    spark-12 10.0.0.12:8000: DOWN, in flight 1, requests 40, errors 0, last check L4CON" in shown
    assert "    the other 29: UP, last check L7OK, no errors, requests 40-42 each" in shown
    assert "spark-3 " not in shown  # a member with nothing to say is in the sum alone
    quiet = {name: m for name, m in members.items() if name not in ("spark-7", "spark-9", "spark-12")}
    assert table({"hosts": [], "endpoint": {**ep, "members": quiet}}).endswith(
        "    every member (29): UP, last check L7OK, no errors, requests 40-42 each")
