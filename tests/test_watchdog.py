"""The watchdog's program (templates/sparkfleet-watchdog.py): what counts as a wedge and as
memory pressure, from the figures vLLM and the kernel print; the units around it."""

from __future__ import annotations

import importlib.util
import json
from types import SimpleNamespace

from sparkfleet import hostpaths, watchdog

spec = importlib.util.spec_from_file_location("sparkfleet_watchdog_program", watchdog.PROGRAM)
program = importlib.util.module_from_spec(spec)
spec.loader.exec_module(program)

ARGS = SimpleNamespace(wedge_timeout=30, psi_full_stop=10.0, psi_full_resume=1.0, stop_available_gib=8.0,
                       gpu_memory_utilization=0.82, startup_gib=9.0)
LB = 'engine="0",model_name="qwen"'


def metrics(running: int, waiting: int, generated: int, prompt: int = 100) -> dict:
    text = (f"# HELP vllm:num_requests_running x\nvllm:num_requests_running{{{LB}}} {running}.0\n"
            f"vllm:num_requests_waiting{{{LB}}} {waiting}.0\nvllm:generation_tokens_total{{{LB}}} {generated}.0\n"
            f"vllm:prompt_tokens_total{{{LB}}} {prompt}.0\nvllm:kv_cache_usage_perc{{{LB}}} 0.5\n")
    return program.parse_metrics(text)


def test_the_program_keeps_its_files_where_the_deploy_says():
    assert (program.STATE, program.AGENT, program.EVENTS) == (
        hostpaths.WATCHDOG_STATE, hostpaths.AGENT_ANSWER, hostpaths.WATCHDOG_LOG)
    assert (program.AUTH_HEADER, program.UNIT) == (hostpaths.AUTH_HEADER, hostpaths.UNIT)


def test_metrics_are_read_as_vllm_prints_them():
    assert metrics(2, 1, 500, 40) == {"running": 2.0, "waiting": 1.0, "tokens": 540.0}


def test_pending_work_without_a_token_for_the_bound_is_a_wedge():
    state, action, _ = program.decide({}, metrics(1, 0, 500), 1000.0, ARGS)
    state, action, _ = program.decide(state, metrics(1, 2, 500), 1029.0, ARGS)
    assert action is None
    state, action, why = program.decide(state, metrics(1, 2, 500), 1030.0, ARGS)
    assert action == "wedge" and "no token for 30 s" in why and state["agent"] == "down"


def test_tokens_or_an_idle_engine_are_not_a_wedge():
    state, _, _ = program.decide({}, metrics(1, 0, 500), 1000.0, ARGS)
    state, action, _ = program.decide(state, metrics(1, 0, 501), 1040.0, ARGS)  # a token came
    assert action is None
    state, action, _ = program.decide(state, metrics(0, 0, 501), 1100.0, ARGS)  # nothing to do
    assert action is None
    state, action, _ = program.decide(state, metrics(1, 0, 501, prompt=9000), 1200.0, ARGS)  # a prefill ended
    assert action is None


def test_a_member_taken_out_comes_back_once_it_answers():
    state = {"agent": "down", "reason": "wedge", "since": 0.0}
    assert program.decide(state, None, 5.0, ARGS)[1] is None  # restarting: not yet
    state, action, _ = program.decide(state, metrics(0, 0, 0), 20.0, ARGS)
    assert action == "up" and state["agent"] == "up"


PSI = "some avg10={some} avg60=0.00 avg300=0.00 total=1\nfull avg10={full} avg60=0.00 avg300=0.00 total=1\n"
MEMINFO = "MemTotal:       127606784 kB\nMemFree:         1000 kB\nMemAvailable:   {kib} kB\n"


def pressure(full: float, available_gib: float) -> tuple[float, float, float]:
    return program.parse_pressure(PSI.format(some=full * 2, full=full),
                                  MEMINFO.format(kib=int(available_gib * 1024 * 1024)))


def test_memory_pressure_stops_the_engine_before_the_freeze():
    full, available, total = pressure(0.5, 20.0)
    assert round(total, 1) == 121.7 and program.memory_decision({}, full, available, total, ARGS)[0] is None
    assert program.memory_decision({}, *pressure(12.0, 20.0), ARGS)[0] == "stop"  # stalls (PSI)
    action, why = program.memory_decision({}, *pressure(0.0, 7.5), ARGS)  # MemAvailable low
    assert action == "stop" and "MemAvailable 7.5 GiB" in why


def test_the_engine_starts_again_only_when_its_start_fits():
    stopped = {"reason": "memory"}
    assert program.memory_decision(stopped, *pressure(3.0, 115.0), ARGS)[0] is None  # still stalling
    assert program.memory_decision(stopped, *pressure(0.2, 115.0), ARGS)[0] == "start"
    # Pressure gone, memory still held by something else: said once, then waited on quietly.
    action, why = program.memory_decision(stopped, *pressure(0.0, 100.0), ARGS)  # 0.82 x 121.7 + 9 = 108.8
    assert action == "short" and "MemAvailable 100.0 GiB is under the 108.8 GiB a start needs" in why
    assert program.memory_decision({**stopped, "short": True}, *pressure(0.0, 100.0), ARGS)[0] is None
    assert program.memory_decision({**stopped, "short": True}, *pressure(0.0, 115.0), ARGS)[0] == "start"


def test_a_look_after_a_memory_stop_says_why_it_waits_once_and_rejoins_an_engine_started_meanwhile(
        tmp_path, monkeypatch):
    for name in ("STATE", "AGENT", "EVENTS"):
        monkeypatch.setattr(program, name, str(tmp_path / name.lower()))
    ran, answers = [], {"/metrics": None}
    monkeypatch.setattr(program, "systemctl", lambda *a: ran.append(a))
    monkeypatch.setattr(program, "_get", lambda port, path, timeout: answers.get(path))
    args = SimpleNamespace(**vars(ARGS), port=8000, settle=0, psi=str(tmp_path / "psi"), meminfo=str(tmp_path / "mem"))

    def look(available_gib: float) -> dict:
        (tmp_path / "psi").write_text("full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
        (tmp_path / "mem").write_text(f"MemTotal: {int(121.7 * 2**20)} kB\nMemAvailable: {int(available_gib * 2**20)} kB\n")
        program.look(args)
        return json.loads((tmp_path / "state").read_text())

    (tmp_path / "state").write_text(json.dumps({"agent": "down", "reason": "memory"}))
    for _ in range(3):
        assert look(60.0)["reason"] == "memory" and ran == []
    assert (tmp_path / "events").read_text().count("a start needs") == 1  # said once
    assert look(115.0)["reason"] == "starting" and ran == [("reset-failed",), ("start",)]  # the limit reset first
    # A deploy started the engine while the watchdog waited: it answers, so it rejoins.
    (tmp_path / "state").write_text(json.dumps({"agent": "down", "reason": "memory", "short": True}))
    answers.update({"/metrics": "vllm:num_requests_running 0.0\nvllm:generation_tokens_total 5.0\n", "/v1/models": "{}"})
    state = look(20.0)  # the running engine holds its memory: no start is asked for
    assert state["agent"] == "up" and "short" not in state and ran[2:] == []
    assert "started again (by a deploy or by hand)" in (tmp_path / "events").read_text()
    assert (tmp_path / "agent").read_text() == "up\n"


def test_restarts_are_counted_in_their_window(tmp_path, monkeypatch):
    log = tmp_path / "watchdog.log"
    log.write_text("2026-01-01T00:00:00Z wedge a\n2026-01-01T00:50:00Z wedge b\n2026-01-01T00:55:00Z up c\n")
    monkeypatch.setattr(program, "EVENTS", str(log))
    now = 1767225600 + 3600  # 2026-01-01T01:00:00Z
    assert program.recent_restarts(3600, now) == 2 and program.recent_restarts(600, now) == 1


def test_the_units_pass_no_secret_and_the_agent_answers_the_watchdogs_file():
    settings = SimpleNamespace(port=8000, wedge_timeout_s=300, wedge_max_restarts=3, wedge_restart_window_s=3600,
                               memory_stop_psi_full_pct=10.0, memory_stop_available_gib=8.0,
                               gpu_memory_utilization=0.82, engine_startup_memory_gib=9.0, watchdog_interval_s=5,
                               watchdog_agent_port=8009)
    unit = watchdog.service_unit(settings)
    assert "--wedge-timeout 300" in unit and "Bearer" not in unit and "api-auth" not in unit
    # One process looks every interval; systemd's watchdog outlasts a look plus the interval.
    assert "Type=notify" in unit and "--every 5 " in unit and "WatchdogSec=125" in unit and "Restart=always" in unit
    assert "ListenStream=8009" in watchdog.agent_socket(settings) and "Accept=yes" in watchdog.agent_socket(settings)
    assert hostpaths.AGENT_ANSWER in watchdog.AGENT_UNIT
    assert all(f"--{flag}" in watchdog.PROGRAM.read_text()
                        for flag in ("port", "wedge-timeout", "max-restarts", "restart-window", "psi-full-stop",
                                     "stop-available-gib", "gpu-memory-utilization", "startup-gib"))


def test_a_new_boot_is_reported_with_the_previous_boots_gpu_errors():
    from sparkfleet.facts import BootReport

    fact = BootReport()
    assert "journalctl -b -1" in fact.command() and hostpaths.BOOT_SEEN in fact.command()
    xid = "2026-12-02T12:00:00+0000 spark-2 kernel: NVRM: Xid (PCI:000f:01:00): 79, GPU has fallen off the bus."
    report = fact.process(["boot 2222", "seen 1111", xid])
    assert report == {"boot": "2222", "seen": "1111", "errors": [xid]}
    assert fact.process(["boot 2222", "seen 2222"])["errors"] == []


def test_the_look_reads_the_engine_with_the_key_and_only_a_2xx_counts(tmp_path, monkeypatch):
    import http.server
    import threading

    seen = []

    class Engine(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            seen.append((self.path, self.headers.get("Authorization")))
            ok = self.headers.get("Authorization") == "Bearer k-1" and self.path == "/metrics"
            body = b"# HELP x\nvllm:num_requests_running 1.0\nvllm:generation_tokens_total 12345.0\n" if ok else b"{}"
            self.send_response(200 if ok else 401)
            if ok:  # as uvicorn sends vLLM's /metrics: chunked, the pieces cutting lines
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for piece in (body[:20], body[20:47], body[47:]):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                self.wfile.write(b"0\r\n\r\n")
                return
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Engine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    header = tmp_path / "api-auth.header"
    header.write_text("Authorization: Bearer k-1\n")
    monkeypatch.setattr(program, "AUTH_HEADER", str(header))
    try:
        port = server.server_address[1]
        assert program.parse_metrics(program._get(port, "/metrics", timeout=5)) == {
            "running": 1.0, "waiting": 0.0, "tokens": 12345.0}
        assert program._get(port, "/v1/models", timeout=5) is None  # 401: not an answer
        header.write_text("")
        assert program._get(port, "/metrics", timeout=5) is None
        assert seen == [("/metrics", "Bearer k-1"), ("/v1/models", "Bearer k-1"), ("/metrics", None)]
    finally:
        server.shutdown()
        server.server_close()
    assert program._get(port, "/metrics", timeout=1) is None  # nothing listens: no answer


def test_the_service_looks_every_interval_and_tells_systemd_after_each_look(tmp_path, monkeypatch):
    import socket

    for name in ("STATE", "AGENT", "EVENTS", "AUTH_HEADER"):
        monkeypatch.setattr(program, name, str(tmp_path / name.lower()))
    (tmp_path / "psi").write_text("some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
                                  "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    (tmp_path / "meminfo").write_text("MemTotal:       127601908 kB\nMemAvailable:   106954752 kB\n")
    systemd = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    systemd.bind(str(tmp_path / "notify"))
    systemd.settimeout(1)
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify"))
    looks, naps = [], []
    real_look = program.look

    def look(args):
        real_look(args)
        looks.append(json.loads((tmp_path / "state").read_text()))

    def nap(seconds):
        naps.append(seconds)
        if len(naps) == 3:
            raise KeyboardInterrupt  # the test's way out of the loop

    monkeypatch.setattr(program, "look", look)
    monkeypatch.setattr(program.time, "sleep", nap)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # a port nothing listens on: the engine is not up
    try:
        program.main(["--every", "5", "--port", str(closed.getsockname()[1]),
                      "--psi", str(tmp_path / "psi"), "--meminfo", str(tmp_path / "meminfo")])
    except KeyboardInterrupt:
        pass
    finally:
        closed.close()
    told = [systemd.recv(64).decode() for _ in range(4)]
    systemd.close()
    assert told == ["READY=1", "WATCHDOG=1", "WATCHDOG=1", "WATCHDOG=1"]
    assert len(looks) == 3 and all(0 < s <= 5 for s in naps)
    assert (tmp_path / "agent").read_text() == "up\n"  # the first look's answer for HAProxy


def test_a_host_deployed_when_a_timer_started_each_look_has_it_removed(monkeypatch):
    from pyinfra.context import ctx_host
    from support.fleetdata import fake_state, host_answering

    from sparkfleet import snapshot

    timer = hostpaths.systemd_path(hostpaths.WATCHDOG_TIMER)
    for on_host, wanted in (([0o644, "root:root", "x"], [
            f"systemctl disable --now {hostpaths.WATCHDOG_TIMER}; rm -f {timer}; systemctl daemon-reload"]),
            (None, [])):
        with fake_state(["@fake/spark-1"]) as state:
            target = state.inventory.get_host("@fake/spark-1")

            monkeypatch.setattr(target, "get_fact", host_answering(files={timer: on_host}))
            with ctx_host.use(target):
                snapshot.expect(files=[timer])
                assert list(watchdog._timer_gone._inner(path=timer)) == wanted
