"""The stack under the engine: the NVIDIA driver, the container toolkit, Docker and the kernel.

Their packages are data (``stack_versions``: component -> {apt package: version}) and are
held with apt's own means (``apt-mark hold``): unattended-upgrades and ``apt-get upgrade``
skip a held package, so nothing moves the stack behind the fleet's back (a DGX OS kernel
update broke NCCL between two Sparks; a driver userspace update without a reboot fails
every new GPU container). A package the host does not have is not ours to install; a
declared version the host does not run is drift, which ``sparkfleet status`` shows.

One question per host (:class:`StackPackages`: ``dpkg-query``, whose status says hold)
serves the deploy and the status alike: the deploy reads it with the host's snapshot
(sparkfleet/snapshot.py), status in its one command.
"""

from __future__ import annotations

import shlex
import time
from dataclasses import replace
from functools import partial

import gevent
from pyinfra import host, logger, state
from pyinfra.api import FactBase, deploy, operation
from pyinfra.api.exceptions import OperationError
from pyinfra.facts.server import KernelVersion

from sparkfleet import endpoint, link, remote, rollout, snapshot
from sparkfleet.config import Settings
from sparkfleet.facts import NOTE_BOOT
from sparkfleet.gpu import NVML_MISMATCH, Gpu
from sparkfleet.hostpaths import LAST_GOOD_DIR, STARTED_FILE, UNIT
from sparkfleet.pairs import Pair
from sparkfleet.preflight import GB10_NAME

#: Components whose new version runs only after a reboot: a new kernel boots, and a new
#: driver's kernel module must be the one loaded (else NVML's driver/library mismatch).
REBOOT_COMPONENTS = ("driver", "kernel")
#: How long a rebooting host may take to answer SSH on its new boot (a Spark: ~2 min).
REBOOT_TIMEOUT_S = 600
#: GRUB's default while a kernel upgrade is undone: the kernel the host ran before it.
#: Going back reinstalls the kernel's previous meta-package, but the new image stays
#: installed and GRUB boots the newest; update-grub reads /etc/default/grub.d after
#: /etc/default/grub, so this file alone chooses, and removing it restores the newest.
KERNEL_PIN = "/etc/default/grub.d/99-sparkfleet-kernel.cfg"


class StackPackages(FactBase["dict[str, dict[str, object]]"]):
    """The listed packages the host has installed: {package: {"version": ..., "held": bool}}.

    dpkg's own status says both: the first letter of ``db:Status-Abbrev`` is the wanted
    state (``h``: held, what ``apt-mark hold`` sets), the second ``i`` once installed.
    """

    @staticmethod
    def default():
        return {}

    def command(self, packages: list[str]) -> str:
        names = " ".join(shlex.quote(p) for p in packages)
        # Unknown names are no error here: a host has docker.io or docker-ce, not both.
        return f"dpkg-query -W -f='${{db:Status-Abbrev}}|${{Package}}|${{Version}}\\n' {names} 2>/dev/null; true"

    def process(self, output):
        return parse_packages(output)


def parse_packages(lines) -> dict[str, dict[str, object]]:
    found: dict[str, dict[str, object]] = {}
    for line in lines:
        parts = line.strip().split("|")
        if len(parts) != 3 or len(parts[0]) < 2 or parts[0][1] != "i":
            continue  # not installed (un, rc...): nothing to hold
        found[parts[1]] = {"version": parts[2], "held": parts[0][0] == "h"}
    return found


def packages(settings: Settings) -> list[str]:
    """Every package the data lists, in its order."""
    return [p for component in settings.stack_versions.values() for p in component]


def declared(settings: Settings) -> dict[str, str]:
    """The packages whose version the data declares: {package: version}."""
    return {p: v for component in settings.stack_versions.values() for p, v in component.items() if v is not None}


def drift(settings: Settings, have: dict[str, dict[str, object]]) -> list[str]:
    """How the host differs from the data: a declared version it does not run, a package not held."""
    found = []
    for package, version in declared(settings).items():
        running = (have.get(package) or {}).get("version")
        if running != version:
            found.append(f"{package} {running or 'not installed'}, declared {version}")
    found += [f"{p} {have[p]['version']} not held" for p in packages(settings) if p in have and not have[p]["held"]]
    return found


@operation()
def packages_held(names: list[str]):
    """
    Hold every one of ``names`` the host has installed (``apt-mark hold``).

    + names: the stack's apt packages
    """
    have = snapshot.fact(StackPackages, packages=list(names))
    loose = [p for p in names if p in have and not have[p]["held"]]
    if not loose:
        host.noop(f"the stack's {len(have)} installed package(s) are held")
        return
    yield "apt-mark hold " + " ".join(shlex.quote(p) for p in loose)


@deploy("Stack")
def held(settings: Settings) -> None:
    """The stack's installed packages held, so no unattended upgrade moves them."""
    names = packages(settings)
    if names:
        # Declared while the deploy plans, before the preflight: its one read of the host answers this too.
        snapshot.expect(facts=[(StackPackages, {"packages": names})])
        packages_held(name="driver, toolkit, Docker, kernel held (apt-mark hold)", names=names)


# --- a declared upgrade, rolled through the gate ------------------------------------------


def moves(settings: Settings, have: dict[str, dict[str, object]]) -> dict[str, tuple[str | None, str]]:
    """{package: (the version the host runs or None, the declared one)} where they differ."""
    return {p: ((have.get(p) or {}).get("version"), v) for p, v in declared(settings).items()
            if (have.get(p) or {}).get("version") != v}


def needs_reboot(settings: Settings, packages_: list[str]) -> bool:
    """A moved package of the driver or the kernel runs only after a reboot."""
    return any(p in settings.stack_versions.get(c, {}) for c in REBOOT_COMPONENTS for p in packages_)


def install_command(versions: dict[str, str]) -> str:
    """apt-get install of exact versions, past their hold, held again after."""
    pinned = " ".join(shlex.quote(f"{p}={v}") for p, v in versions.items())
    names = " ".join(shlex.quote(p) for p in versions)
    # The host's own sources (DGX OS', NVIDIA's): refreshed whole, as the versions come from any.
    return ("apt-get update -qq; DEBIAN_FRONTEND=noninteractive apt-get install -y -q --allow-downgrades "
            f"--allow-change-held-packages -o Dpkg::Options::=--force-confold {pinned} && apt-mark hold {names}")


def _boot_id(target) -> str:
    return "".join(remote.run(target, "cat /proc/sys/kernel/random/boot_id", timeout=30).stdout).strip()


def _rebooted(target) -> str | None:
    """Reboot and wait for SSH on a new boot: None, or why not."""
    before = _boot_id(target)
    remote.run(target, "( sleep 1 && systemctl reboot ) </dev/null >/dev/null 2>&1 &", timeout=30)
    gevent.sleep(10)
    target.disconnect()
    deadline = time.monotonic() + REBOOT_TIMEOUT_S
    while time.monotonic() < deadline:
        target.connect(show_errors=False)
        if target.connected and _boot_id(target) not in ("", before):
            remote.run(target, NOTE_BOOT, timeout=30)  # this deploy's reboot: no later one reports it
            return None
        gevent.sleep(5)
    return f"no new boot answered SSH within {REBOOT_TIMEOUT_S} s"


def boot_kernel_command(release: str | None) -> str:
    """GRUB's default set to ``release``'s entry (None: the newest again, GRUB's own
    default), then update-grub. Fails, naming why, where GRUB has no entry for it."""
    if release is None:
        return f"if [ -e {KERNEL_PIN} ]; then rm -f {KERNEL_PIN} && update-grub; fi"
    cfg, rel = "/boot/grub/grub.cfg", shlex.quote(release)
    # Ubuntu's entries: 'gnulinux-<release>-advanced-<fs>', inside the submenu
    # 'gnulinux-advanced-<fs>' (GRUB_DEFAULT then names both) unless GRUB_DISABLE_SUBMENU.
    return (
        f"[ -r {cfg} ] || {{ echo 'no {cfg}: not booted by GRUB' >&2; exit 1; }}; "
        f"sub=$(sed -n \"s/^submenu .*'\\(gnulinux-advanced-[^']*\\)'.*/\\1/p\" {cfg} | head -n 1); "
        f"entry=$(grep -o \"'gnulinux-[^']*-advanced-[^']*'\" {cfg} | tr -d \"'\" | while read -r id; do "
        f"case \"$id\" in \"gnulinux-\"{rel}\"-advanced-\"*) echo \"$id\"; break;; esac; done); "
        f"[ -n \"$entry\" ] || {{ echo \"GRUB lists no entry for kernel \"{rel} >&2; exit 1; }}; "
        f"mkdir -p {KERNEL_PIN.rsplit('/', 1)[0]} && "
        f"printf '# sparkfleet: the kernel before an upgrade that was undone\\nGRUB_DEFAULT=\"%s\"\\n' "
        f"\"${{sub:+$sub>}}$entry\" > {KERNEL_PIN} && update-grub"
    )


def _booted(target, kernel: str | None) -> str | None:
    """After the reboot: the host runs ``kernel`` when one is named (going back)."""
    if not kernel:
        return None
    running = "".join(remote.run(target, "uname -r", timeout=30).stdout).strip()
    if running != kernel:
        return (f"the host booted kernel {running or '?'}, not {kernel} (the one before the upgrade): choose it "
                "in GRUB's menu, or install it as the newest, then deploy again")
    return None


def _switched(target, versions: dict[str, str], reboot: bool, kernel: str | None = "") -> str | None:
    """The host runs ``versions``: installed, then a reboot (driver, kernel) or a restart of
    the engine, whose new container is the first to use the new stack; then what the
    preflight asks of a GPU host: nvidia-smi answers a GB10 and Docker runs. ``kernel``:
    "" leaves GRUB alone, None boots the newest kernel (an upgrade), a release boots that
    one (going back), and the host must run it once up."""
    if not versions:
        return "no earlier version to go back to (the packages were new on this host)"
    done = remote.run(target, install_command(versions), timeout=1800)
    if not done.ok:
        return f"apt-get install {' '.join(f'{p}={v}' for p, v in versions.items())} failed: {' '.join(done.stderr)[-600:]}"
    if kernel != "":
        done = remote.run(target, boot_kernel_command(kernel), timeout=300)
        if not done.ok:
            return f"could not make GRUB boot {kernel or 'the newest kernel'}: {' '.join(done.stderr)[-300:]}"
    if reboot:
        problem = _rebooted(target) or _booted(target, kernel)
        if problem:
            return problem
    else:
        # Blocking: READY is then asked of the new container, never of the one it replaces;
        # try-restart: a host that does not serve (upgraded in place) is not started here.
        remote.run(target, f"systemctl reset-failed {UNIT} 2>/dev/null; systemctl try-restart {UNIT}", timeout=300)
    # Asked anew, not through the snapshot: what it read was the stack before this change.
    gpu = Gpu().process(remote.run(target, Gpu().command()).stdout) or {"name": ""}
    if "mismatch" in gpu:
        loaded = gpu["mismatch"]
        return (f"nvidia-smi answers {NVML_MISMATCH} after the upgrade (kernel module {loaded['kernel_module'] or '?'}, "
                f"library {loaded['library'] or '?'}), not {GB10_NAME}")
    if gpu["name"] != GB10_NAME:
        return f"nvidia-smi answers {gpu['name'] or 'nothing'!r} after the upgrade, not {GB10_NAME}"
    if not remote.run(target, "systemctl is-active docker").ok:
        return "docker is not active after the upgrade"
    return None


def change_of(settings: Settings, moved: dict[str, tuple[str | None, str]], kernel: str = "") -> rollout.Change:
    """The rollout's change: the declared versions; back: the versions the host ran (and,
    when a kernel package moved, ``kernel``: the release it ran, as GRUB's default)."""
    previous = {p: old for p, (old, _) in moved.items() if old is not None}
    reboot = needs_reboot(settings, list(moved))
    kernel_moves = _kernel_moves(settings, moved)
    listed = ", ".join(f"{p} {old or '-'} -> {new}" for p, (old, new) in moved.items())
    return rollout.Change(
        kind="stack", what=f"upgrade the stack ({listed}){' and reboot' if reboot else ''}",
        back="the previous versions (" + (", ".join(f"{p} {v}" for p, v in previous.items()) or "-") + ")",
        apply=partial(_switched, versions={p: new for p, (_, new) in moved.items()}, reboot=reboot,
                      kernel=None if kernel_moves else ""),
        reboots=reboot,
        # Reinstalled from the host's sources, which must still list them (README: what cannot go back).
        undo=partial(_switched, versions=previous, reboot=reboot, kernel=kernel if kernel_moves else ""),
    )


def _kernel(settings: Settings, moved: dict[str, tuple[str | None, str]]) -> str:
    """The kernel release the host runs now, when a kernel package moves (else ""). One
    uname cannot read is "unknown": GRUB has no entry for it, so going back stops there."""
    return (snapshot.fact(KernelVersion) or "unknown") if _kernel_moves(settings, moved) else ""


def _kernel_moves(settings: Settings, moved: dict[str, tuple[str | None, str]]) -> bool:
    return any(p in settings.stack_versions.get("kernel", {}) for p in moved)


def _in_place(state, host_, change: rollout.Change) -> bool:  # pyinfra passes state, host
    """A host that does not serve (or rollout=all): the change, no drain and no gate."""
    problem = change.apply(host_)
    if problem:
        raise OperationError(f"{change.what}: {problem}")
    return True


@operation()
def versions_declared(settings: Settings, have: dict[str, dict[str, object]], rolling: bool, pair: Pair | None = None):
    """
    The host runs the declared versions of the stack: a serving host in its turn of the
    rollout (drain, upgrade, reboot when the driver or kernel moved, READY, gate, back in
    rotation; a failure goes back to the previous versions and stops the rollout). A pair's
    members change together in its head's turn: its engine spans them.

    + settings: the host's settings
    + have: the stack's packages the host has (:class:`StackPackages`)
    + rolling: the host serves and rolls (rollout.applies)
    + pair: the host's pair, if any
    """
    moved = moves(settings, have)
    if not moved:
        host.noop("the stack runs the declared versions")
        return
    change = change_of(settings, moved, _kernel(settings, moved))
    if pair is not None:  # the gate measures the pair's link again, on the new driver and toolkit
        change = replace(change, proven=link.proof(settings, pair))
    if rolling:  # its turn was planned with the deploy (upgraded)
        yield remote.callback(rollout.rolled, settings, None, pair, change)
        return
    logger.info(f"{host.print_prefix}{change.what} (not serving: no drain, no gate)")
    yield remote.callback(_in_place, change)


@deploy("Stack")
def upgraded(settings: Settings, pair: Pair | None = None) -> None:
    """The declared versions, rolled through the gate (nothing to do while none is declared)."""
    if not declared(settings):
        return
    have = snapshot.fact(StackPackages, packages=packages(settings))
    snapshot.expect(texts=[STARTED_FILE, f"{LAST_GOOD_DIR}/serving.rev"], units=[UNIT])
    rolling = settings.serving and rollout.applies(settings, snapshot.unit(UNIT), snapshot.first_line(STARTED_FILE),
                                                   snapshot.first_line(f"{LAST_GOOD_DIR}/serving.rev"))
    moved = moves(settings, have)
    if rolling and moved:
        if needs_reboot(settings, list(moved)) and endpoint.endpoint_name(state) == host.name:
            logger.warning(f"{host.print_prefix}serves the fleet endpoint: its reboot takes the endpoint down until "
                           "it is back (a Spark: ~2 min), so it rolls last, once every other host passed the gate; "
                           "upgrade it at a quiet time, or give the endpoint a host of its own (fleet_endpoint)")
        # While the deploy is prepared, every host that rolls registers: with `-y` pyinfra
        # runs no planning pass, and a turn must know every host of the batches before it.
        rollout.planned(settings, pair, change=change_of(settings, moved, _kernel(settings, moved)))
    versions_declared(name="the stack runs the declared versions", settings=settings, have=have, rolling=rolling,
                      pair=pair)


# --- sparkfleet status --------------------------------------------------------------------


def status_command(settings: Settings) -> str:
    """The shell command whose output :func:`status_of` reads (a section of status' one command):
    the stack's packages, the kernel that runs, the kernel images installed and GRUB's pin."""
    names = packages(settings)
    return "; ".join([
        StackPackages().command(names) if names else "true",
        'echo "kernel $(uname -r)"',
        "for f in /boot/vmlinuz-*; do [ -e \"$f\" ] && echo \"image ${f#/boot/vmlinuz-}\"; done",
        # The shell's own read, no program started (each costs a host a fork and an exec).
        f"[ -r {KERNEL_PIN} ] && while IFS= read -r l || [ -n \"$l\" ]; do case \"$l\" in "
        f'GRUB_DEFAULT=*) echo "pinned ${{l#GRUB_DEFAULT=}}";; esac; done < {KERNEL_PIN}; true',
    ])


def _release_key(release: str) -> list:
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in release.replace("-", ".").split(".")]


def status_of(lines: list[str], settings: Settings) -> dict[str, object]:
    """The host's stack packages, the kernel it runs and its drift from the data, for status'
    row. A newer kernel image than the one running is a reboot to come, unless GRUB is pinned
    to the one running (an upgrade that was undone: the new image stays installed)."""
    have = parse_packages(lines)
    said = [line.strip().split(" ", 1) for line in lines if " " in line.strip()]
    kernel = next((v for k, v in said if k == "kernel"), "")
    images = sorted((v for k, v in said if k == "image"), key=_release_key)
    pinned = any(k == "pinned" for k, _ in said)
    found = drift(settings, have)
    if kernel and images and images[-1] != kernel and not pinned:
        found.append(f"kernel {images[-1]} installed, {kernel} runs: it boots at the next reboot")
    return {"stack": have, "stack_drift": found, "kernel": kernel, "kernel_pinned": pinned}
