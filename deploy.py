"""Converge every Spark of the inventory to the declared serving state.

    pyinfra inventory/sparks.py deploy.py [--data profile=dense]

sparkfleet.lock (the bytes each tag and branch stands for) -> the stack held -> preflight ->
the stack's declared versions (rolled through the gate) -> NVIDIA container runtime -> the
ConnectX-7 link of a pair -> mirror (one host serves the image and the weights to the
others; the weights start across the WAN) -> OOM guard and watchdog -> serving image ->
cached weights -> hybrid build -> systemd unit for the profile (a pair: one rank each) ->
READY (-> post-deploy checks, with --data checks=...).
Every host's data is validated first: a bad value stops the run before any host changes.
"""

from sparkfleet import (
    container_runtime,
    endpoint,
    fleetlock,
    hybrid,
    image,
    link,
    mirror,
    monitor,
    oomguard,
    oplock,
    patchcheck,
    preflight,
    service,
    stack,
    watchdog,
    weights,
)
from sparkfleet.bench.deploy import run_checks
from sparkfleet.fleet import fleet_lock, fleet_settings, host_pair

settings = fleet_settings()  # its image and revisions as sparkfleet.lock pins them (a digest, commits)
pair = host_pair()  # a pair_* group: this host is one rank of its pair's engine
oplock.held()  # one operator at a time: another deploy's lock stops every host here, before any change
fleetlock.recorded(fleet_lock())  # sparkfleet.lock written on the controller, before any host changes
stack.held(settings)  # driver, toolkit, Docker, kernel: apt-mark hold, so no unattended upgrade moves them

if not settings.serving:
    service.stopped()
    watchdog.stopped()
    monitor.configured(settings)  # fleet_monitor: a node exporter here; Prometheus and its alerts there
else:
    findings = preflight.inspect(settings)  # every step says what it still needs; a pair: every member
    preflight.passed(name="preflight: GB10, aarch64, driver, docker, disk, memory", findings=findings)
    if findings.passed:  # a failing host stops at preflight, and its pair with it; the others go on
        stack.upgraded(settings, pair)  # declared versions: drain, upgrade, reboot if need be, READY, gate, back
        member = link.joined(settings, pair) if pair else None  # a pair's ConnectX-7 link: netplan, peers answer
        container_runtime.configured(settings)
        host_files = service.host_files(settings)  # runtime/ copy and 0600 secrets (the mirror's HF token)
        mirror_ops = mirror.configured(settings)  # fleet_mirror: served, trusted or off; the WAN starts here
        # While the image and the weights cross the WAN: what must be in place before an engine starts.
        oomguard.configured(settings)  # earlyoom: the engine, not the host, when memory runs out
        watchdog.configured(settings)  # progress, not liveness; memory pressure: drained, restarted or stopped
        mirror_ops += mirror.copied(settings)  # the image in the mirror's registry, then down the relays
        pulled = image.present(settings)
        cached = weights.fetched(settings)
        mirror.track(settings, mirror_ops, pulled, cached, weights.repo_dirs(settings))
        mirror.holds(settings)  # every file the lock names, so a host added after upstream deleted them deploys
        build = hybrid.checkpoint(settings)
        if member:  # NCCL on the link inside the image: RoCE, at the bus bandwidth floor
            link.measured(name="ConnectX-7 link: NCCL all_gather over RoCE", settings=settings, member=member)
        patchcheck.checked(name="runtime patches and serve flags fit the image", settings=settings, member=member)
        service.running(settings, also_restart_for=(*host_files, build, pulled), member=member)
        endpoint.served(settings)  # fleet_endpoint: HAProxy over every serving host (a pair's head)
        monitor.configured(settings)  # fleet_monitor: a node exporter here; Prometheus and its alerts there
        if settings.checks:  # a pair is checked at its head
            run_checks(settings.checks)
