"""Host preflight: is this a Spark that can hold and run the profile, before anything changes.

Facts are read while pyinfra plans, so they see the host as it was. A host that fails
gets one failing operation listing every problem with its fix; the other hosts go on.
A pair is one engine, so its preflight is the pair's: a member whose peer fails stops
too, naming the peer and its problems, before it changes anything. Each host is judged
once per run, by whichever member asks first (pyinfra reads the peer's facts over the
peer's own connection).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from pyinfra import host, logger, state
from pyinfra.api import operation
from pyinfra.context import ctx_host
from pyinfra.facts.docker import DockerContainer
from pyinfra.facts.files import File
from pyinfra.facts.server import Arch

from sparkfleet import credentials, endpoint, haproxy, hybrid, image, link, mirror, remote, service, snapshot, weights
from sparkfleet.config import Settings
from sparkfleet.facts import BootTarget, DockerAnswers, FreeSpace, Memory
from sparkfleet.fleet import fleet_settings, host_mirror, host_pair
from sparkfleet.gpu import Gpu
from sparkfleet.hostpaths import (
    AGENT_SOCKET,
    CONTAINER,
    HF_MIRROR_UNIT,
    REGISTRY_UNIT,
    SECRETS_ENV,
    UNIT,
)
from sparkfleet.perrun import once
from sparkfleet.ports import Firewall, Listeners, in_container, in_other_container

EMPTY_SHA256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"

GB10_NAME = "NVIDIA GB10"
GB10_COMPUTE_CAPABILITY = "12.1"
SPARK_ARCH = "aarch64"
GIB = 1024**3


# --- checks -------------------------------------------------------------------------


@dataclass
class Findings:
    problems: list[str] = field(default_factory=list)  # this host's, each with its fix
    warnings: list[str] = field(default_factory=list)
    summary: str = ""
    peers: dict[str, list[str]] = field(default_factory=dict)  # a pair peer's problems: they stop this host too

    @property
    def passed(self) -> bool:
        """Nothing stops this host: neither a problem of its own nor one of a pair peer."""
        return not self.problems and not self.peers


def _added(*needs: dict[str, float]) -> dict[str, float]:
    total: dict[str, float] = {}
    for need in needs:
        for path, gib in need.items():
            total[path] = total.get(path, 0.0) + gib
    return total


def still_needed(settings: Settings) -> dict[str, float]:
    """{host path: GiB} still to land on this host, as each step reports it.

    Only what this profile uses counts: no drafter for base/mtp, no download for a
    model_dir, the donor and build output only for a hybrid build; on the mirror host,
    its caches of what it fetches.
    """
    image_needs = image.disk_needs(settings)
    needs = _added(image_needs, weights.disk_needs(settings), hybrid.disk_needs(settings))
    # The mirror's registry keeps the image as the registry sends it: compressed.
    registry_gib = image.sizes(settings).compressed_gib if image_needs else 0.0
    return _added(needs, mirror.disk_needs(settings, registry_gib, needs.get(settings.hf_home, 0.0)))


def host_findings(settings: Settings) -> Findings:
    """Read this host's facts and judge them against what the steps say they still need:
    disk (``still_needed``) and the memory the service claims when it starts."""
    # Every question below, and the steps' own, in one read of the host (sparkfleet.snapshot).
    ports = listens(settings)
    snapshot.expect(facts=[(Arch, {}), (Gpu, {}), (Memory, {}), (BootTarget, {}), (Firewall, {}),
                           (Listeners, {"ports": sorted({p.port for p in ports})}),
                           (DockerContainer, {"object_id": CONTAINER}),
                           *image.reads(settings), *weights.reads(settings)],
                    files=[SECRETS_ENV], units=[UNIT, AGENT_SOCKET])
    needs = still_needed(settings)
    memory_share = service.memory_needed(settings)
    found = Findings()
    gate = found.warnings if settings.force else found.problems
    force_hint = "" if settings.force else " (or --data force=true to try anyway)"  # not when it is set

    arch = snapshot.fact(Arch)
    if arch != SPARK_ARCH:
        gate.append(f"processor is {arch or 'unknown'}, a DGX Spark is {SPARK_ARCH}{force_hint}")

    gpu = snapshot.fact(Gpu)
    if gpu is None:
        found.problems.append(
            "nvidia-smi does not answer: install the NVIDIA driver (DGX OS ships it) and reboot"
        )
    elif "mismatch" in gpu:
        found.problems.append(driver_mismatch_problem(gpu["mismatch"]))
    else:
        if gpu["name"] != GB10_NAME or gpu["compute_cap"] != GB10_COMPUTE_CAPABILITY:
            gate.append(
                f"GPU is {gpu['name']} (compute capability {gpu['compute_cap']}), the stack is built "
                f"for {GB10_NAME} ({GB10_COMPUTE_CAPABILITY}){force_hint}"
            )
        if not gpu["driver_version"] or gpu["driver_version"].startswith("["):
            found.problems.append("nvidia-smi reports no driver version: reinstall the NVIDIA driver")

    if not snapshot.fact(DockerAnswers, _ignore_errors=True):
        found.problems.append(
            "docker is missing or its daemon does not answer: install docker and run "
            "`systemctl enable --now docker`"
        )

    # Sum what lands on each filesystem: the image, the cache and a hybrid build may share one.
    per_mount: dict[str, tuple[int, float, list[str]]] = {}
    snapshot.expect(facts=[(FreeSpace, {"path": path}) for path, gib in needs.items() if gib > 0])
    for path, gib in needs.items():
        if gib <= 0:
            continue
        space = snapshot.fact(FreeSpace, path=path)
        free, total, paths = per_mount.get(space["mount"], (space["free"], 0.0, []))
        per_mount[space["mount"]] = (free, total + gib, paths + [path])
    for mount, (free, gib, paths) in per_mount.items():
        need = gib + settings.disk_margin_gib
        if free < need * GIB:
            found.problems.append(
                f"{mount} has {free / GIB:.1f} GiB free, {need:.1f} GiB needed for "
                f"{', '.join(paths)} (incl. {settings.disk_margin_gib:g} GiB margin): free space "
                "or point hf_home / docker's data-root at a bigger disk"
            )

    if settings.model_dir and not host.get_fact(File, path=f"{settings.model_dir}/config.json"):
        found.problems.append(
            f"model_dir {settings.model_dir} holds no checkpoint (no config.json): "
            "point model_dir at a checkpoint directory on this host"
        )

    if needs and image.disk_needs(settings):
        size = image.sizes(settings)
        if size.source.startswith("image_size_gib"):
            found.warnings.append(f"image size from {size.source}: {size.unpacked_gib:.1f} GiB unpacked assumed")

    key_file = credentials.api_key_path(settings)
    try:
        credentials.existing_api_key(settings.api_key, key_file)
    except credentials.NotYetMade:
        # A second checkout without the key would make a new one and re-key the fleet,
        # cutting off every client: stop instead.
        if (snapshot.file_state(SECRETS_ENV) or (0, "", None))[2] not in (None, EMPTY_SHA256):
            found.problems.append(
                f"this host already serves with an API key, and this checkout has none ({key_file} "
                "is missing): copy that file (0600) from the checkout that deployed the fleet, or "
                "give the key with --data api_key=..."
            )

    numbers = sorted({p.port for p in ports})
    holders = port_holders(
        lambda: (snapshot.fact(Listeners, ports=numbers),
                 snapshot.fact(DockerContainer, object_id=CONTAINER, _ignore_errors=True)),
        lambda: (host.get_fact(Listeners, ports=numbers),  # in this order: see port_holders
                 host.get_fact(DockerContainer, object_id=CONTAINER, _ignore_errors=True)))
    found.problems += port_problems(ports, holders, socket_ports(snapshot.unit(AGENT_SOCKET)))
    found.problems += firewall_problems(ports, snapshot.fact(Firewall))

    pair = host_pair()
    if pair:  # the ConnectX-7 cable, its netdevs and RoCE devices
        found.problems += link.problems(settings, pair)

    memory = snapshot.fact(Memory)
    if memory_share and memory:
        problem, warning = memory_findings(memory, memory_share, settings.engine_startup_memory_gib,
                                           snapshot.fact(BootTarget))
        if problem:
            found.problems.append(problem)
        if warning:
            found.warnings.append(warning)

    found.summary = (
        f"{arch}, {gpu['name'] or 'GPU unread' if gpu else 'no GPU'} "
        f"(cc {gpu['compute_cap'] if gpu else '-'}, driver {gpu['driver_version'] if gpu else '-'})"
    )
    return found


def driver_mismatch_problem(versions: dict[str, str]) -> str:
    """A driver updated without a reboot: the kernel module still loaded is the old one."""
    found = ", ".join(f"{what} {version}" for what, version in (("kernel module", versions.get("kernel_module")),
                                                               ("library", versions.get("library"))) if version)
    return (f"the NVIDIA driver was updated without a reboot ({found or 'versions unread'}): nvidia-smi says "
            "\"Failed to initialize NVML: Driver/library version mismatch\" and every new GPU container would "
            "fail: reboot the host (`sudo reboot`), then deploy again")


# --- ports and firewalls ------------------------------------------------------------------


@dataclass(frozen=True)
class Listen:
    """A TCP port this host will listen on, and what may already hold it."""

    port: int
    what: str  # what listens there, in words
    key: str  # the setting that moves it
    units: tuple[str, ...] = ()  # the systemd units whose processes are ours on it
    container: bool = False  # our serving container holds it
    agent_socket: bool = False  # systemd holds it for sparkfleet-agent.socket
    reached_from: str = "<fleet subnet>"  # who connects to it ("": this host only)


#: NVIDIA's DGX Spark playbooks run their own services on these ports of the same machines.
PLAYBOOK_PORTS = (8080, 8090)
LOOPBACK = ("127.0.0.1", "::1", "localhost")


def listens(settings: Settings) -> list[Listen]:
    """Every port this host will serve, by its roles: the engine (its API, not on a pair's
    headless ranks; a pair head's rendezvous), the watchdog's agent answer, the mirror's
    registry and HF mirror, the endpoint's front and Prometheus ports (its runtime API is a
    unix socket, :data:`sparkfleet.haproxy.ADMIN_SOCKET`: no port)."""
    pair = host_pair()
    has_endpoint = endpoint.endpoint_name(state) is not None
    found = []
    if not pair or not pair.headless:
        found.append(Listen(settings.port, "the engine's API", "port", container=True,
                            reached_from="" if str(settings.bind_address) in LOOPBACK else "<fleet subnet>"))
    if pair and pair.is_head:
        found.append(Listen(pair.port, "the pair's rendezvous (its head's engine)", "pair_master_port",
                            container=True, reached_from=settings.pair_subnet))
    found.append(Listen(settings.watchdog_agent_port, "the watchdog's agent-check answer", "watchdog_agent_port",
                        agent_socket=True, reached_from="<fleet endpoint's address>" if has_endpoint else ""))
    source = host_mirror()
    if source and source.is_self:
        found += [Listen(source.registry_port, "the mirror's image registry", "mirror_registry_port",
                         units=(REGISTRY_UNIT,)),
                  Listen(source.hf_port, "the mirror's HF mirror (olah)", "mirror_hf_port", units=(HF_MIRROR_UNIT,))]
    if endpoint.endpoint_name(state) == host.name:
        found += [Listen(settings.endpoint_port, "the fleet endpoint (HAProxy)", "endpoint_port",
                         units=(haproxy.UNIT,), reached_from="<clients' subnet>"),
                  Listen(settings.endpoint_metrics_port, "the fleet endpoint's Prometheus metrics",
                         "endpoint_metrics_port", units=(haproxy.UNIT,), reached_from="<clients' subnet>")]
    return found


def socket_ports(unit: dict) -> set[int]:
    """The ports a socket unit listens on now (its ``Listen``, while it is active)."""
    if unit.get("ActiveState") != "active":
        return set()
    return {int(port) for port in re.findall(r":(\d+) \(Stream\)", str(unit.get("Listen", "")))}


def _ours(listen: Listen, holder: dict, agent_listens: set[int]) -> bool:
    # While our agent socket listens on the port, nothing else can bind it: every holder is
    # systemd or a process it handed the socket (its accept helper, "(sd-accept)", wherever
    # its cgroup is at that moment; the agent's instances).
    return ((listen.container and bool(holder.get("container")))
            or str(holder.get("unit", "")) in listen.units
            or (listen.agent_socket and listen.port in agent_listens))


def port_holders(read: Callable[[], tuple], read_again: Callable[[], tuple]) -> dict[int, list[dict]]:
    """Who holds each port (``Listeners``), marked whether it runs in our serving container.

    ``read`` gives (holders, the ``DockerContainer`` records of ours): the snapshot's. A
    holder in a container that is not ours there is asked about again with ``read_again``,
    holders first and then the container: the two answers may come from two reads of the
    host (one of them hinted into its first read), and systemd may have started a new
    engine between them (its own restart after a crash races the deploy). One read asks
    in that order too (:mod:`sparkfleet.hostread`): a container whose engine already holds
    the port is still there when asked after it."""
    def judged(holders, container) -> dict[int, list[dict]]:
        return in_container(holders or {}, ((container or [{}])[0] or {}).get("Id", ""))

    holders = judged(*read())
    if in_other_container(holders):
        holders = judged(*read_again())
    return holders


def port_problems(ports: list[Listen], holders: dict[int, list[dict]], agent_listens: set[int] = frozenset()
                  ) -> list[str]:
    """A port two roles of this host want, and a port held by a process that is not ours
    (not our container, not our own service of that role), each with its fix."""
    problems = []
    by_port: dict[int, list[Listen]] = {}
    for listen in ports:
        by_port.setdefault(listen.port, []).append(listen)
    for port, wanted in by_port.items():
        if len(wanted) > 1:
            problems.append(f"port {port} is wanted by {' and by '.join(f'{w.what} ({w.key})' for w in wanted)}: "
                            f"give one another port, e.g. --data {wanted[-1].key}=N")
            continue
        listen = wanted[0]
        others = [h for h in holders.get(port, []) if not _ours(listen, h, agent_listens)]
        if not others:
            continue
        held = ", ".join(f"{h.get('name') or '?'} (pid {h.get('pid')})" for h in others)
        playbooks = (f" (NVIDIA's DGX Spark playbooks run their own services on {' and '.join(map(str, PLAYBOOK_PORTS))})"
                     if port in PLAYBOOK_PORTS else "")
        problems.append(f"port {port}, {listen.what}, is held by {held}{playbooks}: stop that process, or "
                        f"choose another port with --data {listen.key}=N")
    return problems


def _open(port: int, ranges) -> bool:
    return any(port in r for r in ranges)


def firewall_problems(ports: list[Listen], firewall: dict) -> list[str]:
    """A firewall on this host (ufw, or an nftables/iptables input chain whose policy drops)
    with no accept for a port that other hosts or clients connect to, with the rule to add."""
    reached = [p for p in ports if p.reached_from]
    problems = []
    ufw = firewall.get("ufw") or {}
    if ufw.get("active") and ufw.get("incoming") != "allow":
        closed = [p for p in reached if not _open(p.port, ufw.get("allowed", []))]
        if closed:
            rules = " && ".join(f"sudo ufw allow from {p.reached_from} to any port {p.port} proto tcp" for p in closed)
            problems.append(f"ufw is active (incoming: {ufw.get('incoming') or 'deny'}) and allows no connection to "
                            f"{_named(closed)}: the fleet cannot reach them; allow them: `{rules}`")
        return problems  # ufw's own chains are the nftables ones below
    for chain in firewall.get("chains", []):
        closed = [p for p in reached if not _open(p.port, chain.get("accepted", []))]
        if not closed:
            continue
        where = str(chain["chain"])
        dports = ", ".join(str(p.port) for p in closed)
        rule = (f"sudo iptables -I INPUT -p tcp -m multiport --dports {dports.replace(' ', '')} -j ACCEPT"
                if where.startswith("iptables ") else f"sudo nft insert rule {where} tcp dport {{ {dports} }} accept")
        problems.append(f"the firewall ({where}, policy {chain.get('policy')}) has no accept for {_named(closed)}: "
                        f"the fleet cannot reach them; add one (and keep it in the firewall's saved rules): `{rule}`")
    return problems


def _named(ports: list[Listen]) -> str:
    return ", ".join(f"port {p.port} ({p.what})" for p in ports)


DESKTOP_TARGET = "graphical.target"
DESKTOP_FIX = ("it boots to the desktop (graphical.target, DGX OS's default), whose session holds memory: "
               "`sudo systemctl set-default multi-user.target && sudo reboot` (a headless Spark has ~102 GiB "
               "available)")


def memory_findings(memory: dict[str, int], share: float, margin_gib: float,
                    boot_target: str = "") -> tuple[str | None, str | None]:
    """(problem, warning) for ``share`` (gpu_memory_utilization) of this host's memory.

    vLLM 0.23 starts only when MemAvailable >= share x MemTotal at its check, and its own
    process only lowers that figure before: a host below it is refused (vLLM would refuse it
    too), never one above. Within ``margin_gib`` (what the engine holds before its check) it
    is a warning. The fix named is what holds the memory: the desktop, other processes; a
    smaller share only as the last resort (it shrinks the KV cache)."""
    total, available = memory.get("MemTotal", 0), memory.get("MemAvailable", 0)
    if not total:
        return None, None
    want = share * total
    desktop = boot_target == DESKTOP_TARGET
    fits = int(available / total * 100) / 100  # the largest share that starts now
    figures = (f"{available / GIB:.1f} GiB of {total / GIB:.1f} GiB available, vLLM checks for "
               f"{want / GIB:.1f} GiB (gpu_memory_utilization={share:g} x MemTotal)")
    free_it = DESKTOP_FIX if desktop else "stop what holds the memory (`ps aux --sort=-rss | head`)"
    if available < want:
        return (f"{figures} and would refuse to start: {free_it}; or, only if the memory is needed elsewhere, "
                f"gpu_memory_utilization={fits:.2f} (a smaller KV cache)"), None
    if available < want + margin_gib * GIB:
        return None, (f"{figures}, within engine_startup_memory_gib={margin_gib:g} of it: vLLM's own start-up may "
                      f"take the rest; {free_it}")
    return None, None


Judge = Callable[[Settings], Findings]


def _judged(name: str, judge: Judge) -> Findings:
    """``judge`` on the host ``name``, with its own settings and facts, once per run: the
    first member to ask reads them, a peer asking meanwhile waits for that answer."""
    def judged() -> Findings:
        with ctx_host.use(state.inventory.get_host(name)):
            return judge(fleet_settings())

    return once(("preflight", name, judge), judged)


def _peer_problems(name: str, judge: Judge) -> list[str]:
    peer = state.inventory.get_host(name)
    if peer not in state.activated_hosts:  # its facts cannot be read
        return ["the controller is not connected to it (unreachable: its error is above, or left out by "
                "--limit): a pair is deployed with every member"]
    return _judged(name, judge).problems


def inspect(settings: Settings, judge: Judge = host_findings) -> Findings:
    """This host's findings (``judge``: :func:`host_findings`); a pair member's also hold
    each peer that fails its own: a pair serves only when every member can, and a member
    that went on alone would restart into an engine that cannot form."""
    found = _judged(host.name, judge)
    pair = host_pair()
    if not pair:
        return found
    peers = [name for name in pair.members if name != host.name]
    failing = {name: problems for name in peers if (problems := _peer_problems(name, judge))}
    if failing:
        return replace(found, peers=failing)
    return replace(found, summary=f"{found.summary}; {pair.group}: {', '.join(peers)} passed too")


@operation(is_idempotent=True)
def passed(findings: Findings):
    """
    Fail this host, with every problem and its fix, when preflight found any on it or on
    a pair peer (naming the peer).

    + findings: what ``inspect`` found on this host and its pair
    """
    for warning in findings.warnings:
        logger.warning(f"{host.print_prefix}preflight warning: {warning}")
    if findings.passed:
        host.noop(f"preflight passed: {findings.summary}")
        return
    yield remote.fail(failure(findings))


def failure(findings: Findings) -> str:
    """What a host that did not pass is told: its problems, then each failing peer's."""
    lines = []
    if findings.problems:
        lines += ["preflight failed, nothing was changed on this host:", *(f"  - {p}" for p in findings.problems)]
    for peer, problems in findings.peers.items():
        lines.append(f"its pair peer {peer} failed its preflight too:" if findings.problems else
                     f"its pair peer {peer} failed its preflight, so nothing was changed on this host (a pair "
                     f"serves only when every member can: fix {peer}, then deploy both):")
        lines += [f"  - {peer}: {p}" for p in problems]
    return "\n".join(lines)
