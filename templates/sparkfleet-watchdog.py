#!/usr/bin/python3
"""sparkfleet's watchdog: the engine's progress and the host's memory, looked at every few seconds.

Installed by sparkfleet/watchdog.py and run by ``sparkfleet-watchdog.service``, a
``Type=notify`` service: it looks every ``--every`` seconds and tells systemd after each
look (``WATCHDOG=1``), so a look that hangs is ended and the service started afresh by
systemd's own watchdog. One process for the host's life, not one per look: a timer's
oneshot cost a host ~25 ms of CPU and three journal lines every few seconds (~50,000 lines
a day). Stdlib only: the host's python3. Without ``--every`` it looks once (by hand, in
tests). Each look:

- progress, not liveness: requests running or waiting while neither a generated nor a
  prompt token was counted in ``/metrics`` for ``--wedge-timeout`` seconds is a wedge
  (``/health`` keeps answering 200 while an engine is stuck: vLLM #56824, #50011);
- memory: past ``--psi-full-stop`` (PSI ``full avg10`` of /proc/pressure/memory) or
  under ``--stop-available-gib`` of MemAvailable the engine is stopped cleanly before the
  kernel or the driver freezes a unified-memory host (NVIDIA open-gpu-kernel-modules
  #1358, dgx-spark-playbooks #97); it starts again once pressure has cleared.

Before it acts the member leaves the fleet endpoint: the answer of HAProxy's agent-check
(``sparkfleet-agent.socket``) becomes ``down#<why>`` and stays so until the engine answers
``/v1/models`` again. Wedge restarts are bounded: past ``--max-restarts`` within
``--restart-window`` the engine is left stopped (a restart loop ends in a hard reset:
eugr/spark-vllm-docker #257). Each event is one line in the events log, which
``sparkfleet status`` and the next deploy show.
"""

from __future__ import annotations

import argparse
import calendar
import json
import os
import socket
import subprocess
import sys
import time

STATE = "/run/sparkfleet/watchdog.json"  # the last figures (tmpfs: a reboot starts afresh)
AGENT = "/run/sparkfleet/agent"  # what sparkfleet-agent.socket answers HAProxy
EVENTS = "/var/lib/sparkfleet/watchdog.log"
AUTH_HEADER = "/etc/sparkfleet/api-auth.header"
UNIT = "sparkfleet-serve.service"


def parse_metrics(text: str) -> dict[str, float]:
    """running, waiting and tokens (generated + prompt: a long prefill is progress too)."""
    sums = {"running": 0.0, "waiting": 0.0, "tokens": 0.0}
    names = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
             "vllm:generation_tokens_total": "tokens", "vllm:prompt_tokens_total": "tokens"}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            try:
                sums[names[name]] += float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
    return sums


def parse_pressure(psi: str, meminfo: str) -> tuple[float, float, float]:
    """PSI ``full avg10`` (percent), MemAvailable and MemTotal (GiB)."""
    full = 0.0
    for line in psi.splitlines():
        if line.startswith("full "):
            full = float(dict(f.split("=") for f in line.split()[1:])["avg10"])
    mem = {"MemAvailable:": 0.0, "MemTotal:": 0.0}
    for line in meminfo.splitlines():
        if line.split(" ", 1)[0] in mem:
            mem[line.split(" ", 1)[0]] = int(line.split()[1]) / 1024 / 1024
    return full, mem["MemAvailable:"], mem["MemTotal:"]


def decide(state: dict, sample: dict | None, now: float, args) -> tuple[dict, str | None, str]:
    """The next state and what to do: None, "wedge", "up". ``sample`` is None when the
    engine does not answer /metrics (starting, stopped, dead: HAProxy's checks and systemd
    see to that)."""
    state = dict(state)
    if sample is None:
        state.pop("tokens", None)
        return state, None, ""
    pending = sample["running"] + sample["waiting"]
    if state.get("agent", "up") != "up":  # taken out by us, (re)started since: back once it answers
        state.update(agent="up", reason="", since=now, tokens=sample["tokens"])
        return state, "up", "the engine answers again: back in the endpoint's rotation"
    if sample["tokens"] != state.get("tokens") or pending == 0:
        state.update(tokens=sample["tokens"], since=now)
        return state, None, ""
    stalled = now - state.get("since", now)
    if stalled >= args.wedge_timeout:
        why = (f"no progress: {pending:g} request(s) running or waiting and no token for {stalled:.0f} s "
               f"(wedge_timeout_s {args.wedge_timeout:g})")
        state.update(agent="down", reason="wedge", since=now)
        state.pop("tokens", None)
        return state, "wedge", why
    return state, None, ""


def memory_decision(state: dict, full: float, available: float, total: float, args) -> tuple[str | None, str]:
    """"stop", "start", "short" or None, from the host's memory pressure. The engine starts
    again only when its start would pass the preflight's own rule (its share of the memory
    and vLLM's start-up take fit in MemAvailable), so it does not start into the same
    squeeze; "short", once a stop: the pressure cleared, but something else still holds
    the memory a start needs (said, so a host left down tells why)."""
    if state.get("reason") == "memory":
        needed = args.gpu_memory_utilization * total + args.startup_gib
        if full < args.psi_full_resume and available >= needed:
            return "start", f"memory pressure cleared (PSI full avg10 {full:g}%, MemAvailable {available:.1f} GiB)"
        if full < args.psi_full_resume and not state.get("short"):
            return "short", (f"memory pressure cleared, but MemAvailable {available:.1f} GiB is under the "
                             f"{needed:.1f} GiB a start needs (gpu_memory_utilization x MemTotal + "
                             f"engine_startup_memory_gib): the engine stays stopped until that is free; find "
                             "what holds it with `ps aux --sort=-rss | head`")
        return None, ""
    if full >= args.psi_full_stop or available < args.stop_available_gib:
        return "stop", (f"memory pressure: PSI full avg10 {full:g}% (stop at {args.psi_full_stop:g}%), MemAvailable "
                        f"{available:.1f} GiB (stop under {args.stop_available_gib:g})")
    return None, ""


# --- the host ------------------------------------------------------------------------------


def _read(path: str) -> str:
    try:
        with open(path) as fh:
            return fh.read()
    except OSError:
        return ""


def _write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def _get(port: int, path: str, timeout: float) -> str | None:
    """The body of a 2xx answer to GET ``path`` on the engine's loopback port, else None.
    HTTP/1.0 on a socket, which is all a loopback GET needs."""
    header = _read(AUTH_HEADER).strip()  # 0600 root: never argv, never logged
    request = f"GET {path} HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n" + (f"{header}\r\n" if header else "") + "\r\n"
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as conn:
            conn.sendall(request.encode())
            chunks = []
            while chunk := conn.recv(65536):
                chunks.append(chunk)
    except OSError:
        return None
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    status, *headers = head.split(b"\r\n")
    if not status.split()[1:2] or not status.split()[1].startswith(b"2"):
        return None
    # uvicorn chunks an answer that has no Content-Length (vLLM's /metrics), to HTTP/1.0 too.
    if any(h.replace(b" ", b"").lower() == b"transfer-encoding:chunked" for h in headers):
        body = _dechunked(body)
    return None if body is None else body.decode(errors="replace")


def _dechunked(body: bytes) -> bytes | None:
    """A chunked body's bytes (None when it is cut short or malformed)."""
    pieces = []
    while True:
        size, _, body = body.partition(b"\r\n")
        try:
            n = int(size.split(b";", 1)[0], 16)
        except ValueError:
            return None
        if n == 0:
            return b"".join(pieces)
        if len(body) < n + 2:
            return None
        pieces.append(body[:n])
        body = body[n + 2:]


def event(kind: str, message: str) -> None:
    line = f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {kind} {message}"
    print(line, flush=True)  # the watchdog unit's journal
    os.makedirs(os.path.dirname(EVENTS), exist_ok=True)
    with open(EVENTS, "a") as fh:
        fh.write(line + "\n")


def drained(reason: str, settle_s: float) -> None:
    """Out of the endpoint's rotation before the engine goes: HAProxy asks the agent every
    second, so it has seen ``down`` after ``settle_s``."""
    _write(AGENT, f"down#{reason}\n")
    time.sleep(settle_s)


def recent_restarts(window_s: float, now: float) -> int:
    count = 0
    for line in _read(EVENTS).splitlines():
        parts = line.split(" ", 2)
        if len(parts) > 1 and parts[1] == "wedge":
            try:
                when = calendar.timegm(time.strptime(parts[0], "%Y-%m-%dT%H:%M:%SZ"))
            except ValueError:
                continue
            count += now - when <= window_s
    return count


def systemctl(*args: str) -> None:
    subprocess.run(["systemctl", *args, UNIT], check=False)


def notify(message: str) -> None:
    """sd_notify(3) on the socket systemd gives a Type=notify service; nothing by hand."""
    where = os.environ.get("NOTIFY_SOCKET", "")
    if not where:
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as conn:
        conn.sendto(message.encode(), "\0" + where[1:] if where.startswith("@") else where)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--every", type=float, default=None, help="look every so many seconds (default: once)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--wedge-timeout", type=float, default=300)
    p.add_argument("--max-restarts", type=int, default=3)
    p.add_argument("--restart-window", type=float, default=3600)
    p.add_argument("--psi-full-stop", type=float, default=10.0)
    p.add_argument("--psi-full-resume", type=float, default=1.0)
    p.add_argument("--stop-available-gib", type=float, default=8.0)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.82)
    p.add_argument("--startup-gib", type=float, default=1.5)  # engine_startup_memory_gib
    p.add_argument("--settle", type=float, default=2.0)
    p.add_argument("--psi", default="/proc/pressure/memory")
    p.add_argument("--meminfo", default="/proc/meminfo")
    args = p.parse_args(argv)
    if args.every is None:
        look(args)
        return 0
    notify("READY=1")
    while True:
        began = time.monotonic()
        look(args)
        notify("WATCHDOG=1")
        time.sleep(max(0.0, args.every - (time.monotonic() - began)))


def look(args) -> None:
    """One look: memory first, then progress; acts, and keeps its figures in STATE."""
    now = time.time()
    try:
        state = json.loads(_read(STATE) or "{}")
    except ValueError:
        state = {}
    if not os.path.exists(AGENT):
        _write(AGENT, "up\n")

    if state.get("reason") == "memory" and _get(args.port, "/metrics", timeout=5) is not None:
        # Started meanwhile by a deploy or by hand: it rejoins once it answers, as after any start.
        event("memory", "the engine was started again (by a deploy or by hand) after the memory stop")
        state.update(reason="starting")
        state.pop("short", None)
    full, available, total = parse_pressure(_read(args.psi), _read(args.meminfo))
    action, why = memory_decision(state, full, available, total, args)
    if action == "stop":
        event("memory", f"{why}: drained and stopped the engine")
        drained("memory pressure", args.settle)
        systemctl("stop")
        state.update(agent="down", reason="memory", since=now)
        state.pop("tokens", None)
    elif action == "short":
        event("memory", why)
        state.update(short=True)
    elif action == "start":
        event("memory", f"{why}: started the engine again")
        state.pop("short", None)
        systemctl("reset-failed")  # systemd's start limit counts this start too
        systemctl("start")
        state.update(reason="starting")  # in rotation again once it answers
    elif state.get("reason") != "memory":
        text = _get(args.port, "/metrics", timeout=5)
        sample = parse_metrics(text) if text is not None else None
        if state.get("agent", "up") != "up" and _get(args.port, "/v1/models", timeout=5) is None:
            sample = None  # not back yet
        state, action, why = decide(state, sample, now, args)
        if action == "up":
            _write(AGENT, "up\n")
            event("up", why)
        elif action == "wedge":
            if recent_restarts(args.restart_window, now) >= args.max_restarts:
                event("gave-up", f"{why}; {args.max_restarts} restarts within {args.restart_window:g} s already: "
                                 "the engine is left stopped (a restart loop ends in a hard reset); the next deploy "
                                 "starts it")
                drained("wedged, restarts exhausted", args.settle)
                systemctl("stop")
                state.update(reason="gave-up")
            else:
                event("wedge", f"{why}: drained and restarted the engine")
                drained("wedged", args.settle)
                systemctl("reset-failed")
                systemctl("restart")
    _write(STATE, json.dumps(state) + "\n")


if __name__ == "__main__":
    sys.exit(main())
