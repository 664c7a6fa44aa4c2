"""The stack under the engine (issue 30), on three simulated Sparks behind the fleet endpoint
(HAProxy on spark-1): the deploy holds the stack's packages, so an upgrade run on a host
moves none of them while it moves what is not held.

The testbed's apt repository publishes the vendor's later releases at its ``stack/`` path
(sparkfleet/testbed/aptrepo.py): a good toolkit, a bad one (its hook fails every GPU
container), a later driver, a kernel the driver's module was not built for and an unheld
canary in two versions. A test lists it on a host as an update
published upstream would reach it. The tests run in file order.
"""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from sparkfleet.config import project_defaults
from sparkfleet.testbed import aptrepo, login, simhw, traffic
from tests.e2e.conftest import INVENTORY, REPO_ROOT

pytestmark = pytest.mark.e2e

ROUTER = "spark-1"
DATA = ("--data", f"fleet_endpoint={login.inventory_name(ROUTER, login.DEFAULT_NAMES)}")
TOOLKIT = simhw.TOOLKIT_PACKAGE
KERNEL = simhw.KERNEL_META
KEYRING = "/etc/apt/keyrings/sparkfleet-sim-stack.asc"
UPDATES = "/etc/apt/sources.list.d/sparkfleet-sim-stack.list"


def versions(testbed, name: str, *packages: str) -> dict[str, str]:
    """{package: "<dpkg status> <version>"} as dpkg has them on the host."""
    out = testbed.exec(name, "dpkg-query -W -f='${Package} ${db:Status-Abbrev}${Version}\\n' "
                       + " ".join(packages) + " 2>/dev/null; true", via="nsenter").stdout
    return {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in out.splitlines() if " " in line}


def publish_updates(testbed, name: str) -> None:
    """The vendor's later releases reach the host's apt sources."""
    url = aptrepo.STACK_URL
    done = testbed.exec(name, f"install -d /etc/apt/keyrings && curl -fsSL {url}gpgkey -o {KEYRING} && "
                        f"echo 'deb [signed-by={KEYRING}] {url} /' > {UPDATES} && apt-get update -qq && echo ok",
                        timeout=120)
    assert done.stdout.strip().endswith("ok"), done.stdout + done.stderr


def status_json() -> dict:
    out = subprocess.run(["sparkfleet", "status", INVENTORY, "--json", *DATA],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env={**os.environ})
    return json.loads(out.stdout)


def test_the_deploy_holds_the_stack(testbed, run_pyinfra):
    result = run_pyinfra("deploy.py", *DATA)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    for name in testbed.names:  # the toolkit and Docker (docker.io, containerd: Debian's) held
        held = versions(testbed, name, TOOLKIT, "docker.io", "containerd", KERNEL)
        assert held[TOOLKIT] == f"hi {simhw.TOOLKIT_VERSION}" and held["docker.io"].startswith("hi "), held
        assert held[KERNEL] == f"hi {simhw.KERNEL_VERSION}", held
    again = run_pyinfra("deploy.py", *DATA)  # converged: nothing to hold again
    said = again.stdout + again.stderr
    assert again.returncode == 0 and re.search(r"held \(apt-mark hold\)\s+3\s+-\s+-\s+3", said), said[-4000:]
    rows = {r["host"]: r for r in status_json()["hosts"]}
    assert all(r["stack"][TOOLKIT] == {"version": simhw.TOOLKIT_VERSION, "held": True} for r in rows.values()), rows
    assert all(r["stack_drift"] == [] for r in rows.values()), rows


def test_an_upgrade_run_on_a_host_moves_no_held_package(testbed):
    """`apt-get upgrade` (what unattended-upgrades runs, by apt's own rules for held packages)
    with newer releases of the toolkit published: the unheld canary moves, the toolkit stays."""
    name = "spark-2"
    publish_updates(testbed, name)
    try:
        canary = testbed.exec(name, f"DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "
                              f"{aptrepo.STACK_CANARY}={aptrepo.STACK_CANARY_VERSIONS[0]}", timeout=180)
        assert canary.returncode == 0, canary.stdout + canary.stderr
        upgrade = ("if command -v unattended-upgrade >/dev/null; then unattended-upgrade -v; fi; "
                   "DEBIAN_FRONTEND=noninteractive apt-get upgrade -y")
        done = testbed.exec(name, upgrade, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        after = versions(testbed, name, TOOLKIT, aptrepo.STACK_CANARY, KERNEL)
        assert after[aptrepo.STACK_CANARY] == f"ii {aptrepo.STACK_CANARY_VERSIONS[-1]}", (after, done.stdout)
        assert after[TOOLKIT] == f"hi {simhw.TOOLKIT_VERSION}", (after, done.stdout)
        assert after[KERNEL] == f"hi {simhw.KERNEL_VERSION}", (after, done.stdout)
        assert TOOLKIT in done.stdout.split("kept back:")[-1] or "held" in done.stdout, done.stdout
    finally:
        testbed.exec(name, f"dpkg --purge {aptrepo.STACK_CANARY}; rm -f {UPDATES} {KEYRING}; apt-get update -qq",
                     timeout=180)


def declared_toolkit(version: str) -> tuple[str, str]:
    """--data stack_versions: the defaults, with the toolkit's version declared."""
    wanted = project_defaults()["stack_versions"]
    wanted["toolkit"] = {**wanted["toolkit"], TOOLKIT: version}
    return ("--data", f"stack_versions={json.dumps(wanted)}")


def started_at(testbed, name: str) -> str:
    return testbed.exec(name, "systemctl show sparkfleet-serve -p ExecMainStartTimestampMonotonic --value",
                        via="nsenter").stdout.strip()


def installed_at(testbed, name: str, version: str) -> str:
    """When dpkg last installed ``version`` of the toolkit on the host (its log's timestamp)."""
    return testbed.exec(name, f"grep -h ' status installed {TOOLKIT}:all {version}$' /var/log/dpkg.log | tail -n 1",
                        via="nsenter").stdout[:19]


def test_a_declared_upgrade_rolls_through_every_host_with_no_failed_request(testbed, run_pyinfra):
    """The vendor's good toolkit declared: each host in its turn is drained, upgraded, its
    engine restarted on the new stack, gated and put back; clients through the endpoint see
    no failure."""
    for name in testbed.names:
        publish_updates(testbed, name)
    before = {n: started_at(testbed, n) for n in testbed.names}
    ep = traffic.Endpoint(testbed, ROUTER, testbed.api_key_file)
    with traffic.Load(ep, workers=3) as load:
        result = run_pyinfra("deploy.py", *DATA, *declared_toolkit(aptrepo.STACK_GOOD_TOOLKIT))
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert out.count("gate passed; back in rotation") == 3, out[-20000:]  # each host in its turn
    for name in testbed.names:
        assert versions(testbed, name, TOOLKIT)[TOOLKIT] == f"hi {aptrepo.STACK_GOOD_TOOLKIT}"
        assert started_at(testbed, name) != before[name], name  # its engine runs on the new stack
    installed = [installed_at(testbed, n, aptrepo.STACK_GOOD_TOOLKIT) for n in testbed.names]
    assert installed == sorted(installed) and len(set(installed)) == 3, installed  # one turn after another
    print(f"good upgrade: {load.ok} requests ok, {len(load.failed)} failed")
    assert load.ok > 0 and load.failed == [], load.failed[:5]
    again = run_pyinfra("deploy.py", *DATA, *declared_toolkit(aptrepo.STACK_GOOD_TOOLKIT))
    said = again.stdout + again.stderr  # converged: no host rolls again
    assert again.returncode == 0 and re.search(r"the stack runs the declared versions\s+3\s+-\s+-\s+3", said), said
    assert "gate passed" not in said


def test_a_bad_upgrade_stops_at_its_first_host_which_goes_back_and_serves(testbed, run_pyinfra):
    """The bad toolkit (its hook fails every GPU container) declared: the first host's engine
    does not get READY on it; the host goes back to the good toolkit, serves again and is put
    back; no other host is touched; no client request fails."""
    before = {n: started_at(testbed, n) for n in testbed.names}
    ep = traffic.Endpoint(testbed, ROUTER, testbed.api_key_file)
    try:
        with traffic.Load(ep, workers=3) as load:
            result = run_pyinfra("deploy.py", *DATA, *declared_toolkit(aptrepo.STACK_BAD_TOOLKIT))
        out = result.stdout + result.stderr
        assert result.returncode != 0, out[-4000:]
        first = testbed.inventory_name("spark-1")
        assert f"rollout stopped at {first}" in out and "went back: the previous versions" in out, out[-4000:]
        assert versions(testbed, "spark-1", TOOLKIT)[TOOLKIT] == f"hi {aptrepo.STACK_GOOD_TOOLKIT}"
        assert started_at(testbed, "spark-1") != before["spark-1"]
        for name in ("spark-2", "spark-3"):  # untouched: neither upgraded nor restarted
            assert versions(testbed, name, TOOLKIT)[TOOLKIT] == f"hi {aptrepo.STACK_GOOD_TOOLKIT}"
            assert started_at(testbed, name) == before[name], name
        ep.wait_state("spark-1", {"UP"}, timeout=30)  # serves again, in rotation
        print(f"bad upgrade: {load.ok} requests ok, {len(load.failed)} failed")
        assert load.ok > 0 and load.failed == [], load.failed[:5]
    finally:
        for name in testbed.names:
            testbed.exec(name, f"rm -f {UPDATES} {KEYRING}; apt-get update -qq", timeout=180)


DRIVER = simhw.DRIVER_PACKAGE


def declared_driver(version: str) -> tuple[str, str]:
    """--data stack_versions: the defaults, with the driver's version declared."""
    wanted = project_defaults()["stack_versions"]
    wanted["driver"] = {**wanted["driver"], DRIVER: version}
    return ("--data", f"stack_versions={json.dumps(wanted)}")


def boot_of(testbed, name: str) -> str:
    return testbed.exec(name, "cat /proc/sys/kernel/random/boot_id", via="nsenter").stdout.strip()


def driver_of(testbed, name: str) -> str:
    return testbed.exec(name, "nvidia-smi --query-gpu=driver_version --format=csv,noheader").stdout.strip()


def test_a_driver_upgrade_reboots_each_host_in_its_turn_with_no_failed_request(testbed, run_pyinfra):
    """A later driver declared: its kernel module loads only at boot (installed alone, NVML
    answers a mismatch and every GPU container fails), so each serving host in its turn is
    drained, upgraded, rebooted, checked on its new boot, gated and put back; no client
    request through the endpoint fails, and the reboot a deploy made is not reported later.

    The endpoint's own host runs the new driver already (upgraded and rebooted by hand): its
    reboot takes the endpoint down with it, which no drain can hide (README)."""
    new = aptrepo.STACK_GOOD_DRIVER
    members = [n for n in testbed.names if n != ROUTER]
    for name in testbed.names:
        publish_updates(testbed, name)
    try:
        done = testbed.exec(ROUTER, f"DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "
                            f"--allow-change-held-packages {DRIVER}={new} && apt-mark hold {DRIVER}", timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        testbed.restart_host(ROUTER)
        ep = traffic.Endpoint(testbed, ROUTER, testbed.api_key_file)
        for name in testbed.names:
            ep.wait_state(name, {"UP"}, timeout=180)
        assert driver_of(testbed, ROUTER) == new.split("-")[0]
        boots = {n: boot_of(testbed, n) for n in testbed.names}
        with traffic.Load(ep, workers=3) as load:
            result = run_pyinfra("deploy.py", *DATA, *declared_driver(new))
        out = result.stdout + result.stderr
        assert result.returncode == 0, out[-4000:]
        assert out.count("gate passed; back in rotation") == len(members), out[-4000:]
        for name in members:
            assert versions(testbed, name, DRIVER)[DRIVER] == f"hi {new}"
            assert boot_of(testbed, name) != boots[name], name  # rebooted in its turn
            assert driver_of(testbed, name) == new.split("-")[0], name  # the new module loaded
        assert boot_of(testbed, ROUTER) == boots[ROUTER]  # nothing moved: not rebooted
        print(f"driver upgrade: {load.ok} requests ok, {len(load.failed)} failed")
        assert load.ok > 0 and load.failed == [], load.failed[:5]
        shown = status_json()  # the deploy saw its own reboots: none to report
        assert all(r["rebooted"] is None and r["stack_drift"] == [] for r in shown["hosts"]), shown["hosts"]
    finally:
        for name in testbed.names:
            testbed.exec(name, f"rm -f {UPDATES} {KEYRING}; apt-get update -qq", timeout=180)


def declared_kernel(version: str) -> tuple[str, str]:
    """--data stack_versions: the defaults, with the kernel's meta-package version declared."""
    wanted = project_defaults()["stack_versions"]
    wanted["kernel"] = {**wanted["kernel"], KERNEL: version}
    return ("--data", f"stack_versions={json.dumps(wanted)}")


def kernel_of(testbed, name: str) -> str:
    return testbed.exec(name, "uname -r").stdout.strip()


def test_a_kernel_that_loses_the_gpu_is_undone_and_its_host_boots_the_one_before(testbed, run_pyinfra):
    """A later kernel declared that the driver's module was not built for (DGX OS 7.4.0's
    6.17.0-1008-nvidia: nvidia-smi cannot reach the driver, no GPU container starts). The
    endpoint's own host rolls last, so the first turn is spark-2's: drained, upgraded,
    rebooted into the new kernel, it fails the check of its new boot and goes back: its
    kernel package reinstalled, GRUB pinned to the kernel before, rebooted again, checked
    on that kernel, READY, gated and put back. The rollout stops there: no other host is
    touched, and no client request through the endpoint fails."""
    release, version = aptrepo.STACK_BAD_KERNEL
    for name in testbed.names:
        publish_updates(testbed, name)
    try:
        assert {kernel_of(testbed, n) for n in testbed.names} == {simhw.KERNEL_RELEASE}
        boots = {n: boot_of(testbed, n) for n in testbed.names}
        before = {n: started_at(testbed, n) for n in testbed.names}
        ep = traffic.Endpoint(testbed, ROUTER, testbed.api_key_file)
        with traffic.Load(ep, workers=3) as load:
            result = run_pyinfra("deploy.py", *DATA, *declared_kernel(version))
        out = result.stdout + result.stderr
        assert result.returncode != 0, out[-4000:]
        first = testbed.inventory_name("spark-2")
        assert f"rollout stopped at {first}" in out and "went back: the previous versions" in out, out[-6000:]
        assert "nvidia-smi answers" in out, out[-6000:]  # why the new kernel failed
        assert kernel_of(testbed, "spark-2") == simhw.KERNEL_RELEASE  # GRUB boots the kernel before
        held = versions(testbed, "spark-2", KERNEL, f"linux-image-{release}")
        assert held[KERNEL] == f"hi {simhw.KERNEL_VERSION}", held
        assert held[f"linux-image-{release}"].startswith("ii "), held  # the new image stays (README)
        assert boot_of(testbed, "spark-2") != boots["spark-2"]
        assert testbed.exec("spark-2", "nvidia-smi -L").stdout.startswith("GPU 0: NVIDIA GB10")  # the driver loads
        for name in ("spark-1", "spark-3"):  # untouched: neither upgraded, rebooted nor restarted
            assert versions(testbed, name, KERNEL)[KERNEL] == f"hi {simhw.KERNEL_VERSION}", name
            assert boot_of(testbed, name) == boots[name] and started_at(testbed, name) == before[name], name
        ep.wait_state("spark-2", {"UP"}, timeout=60)  # serves again, in rotation
        rows = {r["host"]: r for r in status_json()["hosts"]}  # the kernel that runs, and why
        shown = rows[first]
        assert shown["kernel"] == simhw.KERNEL_RELEASE and shown["kernel_pinned"], shown
        assert shown["stack_drift"] == [], shown  # a newer image that GRUB is kept from is no reboot to come
        print(f"bad kernel: {load.ok} requests ok, {len(load.failed)} failed")
        assert load.ok > 0 and load.failed == [], load.failed[:5]
    finally:
        for name in testbed.names:
            testbed.exec(name, f"rm -f {UPDATES} {KEYRING}; apt-get update -qq", timeout=180)
