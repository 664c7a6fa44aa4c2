"""The watchdog: the engine makes progress and the host keeps memory, or it leaves the fleet.

``/health`` stays 200 while a vLLM engine is stuck (vLLM #56824, #50011), and unified-memory
pressure freezes or hard-resets a Spark with no OOM kill (NVIDIA open-gpu-kernel-modules
#1358). Kept tools do the watching: ``sparkfleet-watchdog.service`` runs
``templates/sparkfleet-watchdog.py`` (the host's python3, stdlib), which looks every
``watchdog_interval_s`` and tells systemd after each look, so systemd's own watchdog ends a
look that hangs and starts it afresh. A look reads ``/metrics`` with the fleet key (0600
header file, never argv), PSI and MemAvailable, keeps its figures in ``/run`` and acts: a wedge drains and
restarts the engine (bounded: ``wedge_max_restarts``), memory pressure drains and stops
it cleanly, and starts it again once pressure clears. Draining is HAProxy's own
agent-check: ``sparkfleet-agent.socket`` (``Accept=yes``) answers ``up`` or
``down#<why>`` on ``watchdog_agent_port``, an operational state that leaves the rollout's
admin drain alone. Every event is a line in :data:`~sparkfleet.hostpaths.WATCHDOG_LOG`:
the next deploy prints the new ones, ``sparkfleet status`` the last.
"""

from __future__ import annotations

from pathlib import Path

from pyinfra import host, logger
from pyinfra.api import deploy, operation
from pyinfra.operations import systemd

from sparkfleet import snapshot, tasks
from sparkfleet.config import Settings
from sparkfleet.facts import NOTE_BOOT, BootReport, rebooted
from sparkfleet.hostpaths import (
    AGENT_ANSWER,
    AGENT_SERVICE,
    AGENT_SOCKET,
    UNIT,
    WATCHDOG_LOG,
    WATCHDOG_PROGRAM,
    WATCHDOG_REPORTED,
    WATCHDOG_TIMER,
    WATCHDOG_UNIT,
    systemd_path,
)

PROGRAM = Path(__file__).resolve().parents[1] / "templates" / "sparkfleet-watchdog.py"


def program_args(settings: Settings) -> str:
    """The look's settings, all non-secret (the key stays in its 0600 header file)."""
    return (f"--port {settings.port} --wedge-timeout {settings.wedge_timeout_s} "
            f"--max-restarts {settings.wedge_max_restarts} --restart-window {settings.wedge_restart_window_s} "
            f"--psi-full-stop {settings.memory_stop_psi_full_pct:g} "
            f"--stop-available-gib {settings.memory_stop_available_gib:g} "
            f"--gpu-memory-utilization {settings.gpu_memory_utilization:g} "
            f"--startup-gib {settings.engine_startup_memory_gib:g}")


def service_unit(settings: Settings) -> str:
    return f"""# Rendered by sparkfleet (watchdog.py): a look every {settings.watchdog_interval_s} s, one process for the host's life
# (a timer's oneshot per look cost ~25 ms of CPU and three journal lines each time).
[Unit]
Description=sparkfleet: engine progress and host memory watchdog
After={UNIT}

[Service]
Type=notify
ExecStart=/usr/bin/python3 {WATCHDOG_PROGRAM} --every {settings.watchdog_interval_s} {program_args(settings)}
# A look that hangs is ended and the watchdog started afresh: the engine answers within 5 s
# or not, a drain settles in seconds, so 120 s past the interval is a hang.
WatchdogSec={settings.watchdog_interval_s + 120}
Restart=always
RestartSec=5
# It is what acts under memory pressure: the last process to be killed for memory.
OOMScoreAdjust=-900

[Install]
WantedBy=multi-user.target
"""


def agent_socket(settings: Settings) -> str:
    return f"""# Rendered by sparkfleet (watchdog.py): HAProxy's agent-check asks here whether this
# member takes requests; the answer is the watchdog's ({AGENT_ANSWER}).
[Unit]
Description=sparkfleet: HAProxy agent-check answer

[Socket]
ListenStream={settings.watchdog_agent_port}
Accept=yes
MaxConnections=16

[Install]
WantedBy=sockets.target
"""


AGENT_UNIT = f"""# Rendered by sparkfleet (watchdog.py): one answer per connection.
[Unit]
Description=sparkfleet: HAProxy agent-check answer

[Service]
# No answer yet (first boot): HAProxy ignores an empty one and keeps its own checks.
ExecStart=-/bin/cat {AGENT_ANSWER}
StandardInput=socket
StandardOutput=socket
StandardError=null
DynamicUser=false
"""


@operation()
def boot_reported():
    """Say when the host booted since the last deploy (a reboot, or a hard reset under
    memory pressure), with the previous boot's last kernel and GPU errors (e.g. Xid)."""
    report = snapshot.fact(BootReport)
    if report["boot"] == report["seen"]:
        host.noop("the host has not rebooted since the last deploy")
        return
    said = rebooted(report)
    if said:  # not on the first deploy, which has seen no boot yet
        logger.warning(f"{host.print_prefix}{said}")
        for line in report["errors"]:
            logger.warning(f"{host.print_prefix}    {line}")
    yield NOTE_BOOT


@operation()
def _timer_gone(path: str):
    if snapshot.file_state(path) is None:
        host.noop(f"no {WATCHDOG_TIMER}")
        return
    yield f"systemctl disable --now {WATCHDOG_TIMER}; rm -f {path}; systemctl daemon-reload"


def timer_gone() -> None:
    """A host deployed when a timer started each look has that timer stopped and removed."""
    path = systemd_path(WATCHDOG_TIMER)
    snapshot.expect(files=[path])
    _timer_gone(path=path, name=f"{WATCHDOG_TIMER} gone (the watchdog looks on its own now)")


@deploy("Watchdog")
def configured(settings: Settings) -> None:
    """The program and its service running, the agent's socket in place and answering; the
    watchdog is restarted when its program or unit changed, the socket when its port did
    (a daemon-reload only when a unit changed)."""
    timer_gone()
    program = snapshot.file(WATCHDOG_PROGRAM, PROGRAM.read_text(), mode="755", name="watchdog program")
    service = snapshot.file(systemd_path(WATCHDOG_UNIT), service_unit(settings), name=f"systemd unit {WATCHDOG_UNIT}")
    agent = snapshot.file(systemd_path(AGENT_SERVICE), AGENT_UNIT, name=f"systemd unit {AGENT_SERVICE}")
    socket = snapshot.file(systemd_path(AGENT_SOCKET), agent_socket(settings), name=f"systemd unit {AGENT_SOCKET}")
    systemd.daemon_reload(name="systemd reload for the watchdog's units",
                          _if=lambda: any(op.did_change() for op in (service, agent, socket)))
    snapshot.service(AGENT_SOCKET, name="agent-check answering")
    systemd.service(name="agent-check on its new port", service=AGENT_SOCKET, restarted=True,
                    _if=socket.did_change)
    started = snapshot.service(WATCHDOG_UNIT, name="watchdog running")
    systemd.service(name="watchdog on its new program or settings", service=WATCHDOG_UNIT, restarted=True,
                    _if=lambda: (program.did_change() or service.did_change()) and not started.did_change())
    tasks.events_reported(name="watchdog events since the last deploy", log=WATCHDOG_LOG,
                          reported=WATCHDOG_REPORTED, prefix="watchdog: ",
                          nothing="the watchdog saw no wedge and no memory pressure since the last deploy")
    snapshot.expect(facts=[(BootReport, {})])  # read with the snapshot, not in a command of its own
    boot_reported(name="reboots since the last deploy, and why")


@deploy("Watchdog")
def stopped() -> None:
    """serving=false: no watchdog (it would start the engine again after memory pressure)."""
    timer_gone()
    snapshot.service(WATCHDOG_UNIT, running=False, enabled=False, name="watchdog stopped")
