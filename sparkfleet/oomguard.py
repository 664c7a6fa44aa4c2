"""The OOM guard: earlyoom kills the engine, not sshd or the host, when memory runs out.

A Spark's CPU and GPU share its 128 GiB: when vLLM's profiling overshoots
``gpu_memory_utilization`` the kernel's OOM killer comes too late and the host can
freeze. earlyoom (Debian/Ubuntu archives) acts on MemAvailable, the number the seeds'
monitor watched: under ``oom_guard_min_available_gib`` it sends SIGTERM (SIGKILL at half
that) to the process it picks, the engine first (``--prefer``), never sshd, systemd,
dockerd or containerd (``--avoid``). Swap is ignored (``-s 100,100``): on unified memory
swapping is what stalls the host. systemd-oomd would fit less: it acts on pressure (PSI)
per cgroup, not on MemAvailable, and the serving container's processes live in docker's
scope, not in the unit's cgroup, so killing the unit's cgroup would leave the engine.

After a kill earlyoom runs :data:`~sparkfleet.hostpaths.OOM_HOOK`: it says why in the serving unit's journal (so
``journalctl -u sparkfleet-serve`` and a failing READY show it), keeps a line in
:data:`~sparkfleet.hostpaths.OOM_LOG` (the next deploy prints the new ones), and ends the serving container when
the killed process was the engine's kind, so that systemd restarts a whole engine.
"""

from __future__ import annotations

import re
import shlex

from pyinfra.api import deploy
from pyinfra.operations import systemd

from sparkfleet import apt, snapshot, tasks
from sparkfleet.config import Settings
from sparkfleet.hostpaths import (
    CONTAINER,
    EARLYOOM_DEFAULTS,
    EARLYOOM_DROPIN,
    OOM_HOOK,
    OOM_LOG,
    OOM_REPORTED,
    UNIT,
)

#: vLLM names its engine core, workers and API servers ``<prefix>::<role>`` (setproctitle,
#: which sets comm too); this is vLLM's default, VLLM_PROCESS_NAME_PREFIX in vllm_env another.
VLLM_PREFIX = "VLLM"
#: A process name (comm) holds 15 characters: VLLM::EngineCore is VLLM::EngineCor.
COMM_LEN = 15


def engine_names(prefix: str = VLLM_PREFIX) -> str:
    """earlyoom's regex for the engine's process names (comm, what earlyoom matches): the
    API server as ``vllm serve`` starts it (the console script: comm ``vllm``, as the
    testbed's engine) and vLLM's own processes (``VLLM::EngineCor``, ``VLLM::Worker_TP0``).
    Not python3: that is also olah on the mirror, apt's hooks and any tool of the host, and
    serve.py is python3 only until it execs vllm."""
    return f"^(vllm|{re.escape(f'{prefix}::'[:COMM_LEN])}.*)$"


ENGINE_NAMES = engine_names()
NEVER_KILL = r"(^|/)(init|systemd|systemd-.*|sshd|dockerd|containerd|containerd-shim.*|earlyoom|journald)$"

#: The packaged unit runs earlyoom as a dynamic user with a read-only system; the hook
#: writes the journal entry and stops the container, which needs root.
DROPIN = """# sparkfleet: the OOM hook logs to the serving unit's journal and stops its container.
[Service]
DynamicUser=false
User=root
ProtectSystem=full
TasksMax=64
MemoryMax=200M
"""


def hook(min_available_gib: float, engine: str = ENGINE_NAMES) -> str:
    return f"""#!/bin/sh
# sparkfleet: run by earlyoom after it killed a process (EARLYOOM_PID, EARLYOOM_NAME).
msg="OOM guard: earlyoom killed $EARLYOOM_NAME (pid $EARLYOOM_PID): MemAvailable fell under {min_available_gib:g} GiB"
printf 'MESSAGE=%s\\nPRIORITY=2\\nSYSLOG_IDENTIFIER=sparkfleet-oom-guard\\nOBJECT_SYSTEMD_UNIT={UNIT}\\n' "$msg" \\
    | logger --journald 2>/dev/null || logger -t sparkfleet-oom-guard -p user.crit "$msg"
mkdir -p {OOM_LOG.rsplit('/', 1)[0]} && echo "$(date -u +%FT%TZ) $msg" >> {OOM_LOG}
# A vLLM with a killed process does not serve: end the container, systemd restarts the engine.
if echo "$EARLYOOM_NAME" | grep -Eq {shlex.quote(engine)}; then
    docker kill --signal KILL {CONTAINER} >/dev/null 2>&1 || true
fi
"""


def earlyoom_args(min_available_gib: float, engine: str = ENGINE_NAMES) -> str:
    kib = int(min_available_gib * 1024 * 1024)
    return (
        f"-M {kib} -s 100,100 -r 60 -p -N {OOM_HOOK} "
        f"--prefer {shlex.quote(engine)} --avoid {shlex.quote(NEVER_KILL)}"
    )


def installed(apt_repo: str | None, apt_key_url: str | None, **op_args):
    """
    An operation: earlyoom installed from the distribution's archives when it is missing.

    + apt_repo, apt_key_url: a repository to take it from and its signing key
      (``apt_repo``/``apt_key_url``); None: the host's own archives (Ubuntu universe)
    """
    # Our /etc/default/earlyoom replaces the package's; keep it on upgrades.
    return apt.installed(packages=["earlyoom"], apt_repo=apt_repo, apt_key_url=apt_key_url, keep_config=True,
                         **op_args)


@deploy("OOM guard")
def configured(settings: Settings) -> None:
    """earlyoom installed, configured for the engine and running; restarted only when its
    configuration changed (a drop-in change also needs a daemon-reload: only then)."""
    gib = settings.oom_guard_min_available_gib
    engine = engine_names(settings.vllm_env.get("VLLM_PROCESS_NAME_PREFIX") or VLLM_PREFIX)
    snapshot.expect(programs=["earlyoom"])
    package = installed(name="earlyoom installed", apt_repo=settings.apt_repo, apt_key_url=settings.apt_key_url)
    kill_hook = snapshot.file(OOM_HOOK, hook(gib, engine), mode="755", name="kill hook")
    args = snapshot.file(EARLYOOM_DEFAULTS, f'# Rendered by sparkfleet (oomguard.py).\nEARLYOOM_ARGS="{earlyoom_args(gib, engine)}"\n',
                         name="earlyoom settings")
    dropin = snapshot.file(EARLYOOM_DROPIN, DROPIN, name="earlyoom unit drop-in")
    systemd.daemon_reload(name="systemd reload for the drop-in", _if=dropin.did_change)
    snapshot.service("earlyoom.service", name="earlyoom running")
    systemd.service(
        name="earlyoom restarted for its new settings", service="earlyoom.service", restarted=True,
        _if=lambda: any(op.did_change() for op in (package, kill_hook, args, dropin)),
    )
    tasks.events_reported(name="kills since the last deploy", log=OOM_LOG, reported=OOM_REPORTED, prefix="",
                          nothing="the OOM guard killed nothing since the last deploy")
