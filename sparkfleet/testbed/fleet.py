"""Bring the simulated fleet up and down, report its status, and operate on its hosts.

`up()` starts from a clean slate (everything a previous run left is removed first), then
builds or reuses the cached roots, makes the network, provisions and boots the hosts,
and - while they boot - starts registry (+ image push), hub and apt repo. It writes the
state file after every step and `.testbed/hosts.json` at the end.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shlex
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from . import (
    aptrepo,
    cleanup,
    hosts,
    hubservice,
    image,
    keys,
    login,
    network,
    pairs,
    paths,
    registry,
    rootfs,
    shaping,
    switches,
)
from .proc import TestbedError, log, pid_alive, pid_matches, require_root, require_tools, run
from .services import port_open
from .state import HostState, State, write_hosts_json

#: The simulated engine starts this much faster than a GB10 (runtime/startup.py: a dense
#: cold start of ~3 min takes ~10 s here); the READY wait derives from it, ratios kept.
TIME_SCALE = 0.05
HOST_READY_TIMEOUT = 180.0

_lock_depth = 0
_lock_fd: int | None = None


@contextlib.contextmanager
def cache_locked() -> Iterator[None]:
    """Serialise `up` and `down` of every instance on this machine: they build into, and
    unmount below, the one shared cache (a few seconds each once it is built)."""
    paths.CACHE_LOCK_FILE.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(paths.CACHE_LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log("another instance is building or removing its fleet; waiting for it")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def locked() -> Iterator[None]:
    """Serialise testbed operations across processes (flock), re-entrant in-process."""
    global _lock_depth, _lock_fd
    if _lock_depth == 0:
        paths.LOCK_FILE.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(paths.LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log("another testbed operation is running; waiting for it")
            fcntl.flock(fd, fcntl.LOCK_EX)
        _lock_fd = fd
    _lock_depth += 1
    try:
        yield
    finally:
        _lock_depth -= 1
        if _lock_depth == 0 and _lock_fd is not None:
            os.close(_lock_fd)
            _lock_fd = None


#: Each simulated host's systemd, journald, dockerd... hold ~7 inotify instances, all root's
#: (the hosts share the machine's user ids), and the kernel lets a user have 128: past ~16
#: hosts the others' systemd cannot watch its units and they never come up (32 hosts hold
#: 226). Raised, never lowered, to what the testbed's ten instances of up to 50 hosts need.
INOTIFY_INSTANCES = 8192
_INOTIFY_LIMIT = Path("/proc/sys/fs/inotify/max_user_instances")


def _check_env() -> None:
    require_root()
    require_tools()


def _inotify_room() -> None:
    have = int(_INOTIFY_LIMIT.read_text())
    if have < INOTIFY_INSTANCES:
        _INOTIFY_LIMIT.write_text(f"{INOTIFY_INSTANCES}\n")
        log(f"fs.inotify.max_user_instances {have} -> {INOTIFY_INSTANCES}: each simulated host holds ~7 of root's")


# --- up / down -------------------------------------------------------------------------


def up(n_hosts: int, host_switches: dict[str, dict[str, Any]] | None = None, *,
       keep_on_failure: bool = False, login_kind: str = login.DEFAULT_LOGIN,
       names: str = login.DEFAULT_NAMES, n_pairs: int = 0, pinned: bool = True,
       bandwidth_scale: float | None = None, artifact_scale: float | None = None) -> "Testbed":
    """Boot a fresh fleet of *n_hosts* hosts (spark-1..N); return it. *login_kind* and
    *names* say how the controller logs in and what the inventory calls the hosts
    (login.py); *n_pairs* joins spark-1 + spark-2, ... by a simulated ConnectX-7 link
    (pairs.py). *pinned* gives the image by digest and each repository by commit; False
    leaves the tag and ``main``, as a fleet is declared (sparkfleet.lock resolves them).
    *bandwidth_scale* F limits the WAN, every NIC and every pair link to a real fleet's
    rates divided by F (shaping.py); *artifact_scale* S pads the image and the hub's
    checkpoints to their real sizes divided by S (image.py, checkpoints.py)."""
    if not 1 <= n_hosts <= 50:
        raise TestbedError(f"--hosts must be 1..50, not {n_hosts}")
    login.check(login_kind, names)
    for what, scale in (("--bandwidth-scale", bandwidth_scale), ("--artifact-scale", artifact_scale)):
        if scale is not None and not scale >= 1:
            raise TestbedError(f"{what} divides a real fleet's figures: 1 or more, not {scale}")
    _check_env()
    _inotify_room()
    host_switches = host_switches or {}
    host_names = [paths.host_name(i) for i in range(1, n_hosts + 1)]
    cabled = pairs.plan(host_names, n_pairs)
    unknown = set(host_switches) - set(host_names)
    if unknown:
        raise TestbedError(f"switches for hosts that are not in the fleet: {', '.join(sorted(unknown))}")
    with locked(), cache_locked():
        t0 = time.monotonic()
        timings: dict[str, float] = {}

        def mark(step: str, since: float) -> float:
            now = time.monotonic()
            timings[step] = round(now - since, 1)
            return now

        cleanup.teardown()
        t = mark("cleanup", t0)
        _mount_state_tmpfs()
        state = State(login=login_kind, names=names, pairs=[p.record() for p in cabled],
                      shaping={"bandwidth_scale": bandwidth_scale, "artifact_scale": artifact_scale})
        paths.LOG_DIR.mkdir(parents=True, exist_ok=True)
        state.save()
        try:
            _up(state, host_names, host_switches, mark, t, pinned)
        except BaseException:
            state.save()
            if keep_on_failure:
                log("up failed; leaving what was made for inspection (`sparkfleet testbed down` removes it)")
            else:
                log("up failed; removing what was made")
                try:
                    cleanup.teardown(state)
                except Exception as exc:  # noqa: BLE001 - the original error matters more
                    log(f"warning: cleanup after failure: {exc}")
            raise
        timings["total"] = round(time.monotonic() - t0, 1)
        state.data["_timings_s"] = timings  # stripped from hosts.json below
        tb = Testbed(state)
        tb._save()
        log(f"fleet up: {n_hosts} host(s) in {timings['total']}s ({', '.join(f'{k} {v}s' for k, v in timings.items())})")
        return tb


#: Size limit of the tmpfs holding the fleet's state (used pages only count; df on the
#: hosts' docker root and hf_home reports this as the disk, so keep it well above the
#: deploy's disk margin).
STATE_TMPFS_SIZE = "32g"


def _mount_state_tmpfs() -> None:
    """Hold STATE_DIR (host overlays, docker data roots, registry, hub repos) in a tmpfs.

    Why: this machine's root filesystem is mounted with `discard`, and deleting the
    ~150 MiB of docker layers each host pulls took ~18 s per host; unmounting a tmpfs
    frees it at once. The state is per fleet anyway (nothing of it survives a reboot).
    """
    paths.STATE_DIR.mkdir(parents=True, exist_ok=True)
    run(["mount", "-t", "tmpfs", "-o", f"size={STATE_TMPFS_SIZE},mode=0755", "sparkfleet-testbed",
         paths.STATE_DIR], timeout=30)


def _up(state: State, names: list[str], host_switches: dict[str, dict[str, Any]], mark, t: float,
        pinned: bool = True) -> None:
    # Cold cache: host root (~75 s), then the image root reusing its .debs (~45 s), while
    # the wheels download; warm, these are cache lookups.
    with ThreadPoolExecutor(max_workers=1) as pool:
        wheels_f = pool.submit(image.ensure_wheels)
        host_root = rootfs.ensure_rootfs(rootfs.host_recipe())
        image.base_layer()
        wheels_f.result()
    state.rootfs = str(host_root)
    t = mark("rootfs", t)
    pubkey = keys.ensure_ssh_key()
    sudo_password = login.new_password() if state.login == "dgx" else None
    network.ensure_bridge()
    deb = aptrepo.build_repo()
    t = mark("apt_repo_build", t)

    for name in names:
        i = paths.host_index(name)
        h = HostState(name=name, index=i, address=paths.host_address(i), netns=paths.netns_name(name),
                      veth=paths.veth_name(name), switches=host_switches.get(name, {}))
        state.hosts[name] = h
        state.save()
        network.create_host_net(name, h.address)
        hosts.provision(h, host_root, pubkey, deb, state.login, sudo_password)
    pairs.set_up(state.hosts, [pairs.Pair(tuple(p["members"])) for p in state.pairs])
    t = mark("provision", t)
    for h in state.hosts.values():
        hosts.boot(h)
        state.save()
    t = mark("boot_start", t)

    # While the hosts boot: the services they will use.
    state.services["registry"] = registry.start_server()
    state.save()
    artifact_scale = state.shaping.get("artifact_scale")
    state.image = image.publish(image.padded_size(artifact_scale))
    state.save()
    t = mark("registry_image", t)
    revisions = hubservice.write_repos(artifact_scale)
    state.services["hub"] = hubservice.start_server()
    state.save()
    state.services["apt"] = aptrepo.start_server()
    state.save()
    t = mark("hub_apt", t)

    key = paths.SSH_KEY
    with ThreadPoolExecutor(max_workers=len(state.hosts)) as pool:
        for fut in [pool.submit(hosts.wait_ready, h, key, HOST_READY_TIMEOUT) for h in state.hosts.values()]:
            fut.result()
    t = mark("hosts_ready", t)
    if state.shaping.get("bandwidth_scale"):
        rates = shaping.Rates(state.shaping["bandwidth_scale"])
        shaping.apply(list(state.hosts.values()), [tuple(p["members"]) for p in state.pairs], rates)
        state.shaping["rates"] = rates.record()
        log(f"shaped: WAN {rates.kbit('wan') / 1000:g}, LAN {rates.kbit('lan') / 1000:g}, ConnectX-7 "
            f"{rates.kbit('cx7') / 1000:g} Mbit/s (a real fleet's / {rates.scale:g})")
        t = mark("shaping", t)

    state.data = {
        "image": state.image["pinned"] if pinned else state.image["ref"],
        "hf_endpoint": paths.HUB_URL,
        "nvidia_apt_repo": paths.APT_URL,
        "nvidia_apt_key_url": paths.APT_KEY_URL,
        **({"model_revisions": revisions} if pinned else {}),
        "image_size_gib": round(state.image["size_bytes"] / hubservice.GIB, 6),
        "artifact_sizes_gib": hubservice.repo_sizes_gib(revisions),
        # The hosts report a GB10's memory (simhw/meminfo.py) and the engine takes it as vLLM
        # does: the real gpu_memory_utilization and engine_startup_memory_gib apply.
        "startup_time_scale": TIME_SCALE,
        "vllm_env": {"SIM_TIME_SCALE": str(TIME_SCALE)},
        # The gate's decode floor is a GB10's (14 tok/s); a simulated engine's pace also
        # waits on this machine's two cores, which `make test` shares among three fleets
        # (a gate measured under that load fell below 14). The floor's logic is unit-tested.
        "rollout_min_decode_tok_s": 5.0,
        # The hosts install earlyoom and the node exporter (and the mirror docker-registry and
        # skopeo, the endpoint haproxy, the monitor prometheus) from the testbed's apt repository (a Spark: from Ubuntu's archives); the
        # mirror copies the image over plain HTTP.
        "apt_repo": paths.APT_URL,
        "apt_key_url": paths.APT_KEY_URL,
        "image_registry_url": f"http://{paths.REGISTRY}",
        "api_key_file": paths.API_KEY_FILE,
        "mirror_tls_dir": paths.MIRROR_TLS_DIR,
        # The fleet's sparkfleet.lock: in its state, gone with the fleet (never in the checkout).
        "fleet_lock_file": str(paths.SPARKFLEET_LOCK),
        "_model_revisions": revisions,  # for one_copy_bytes, pinned or not; not in hosts.json
    }


def down() -> None:
    """Remove the fleet: containers, processes, mounts, cgroups, netns, links, state.
    The cache stays."""
    _check_env()
    with locked(), cache_locked():
        t0 = time.monotonic()
        cleanup.teardown()
        left = {k: v for k, v in cleanup.leftovers().items() if v}
        if left:
            raise TestbedError(f"down left things behind: {left}")
        log(f"fleet down in {time.monotonic() - t0:.1f}s (cache kept in {paths.CACHE_DIR})")


# --- the fleet object ------------------------------------------------------------------


class Testbed:
    """A running simulated fleet, as recorded in the state file.

    `hosts` are HostState records (name, address, pid, switches); `inventory_path` is
    the pyinfra inventory (inventory/testbed.py). Host operations go through the lock
    and update the state file (and hosts.json for switches).
    """

    __test__ = False

    def __init__(self, state: State):
        self.state = state

    @classmethod
    def load(cls) -> "Testbed":
        state = State.load()
        if state is None or not state.hosts:
            raise TestbedError("no testbed is up: run `sparkfleet testbed up` first")
        return cls(state)

    # --- properties ---------------------------------------------------------------

    @property
    def hosts(self) -> list[HostState]:
        return sorted(self.state.hosts.values(), key=lambda h: h.index)

    @property
    def names(self) -> list[str]:
        return [h.name for h in self.hosts]

    @property
    def inventory_path(self) -> Path:
        return paths.INVENTORY

    @property
    def hosts_json(self) -> Path:
        return paths.HOSTS_JSON

    @property
    def ssh_key(self) -> Path:
        return paths.SSH_KEY

    @property
    def data(self) -> dict[str, Any]:
        return {k: v for k, v in self.state.data.items() if not k.startswith("_")}

    @property
    def image(self) -> dict[str, Any]:
        return self.state.image

    @property
    def hub_url(self) -> str:
        """The hub endpoint (HF_ENDPOINT); byte counters at /_testbed/stats."""
        return paths.HUB_URL

    @property
    def registry(self) -> str:
        return paths.REGISTRY

    def set_wan_rate(self, rate: str | None) -> None:
        """Model the internet link: what the hub and the registry send to the hosts is
        limited to *rate* ("100mbit", "500kbit"); host-to-host traffic on the bridge (the
        fleet's LAN), SSH and the apt repository are not (shaping.set_wan). None removes it."""
        shaping.set_wan(_kbit(rate) if rate else None)

    @property
    def shaping(self) -> dict[str, Any]:
        """``bandwidth_scale``, ``artifact_scale`` (None: off) and the ``rates`` in kbit/s."""
        return dict(self.state.shaping)

    def traffic(self) -> shaping.Traffic:
        """Bytes so far: upstream's (WAN) and each host's NIC and pair link; subtract two
        readings for what a run moved (shaping.Traffic)."""
        paired = {m for p in self.state.pairs for m in p["members"]}
        return shaping.counters(self.hosts, paired)

    def one_copy_bytes(self, build_hybrid: bool = False) -> dict[str, int]:
        """What one host of the default profile (dense) fetches, by artifact: the image's
        blobs and the checkpoints' bytes (the hosted hybrid, or with *build_hybrid* its
        inputs: checkpoints.fetched_bytes)."""
        from .checkpoints import fetched_bytes

        revisions = self.state.data["_model_revisions"]
        return {"image": int(self.state.image.get("wire_bytes") or self.state.image.get("blob_bytes", 0)),
                **fetched_bytes(hubservice.REPOS_DIR, revisions, build_hybrid)}

    def registry_mark(self) -> int:
        """A point in the registry's access log; registry_stats(mark) counts from there."""
        from .registry import access_log_size

        return access_log_size()

    def registry_stats(self, mark: int = 0) -> dict[str, Any]:
        """Blob bytes the registry served since *mark*: total, by_repo, by_client,
        by_repo_client (from its access log, as the hub's /_testbed/stats counts files)."""
        from .registry import blob_stats

        return blob_stats(mark)

    # --- upstream moves under the fleet ------------------------------------------------

    def hub_move(self, repo: str, ref: str = "main") -> str:
        """Upstream moves ``ref`` of ``repo`` to a new commit (the hub's /_testbed/move); its sha."""
        return self._hub("move", {"repo": repo, "ref": ref})["sha"]

    def hub_delete(self, repo: str, revision: str) -> None:
        """Upstream deletes the commit ``revision`` of ``repo`` (a ref must not name it)."""
        self._hub("delete", {"repo": repo, "revision": revision})

    def _hub(self, what: str, spec: dict[str, Any]) -> dict[str, Any]:
        import requests

        answer = requests.post(f"{paths.HUB_URL}/_testbed/{what}", json=spec, timeout=60)
        if answer.status_code != 200:
            raise TestbedError(f"hub: {what} {spec}: HTTP {answer.status_code} {answer.text[:300]}")
        return answer.json()

    def registry_move(self, repo: str = paths.IMAGE_REPO, tag: str = paths.IMAGE_TAG) -> str:
        """Upstream re-points ``repo:tag`` to a new image (same layers, new config); its digest."""
        from .registry import RegistryClient, move_tag

        return move_tag(RegistryClient(f"http://{paths.REGISTRY}"), repo, tag)

    def registry_delete(self, digest: str, repo: str = paths.IMAGE_REPO) -> None:
        """Upstream deletes the manifest ``digest`` of ``repo`` (and the tags naming it)."""
        from .registry import RegistryClient

        RegistryClient(f"http://{paths.REGISTRY}").delete_manifest(repo, digest)

    @property
    def apt_url(self) -> str:
        return paths.APT_URL

    @property
    def run_id(self) -> str:
        return self.state.run_id

    @property
    def api_key_file(self) -> Path:
        """The fleet's API key on the controller (made by its first deploy)."""
        return paths.REPO_ROOT / self.data.get("api_key_file", paths.API_KEY_FILE)

    @property
    def mirror_tls_dir(self) -> Path:
        return paths.REPO_ROOT / self.data.get("mirror_tls_dir", paths.MIRROR_TLS_DIR)

    def inventory_name(self, name: str) -> str:
        """What the inventory (and pyinfra's output) calls host *name*."""
        return login.inventory_name(name, self.state.names)

    def host(self, name: str) -> HostState:
        try:
            return self.state.hosts[name]
        except KeyError:
            raise TestbedError(f"no host {name!r} in the testbed ({', '.join(self.names)})") from None

    def _save(self) -> None:
        self.state.save()
        public = State.from_dict(self.state.to_dict())
        public.data = self.data
        write_hosts_json(public)

    def _reload(self) -> None:
        fresh = State.load()
        if fresh is None or fresh.run_id != self.state.run_id:
            raise TestbedError("the testbed this object describes is gone (down or a new up happened)")
        self.state = fresh

    # --- host operations ----------------------------------------------------------

    def exec(self, name: str, command: str | list[str], *, via: str | None = None, timeout: float = 60,
             check: bool = False, as_root: bool = True):
        """Run a shell command on a host: as root by nsenter (the default), over real SSH
        with ``via="ssh"`` (through sudo with a dgx login), or as the login user over SSH
        with *as_root* False. The tests' own looks at a host go by nsenter: over SSH and
        password sudo each cost ~0.27 s and ~0.18 s of the machine's CPU (the client, sshd,
        a yescrypt hash; the ssh client ran 1,367 times in one `make test`); nsenter ~4 ms."""
        via = via or ("nsenter" if as_root else "ssh")
        return hosts.exec_cmd(self.host(name), self.ssh_key, command, via=via, timeout=timeout, check=check,
                              as_root=as_root)

    def stop_host(self, name: str, grace: float = 60) -> None:
        """Power the host off (its overlay, docker data and netns stay): unreachable
        until start_host()."""
        with locked():
            self._reload()
            h = self.host(name)
            hosts.shutdown(h, grace=grace)
            self._save()
            log(f"{name} stopped")

    def start_host(self, name: str, timeout: float = HOST_READY_TIMEOUT) -> None:
        """Boot a stopped host again (same overlay) and wait until it is ready."""
        with locked():
            self._reload()
            h = self.host(name)
            if h.pid and pid_matches(h.pid, "systemd-nspawn"):
                raise TestbedError(f"{name} is already running")
            hosts.boot(h)
            self._save()
            hosts.wait_ready(h, self.ssh_key, timeout)

    def restart_host(self, name: str, grace: float = 60, timeout: float = HOST_READY_TIMEOUT) -> None:
        """Simulate a reboot: stop the container in order and boot the same root again."""
        with locked():
            self.stop_host(name, grace=grace)
            self.start_host(name, timeout=timeout)

    def kill_host(self, name: str) -> None:
        """Simulate a power cut: SIGKILL the host's container, no orderly shutdown."""
        with locked():
            self._reload()
            h = self.host(name)
            hosts.power_cut(h)
            self._save()

    def hard_reset(self, name: str, kernel_errors: Sequence[str] = (), timeout: float = HOST_READY_TIMEOUT) -> None:
        """Simulate a hard reset: the kernel's last errors (e.g. an NVIDIA Xid) reach the host's
        journal, the power is cut, and the host boots again by itself, as a Spark that froze
        under memory pressure comes back from its watchdog's reset."""
        for line in kernel_errors:
            # As the kernel logs it: priority err, identifier "kernel" (journalctl -k shows kmsg only).
            self.exec(name, f"logger -p kern.err -t kernel {shlex.quote(line)}", via="nsenter", timeout=30)
        if kernel_errors:
            self.exec(name, "journalctl --sync", via="nsenter", timeout=30)
        self.kill_host(name)
        self.start_host(name, timeout=timeout)

    def set_link(self, name: str, up: bool) -> None:
        """Cut (False) or restore (True) a host's network; the host keeps running."""
        self.host(name)
        network.set_host_link(name, up)

    @contextlib.contextmanager
    def unreachable(self, name: str) -> Iterator[None]:
        """Within the block the host runs but cannot be reached (link down)."""
        self.set_link(name, False)
        try:
            yield
        finally:
            self.set_link(name, True)

    def set_switches(self, name: str, **changes: Any) -> dict[str, Any]:
        """Flip simulated-hardware switches on a host (None/False turns one off); returns
        the previous switches. Takes effect at once: nvidia-smi and uname read the
        switch file live, `disk_full` is (un)mounted, `no_nvidia_runtime` purges or
        reinstalls the toolkit package and restarts docker."""
        with locked():
            self._reload()
            h = self.host(name)
            old = dict(h.switches)
            merged = {**old, **changes}
            new = switches.normalize({k: v for k, v in merged.items() if v not in (None, False)})
            h.switches = new
            hosts.write_switches(h)
            running = bool(h.pid and pid_alive(h.pid))
            if running and bool(old.get("disk_full")) != bool(new.get("disk_full")):
                hosts.nsenter_exec(h, "/usr/lib/sparkfleet-sim/apply-switches", timeout=60, check=True)
            if bool(old.get("no_nvidia_runtime")) != bool(new.get("no_nvidia_runtime")):
                self._toolkit(h, present=not new.get("no_nvidia_runtime"), running=running)
            self._save()
            return old

    def _toolkit(self, h: HostState, present: bool, running: bool) -> None:
        if present:
            cmd = "dpkg -i /usr/lib/sparkfleet-sim/nvidia-container-toolkit.deb >/dev/null"
        else:
            cmd = ("dpkg --purge nvidia-container-toolkit >/dev/null; python3 -c '" + _STRIP_NVIDIA + "'")
        if running:
            # reset-failed: docker's unit allows 3 starts a minute, and tests flip switches
            # right after a deploy restarted docker.
            hosts.nsenter_exec(h, cmd + " && systemctl reset-failed docker.service; systemctl restart docker",
                               timeout=120, check=True)
        else:
            run(["chroot", h.mnt, "/bin/sh", "-c", cmd], timeout=120)

    def clear_switches(self, name: str) -> dict[str, Any]:
        return self.set_switches(name, **{k: None for k in switches.ALL_SWITCHES})

    @contextlib.contextmanager
    def switched(self, name: str, **changes: Any) -> Iterator["Testbed"]:
        """`with tb.switched("spark-2", gpu="NVIDIA H100 80GB HBM3"): ...` - reverted after."""
        old = self.set_switches(name, **changes)
        try:
            yield self
        finally:
            self.set_switches(name, **{k: old.get(k) for k in switches.ALL_SWITCHES})

    # --- status -------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"run_id": self.state.run_id, "hosts": [], "services": []}
        for h in self.hosts:
            alive = bool(h.pid and pid_alive(h.pid))
            ssh_ok = port_open(h.address, 22, timeout=1.0) if alive else False
            probe = hosts.probe(h, self.ssh_key) if ssh_ok else {}
            out["hosts"].append({
                "name": h.name, "pid": h.pid if alive else None, "address": h.address,
                "ssh": ssh_ok, "system": probe.get("system", "-"), "docker": probe.get("docker", "-"),
                "switches": h.switches,
            })
        for s in self.state.services.values():
            out["services"].append({
                "name": s.name, "pid": s.pid if s.pid and pid_matches(s.pid, s.marker) else None,
                "url": s.url,
            })
        out["image"] = self.state.image.get("pinned")
        return out

    def down(self) -> None:
        down()


#: Run inside a host: drop the nvidia runtime from docker's daemon.json (as on a host
#: that never had the toolkit), keeping everything else.
_STRIP_NVIDIA = (
    "import json,os\n"
    "p=\"/etc/docker/daemon.json\"\n"
    "d=json.load(open(p)) if os.path.exists(p) else {}\n"
    "d.get(\"runtimes\",{}).pop(\"nvidia\",None)\n"
    "d.pop(\"runtimes\") if d.get(\"runtimes\")=={} else None\n"
    "d.pop(\"default-runtime\") if d.get(\"default-runtime\")==\"nvidia\" else None\n"
    "open(p,\"w\").write(json.dumps(d,indent=2)+\"\\n\")\n"
)


def status() -> dict[str, Any] | None:
    """Status of the recorded fleet, or None when none is up."""
    state = State.load()
    if state is None or not state.hosts:
        return None
    return Testbed(state).status()


def _kbit(rate: str) -> int:
    """tc's "100mbit" / "500kbit" / "1gbit" in kbit/s."""
    units = {"kbit": 1, "mbit": 1000, "gbit": 1000_000}
    for unit, factor in units.items():
        if rate.lower().endswith(unit):
            return round(float(rate[:-len(unit)]) * factor)
    raise TestbedError(f"rate {rate!r}: give kbit, mbit or gbit (e.g. 100mbit)")


# Module-level conveniences for tests and scripts.
def load() -> Testbed:
    return Testbed.load()


def restart_host(name: str) -> None:
    Testbed.load().restart_host(name)


def stop_host(name: str) -> None:
    Testbed.load().stop_host(name)


def start_host(name: str) -> None:
    Testbed.load().start_host(name)


def host_exec(name: str, command: str | list[str], **kw: Any):
    return Testbed.load().exec(name, command, **kw)
