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

After a kill earlyoom runs :data:`HOOK`: it says why in the serving unit's journal (so
``journalctl -u sparkfleet-serve`` and a failing READY show it), keeps a line in
:data:`OOM_LOG` (the next deploy prints the new ones), and ends the serving container when
the killed process was the engine's kind, so that systemd restarts a whole engine.
"""

from __future__ import annotations

import hashlib
import io
import shlex

from pyinfra import host, logger
from pyinfra.api import FactBase, FileUploadCommand, operation
from pyinfra.facts.files import Sha256File
from pyinfra.operations import systemd

from sparkfleet.config import Settings
from sparkfleet.facts import CommandAvailable
from sparkfleet.hostpaths import CONTAINER, ETC_DIR, MIRROR_APT_KEYRING, UNIT

EARLYOOM_DEFAULTS = "/etc/default/earlyoom"
EARLYOOM_DROPIN = "/etc/systemd/system/earlyoom.service.d/sparkfleet.conf"
HOOK = "/usr/local/lib/sparkfleet/oom-killed"
OOM_LOG = "/var/lib/sparkfleet/oom-guard.log"
ARCHIVE_LIST = f"{ETC_DIR}/apt/archive.list"  # where earlyoom comes from with mirror_apt_repo
OOM_REPORTED = "/var/lib/sparkfleet/oom-guard.reported"  # lines of OOM_LOG the deploy has shown

#: Process names (comm) of the engine: vLLM's processes, serve.py's python.
ENGINE_NAMES = r"(^|/)(python3?(\.[0-9]+)?|vllm|VLLM::.*)$"
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


def _hook(settings: Settings) -> str:
    gib = f"{settings.oom_guard_min_available_gib:g}"
    return f"""#!/bin/sh
# sparkfleet: run by earlyoom after it killed a process (EARLYOOM_PID, EARLYOOM_NAME).
msg="OOM guard: earlyoom killed $EARLYOOM_NAME (pid $EARLYOOM_PID): MemAvailable fell under {gib} GiB"
printf 'MESSAGE=%s\\nPRIORITY=2\\nSYSLOG_IDENTIFIER=sparkfleet-oom-guard\\nOBJECT_SYSTEMD_UNIT={UNIT}\\n' "$msg" \\
    | logger --journald 2>/dev/null || logger -t sparkfleet-oom-guard -p user.crit "$msg"
mkdir -p {OOM_LOG.rsplit('/', 1)[0]} && echo "$(date -u +%FT%TZ) $msg" >> {OOM_LOG}
# A vLLM with a killed process does not serve: end the container, systemd restarts the engine.
if echo "$EARLYOOM_NAME" | grep -Eq {shlex.quote(ENGINE_NAMES)}; then
    docker kill --signal KILL {CONTAINER} >/dev/null 2>&1 || true
fi
"""


def earlyoom_args(settings: Settings) -> str:
    kib = int(settings.oom_guard_min_available_gib * 1024 * 1024)
    return (
        f"-M {kib} -s 100,100 -r 60 -p -N {HOOK} "
        f"--prefer {shlex.quote(ENGINE_NAMES)} --avoid {shlex.quote(NEVER_KILL)}"
    )


@operation()
def installed(settings: Settings):
    """
    Install earlyoom from the distribution's archives when it is missing.

    + settings: validated settings (``mirror_apt_repo``/``mirror_apt_key_url``: a repository
      for the archive packages the deploy installs; None: the host's own archives)
    """
    if host.get_fact(CommandAvailable, program="earlyoom"):
        host.noop("earlyoom is installed")
        return
    q = shlex.quote
    if settings.mirror_apt_repo:
        # A list of its own outside sources.list.d, used for this install only: the host's
        # apt configuration stays as it was (two lists naming one URL with different
        # keyrings would break every later apt run).
        only = (f"-o Dir::Etc::sourcelist={ARCHIVE_LIST} -o Dir::Etc::sourceparts=- "
                "-o APT::Get::List-Cleanup=0")
        yield f"curl -fsSL --retry 3 {q(settings.mirror_apt_key_url)} -o {MIRROR_APT_KEYRING}"
        yield f"mkdir -p {ARCHIVE_LIST.rsplit('/', 1)[0]}"
        yield f"echo {q(f'deb [signed-by={MIRROR_APT_KEYRING}] {settings.mirror_apt_repo} /')} > {ARCHIVE_LIST}"
        yield f"apt-get update {only}"
    else:
        only = ""
        yield "apt-get update"
    # Our /etc/default/earlyoom replaces the package's; keep it on upgrades.
    yield f"DEBIAN_FRONTEND=noninteractive apt-get install -y {only} -o Dpkg::Options::=--force-confold earlyoom"


@operation()
def file_content(path: str, content: str, mode: str = "644"):
    """
    ``path`` holds ``content`` (compared by hash).

    + path: the file on the host
    + content: its text
    + mode: its mode
    """
    if host.get_fact(Sha256File, path=path) == hashlib.sha256(content.encode()).hexdigest():
        host.noop(f"{path} is up to date")
        return
    yield f"mkdir -p {shlex.quote(path.rsplit('/', 1)[0])}"
    yield FileUploadCommand(io.BytesIO(content.encode()), path)
    yield f"chmod {mode} {shlex.quote(path)}"


class NewKills(FactBase["dict"]):
    """The guard's kills the deploy has not reported yet: {"lines": [...], "total": n}."""

    @staticmethod
    def default():
        return {"lines": [], "total": 0}

    def command(self) -> str:
        return (
            f"n=$(cat {OOM_REPORTED} 2>/dev/null || echo 0); t=$(cat {OOM_LOG} 2>/dev/null | wc -l); "
            f'echo "total $t"; [ "$t" -gt "$n" ] && tail -n $((t - n)) {OOM_LOG}; true'
        )

    def process(self, output):
        total = int(output[0].split()[1]) if output and output[0].startswith("total ") else 0
        return {"lines": [line.strip() for line in output[1:] if line.strip()], "total": total}


@operation()
def reported():
    """Say on the deploy's output what the guard killed since the last deploy (once)."""
    kills = host.get_fact(NewKills)
    if not kills["lines"]:
        host.noop("the OOM guard killed nothing since the last deploy")
        return
    for line in kills["lines"]:
        logger.warning(f"{host.print_prefix}{line}")
    yield f"echo {kills['total']} > {OOM_REPORTED}"


def configured(settings: Settings) -> None:
    """earlyoom installed, configured for the engine and running; restarted only when its
    configuration changed (a drop-in change also needs a daemon-reload: only then)."""
    package = installed(name="OOM guard: earlyoom installed", settings=settings)
    hook = file_content(name="OOM guard: kill hook", path=HOOK, content=_hook(settings), mode="755")
    args = file_content(
        name="OOM guard: earlyoom settings", path=EARLYOOM_DEFAULTS,
        content=f'# Rendered by sparkfleet (oomguard.py).\nEARLYOOM_ARGS="{earlyoom_args(settings)}"\n',
    )
    dropin = file_content(name="OOM guard: earlyoom unit drop-in", path=EARLYOOM_DROPIN, content=DROPIN)
    systemd.daemon_reload(name="OOM guard: systemd reload for the drop-in", _if=dropin.did_change)
    systemd.service(name="OOM guard: earlyoom running", service="earlyoom.service", running=True, enabled=True)
    systemd.service(
        name="OOM guard: earlyoom restarted for its new settings", service="earlyoom.service", restarted=True,
        _if=lambda: any(op.did_change() for op in (package, hook, args, dropin)),
    )
    reported(name="OOM guard: kills since the last deploy")
