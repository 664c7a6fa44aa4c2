"""The stack's declared versions: validated with the rest, held, and their drift."""

from __future__ import annotations

import json

import pytest
from pyinfra.api import Config, Inventory, State
from pyinfra.api.connect import connect_all
from pyinfra.context import ctx_host, ctx_state

from sparkfleet import remote, snapshot, stack
from sparkfleet.config import ConfigError, project_defaults, validate_host_data
from sparkfleet.gpu import Gpu
from tests.test_deploy_plan import changes, plan


def settings(**over):
    return validate_host_data("spark-1", {**project_defaults(), **over})


def test_dpkg_status_says_installed_and_held():
    have = stack.parse_packages(["ii |nvidia-container-toolkit|1.17.8-1", "hi |docker.io|26.1.5+dfsg1-1",
                                 "un |docker-ce|", "rc |containerd|1.7.24~ds1-1", "garbage"])
    assert have == {"nvidia-container-toolkit": {"version": "1.17.8-1", "held": False},
                    "docker.io": {"version": "26.1.5+dfsg1-1", "held": True}}


def test_drift_names_a_declared_version_not_run_and_a_package_not_held():
    s = settings(stack_versions={"toolkit": {"nvidia-container-toolkit": "1.17.9-1"}, "docker": {"docker.io": None}})
    have = {"nvidia-container-toolkit": {"version": "1.17.8-1", "held": True},
            "docker.io": {"version": "26.1.5+dfsg1-1", "held": False}}
    assert stack.drift(s, have) == ["nvidia-container-toolkit 1.17.8-1, declared 1.17.9-1",
                                    "docker.io 26.1.5+dfsg1-1 not held"]
    have["nvidia-container-toolkit"]["version"] = "1.17.9-1"
    have["docker.io"]["held"] = True
    assert stack.drift(s, have) == []


def test_the_defaults_hold_every_component_at_what_the_host_runs():
    s = settings()
    assert set(s.stack_versions) == {"driver", "toolkit", "docker", "kernel"}
    assert stack.declared(s) == {}
    assert "nvidia-container-toolkit" in stack.packages(s) and "containerd.io" in stack.packages(s)


@pytest.mark.parametrize("value, needle", [
    ({"firmware": {"x": None}}, "unknown component 'firmware'"),
    ({"driver": {"NVIDIA Driver": None}}, "is not an apt package name"),
    ({"toolkit": {"nvidia-container-toolkit": "latest; rm -rf /"}}, "is not an apt version"),
])
def test_bad_stack_data_names_the_host_the_key_and_the_fix(value, needle):
    with pytest.raises(ConfigError) as err:
        settings(stack_versions=value)
    text = str(err.value)
    assert "spark-1" in text and "stack_versions" in text and needle in text and "apt-cache policy" in text


def test_the_deploy_holds_only_installed_packages_not_yet_held():
    out = changes(plan("loose,gb10"))
    line = next(li for li in out.splitlines() if "held (apt-mark hold)" in li)
    assert "spark-1-loose" in line and "spark-2-gb10" not in line


def test_a_bad_declared_version_stops_the_deploy_before_any_host():
    result = plan("loose", "stack_versions={\"kernel\": {\"linux-image-nvidia-hwe-24.04\": \"6.14 new\"}}")
    assert result.returncode != 0
    out = changes(result)
    assert "stack_versions" in out and "nothing was changed" in out and "Detected changes" not in out


def test_a_declared_version_moves_only_what_differs_and_a_driver_reboots():
    s = settings(stack_versions={"driver": {"nvidia-driver-580-open": "580.126.09-0ubuntu1"},
                                 "toolkit": {"nvidia-container-toolkit": "1.17.9-1", "libnvidia-container1": None}})
    have = {"nvidia-driver-580-open": {"version": "580.95.05-0ubuntu1", "held": True},
            "nvidia-container-toolkit": {"version": "1.17.9-1", "held": True}}
    moved = stack.moves(s, have)
    assert moved == {"nvidia-driver-580-open": ("580.95.05-0ubuntu1", "580.126.09-0ubuntu1")}
    assert stack.needs_reboot(s, list(moved)) and not stack.needs_reboot(s, ["nvidia-container-toolkit"])
    change = stack.change_of(s, moved)
    assert change.kind == "stack" and change.what.endswith("and reboot")
    assert "nvidia-driver-580-open 580.95.05-0ubuntu1 -> 580.126.09-0ubuntu1" in change.what
    assert change.back == "the previous versions (nvidia-driver-580-open 580.95.05-0ubuntu1)"


def test_the_upgrade_installs_exact_versions_past_the_hold_and_holds_them_again():
    command = stack.install_command({"nvidia-container-toolkit": "1.17.9-1", "containerd.io": "1.7.27-1"})
    install, hold = command.split(" && ")
    assert "--allow-change-held-packages" in install and "--allow-downgrades" in install
    assert install.endswith("nvidia-container-toolkit=1.17.9-1 containerd.io=1.7.27-1")
    assert hold == "apt-mark hold nvidia-container-toolkit containerd.io"


def test_a_declared_version_plans_the_upgrade_on_the_host_that_differs():
    out = changes(plan("loose,gb10", 'stack_versions={"toolkit": {"nvidia-container-toolkit": "1.17.8-1"}}'))
    line = next(li for li in out.splitlines() if "the stack runs the declared versions" in li)
    # spark-1 runs 1.17.8-1 already; spark-2 has no toolkit: it gets the declared one.
    assert "spark-2-gb10" in line and "spark-1-loose" not in line, out
    assert "upgrade the stack (nvidia-container-toolkit - -> 1.17.8-1)" in out


def test_status_shows_each_hosts_stack_and_its_drift():
    from sparkfleet import status

    s = settings(stack_versions={"toolkit": {"nvidia-container-toolkit": "1.17.9-1"}, "docker": {"docker.io": None}})
    assert "dpkg-query" in stack.status_command(s) and "docker.io" in stack.status_command(s)
    lines = "== unit\nActiveState=active\n== stack\nhi |nvidia-container-toolkit|1.17.8-1\nii |docker.io|26.1.5\n"
    row = status.parse_host(lines.splitlines(), s)
    assert row["stack_drift"] == ["nvidia-container-toolkit 1.17.8-1, declared 1.17.9-1", "docker.io 26.1.5 not held"]
    table = status.table({"hosts": [{"host": "spark-01", "reachable": True, **row}], "endpoint": None})
    assert ("stack on spark-01: nvidia-container-toolkit 1.17.8-1, docker.io 26.1.5 — DRIFT: nvidia-container-toolkit "
            "1.17.8-1, declared 1.17.9-1; docker.io 26.1.5 not held") in table, table
    held = status.parse_host("== stack\nhi |nvidia-container-toolkit|1.17.9-1\nhi |docker.io|26.1.5\n".splitlines(), s)
    assert held["stack_drift"] == []
    assert "docker.io 26.1.5, held" in status.table({"hosts": [{"host": "h", "reachable": True, **held}],
                                                     "endpoint": None})


def test_status_says_which_kernel_runs_and_a_newer_one_waiting_for_a_reboot(tmp_path, monkeypatch):
    """Read from what the status command prints on a host (sh runs it here, over this /boot)."""
    import os
    import subprocess

    from sparkfleet import status

    s = settings()
    pin = tmp_path / "99-sparkfleet-kernel.cfg"
    pin.write_text('# undone upgrade\nGRUB_DEFAULT="gnulinux-advanced-x>gnulinux-6.11.0-1016-nvidia-advanced-x"')
    monkeypatch.setattr(stack, "KERNEL_PIN", str(pin))
    said = subprocess.run(["sh", "-c", stack.status_command(s)], capture_output=True, text=True, timeout=30)
    assert f"kernel {os.uname().release}" in said.stdout.splitlines()
    assert 'pinned "gnulinux-advanced-x>gnulinux-6.11.0-1016-nvidia-advanced-x"' in said.stdout.splitlines()
    pin.unlink()
    assert "pinned" not in subprocess.run(["sh", "-c", stack.status_command(s)], capture_output=True,
                                          text=True, timeout=30).stdout

    def row(*lines: str) -> dict:
        return status.parse_host(["== stack", "hi |linux-image-nvidia-hwe-24.04|6.17.0-1008.8", *lines], s)

    waiting = row("kernel 6.11.0-1016-nvidia", "image 6.11.0-1016-nvidia", "image 6.17.0-1008-nvidia")
    assert waiting["kernel"] == "6.11.0-1016-nvidia" and waiting["stack_drift"] == [
        "kernel 6.17.0-1008-nvidia installed, 6.11.0-1016-nvidia runs: it boots at the next reboot"]
    undone = row("kernel 6.11.0-1016-nvidia", "image 6.17.0-1008-nvidia", "image 6.11.0-1016-nvidia",
                 'pinned "gnulinux-advanced-x>gnulinux-6.11.0-1016-nvidia-advanced-x"')
    assert undone["stack_drift"] == [] and undone["kernel_pinned"]
    table = status.table({"hosts": [{"host": "spark-01", "reachable": True, **undone}], "endpoint": None})
    assert "kernel 6.11.0-1016-nvidia runs (GRUB pinned to it: an upgrade was undone), held" in table, table
    newest = row("kernel 6.17.0-1008-nvidia", "image 6.9.0-1001-nvidia", "image 6.17.0-1008-nvidia")
    assert newest["stack_drift"] == []  # 6.17 is newer than 6.9: versions, not strings


def test_status_says_a_stack_once_for_the_hosts_that_share_it():
    from sparkfleet import status

    s = settings(stack_versions={"toolkit": {"nvidia-container-toolkit": None}})

    def row(name: str, held: str) -> dict:
        lines = ["== stack", f"{held} |nvidia-container-toolkit|1.17.8-1", "kernel 6.11.0-1016-nvidia"]
        return {"host": name, "reachable": True, **status.parse_host(lines, s)}

    rows = [row(f"spark-{i:02d}", "hi") for i in range(1, 33)]
    shared = "nvidia-container-toolkit 1.17.8-1; kernel 6.11.0-1016-nvidia runs, held"
    table = status.table({"hosts": rows, "endpoint": None})
    assert table.count("stack on") == 1 and f"stack on every host (32): {shared}" in table, table
    rows[6] = row("spark-07", "ii")  # one host's hold was lifted
    table = status.table({"hosts": rows, "endpoint": None})
    assert table.count("stack on") == 2 and "stack on spark-07: nvidia-container-toolkit 1.17.8-1; kernel " in table
    assert "stack on spark-01, spark-02, spark-03, spark-04, spark-05, spark-06, spark-08, " in table, table


def test_going_back_with_no_earlier_version_says_so_and_touches_nothing():
    s = settings(stack_versions={"toolkit": {"nvidia-container-toolkit": "1.17.9-1"}})
    change = stack.change_of(s, {"nvidia-container-toolkit": (None, "1.17.9-1")})
    assert change.back == "the previous versions (-)"
    # No host is passed: nothing may be run for an empty set of versions.
    assert change.undo(None) == "no earlier version to go back to (the packages were new on this host)"


@pytest.mark.parametrize("smi, problem", [
    (["NVIDIA GB10, 12.1, 580.126.09"], None),
    (["NVIDIA H100 80GB HBM3, 9.0, 580.126.09"],
     "nvidia-smi answers 'NVIDIA H100 80GB HBM3' after the upgrade, not NVIDIA GB10"),
    (["sh: 1: nvidia-smi: not found"], "nvidia-smi answers 'nothing' after the upgrade, not NVIDIA GB10"),
    (["Failed to initialize NVML: Driver/library version mismatch", "NVML library version: 580.126",
      "kernel_module=580.95.05"],
     "nvidia-smi answers Driver/library version mismatch after the upgrade (kernel module 580.95.05, "
     "library 580.126), not NVIDIA GB10"),
], ids=["gb10", "other-gpu", "no-nvidia-smi", "driver-mismatch"])
def test_after_the_switch_nvidia_smi_is_asked_again_as_the_preflight_asks_it(monkeypatch, smi, problem):
    asked = []

    def run(target, command, timeout=None, **kwargs):
        asked.append(command)
        return remote.Result(True, smi if command == Gpu().command() else [], [])

    monkeypatch.setattr(stack.remote, "run", run)
    assert stack._switched(None, {"nvidia-container-toolkit": "1.17.9-1"}, reboot=False) == problem
    assert asked.count(Gpu().command()) == 1
    assert ("systemctl is-active docker" in asked) == (problem is None)


#: The kernel entries of an Ubuntu grub.cfg (as update-grub writes them), a new kernel above the old.
GRUB_CFG = """menuentry 'Ubuntu' --class ubuntu $menuentry_id_option 'gnulinux-simple-0b3c' {
}
submenu 'Advanced options for Ubuntu' $menuentry_id_option 'gnulinux-advanced-0b3c' {
\tmenuentry 'Ubuntu, with Linux 6.14.0-1013-nvidia' --class ubuntu $menuentry_id_option 'gnulinux-6.14.0-1013-nvidia-advanced-0b3c' {
\t}
\tmenuentry 'Ubuntu, with Linux 6.14.0-1013-nvidia (recovery mode)' $menuentry_id_option 'gnulinux-6.14.0-1013-nvidia-recovery-0b3c' {
\t}
\tmenuentry 'Ubuntu, with Linux 6.11.0-1016-nvidia' --class ubuntu $menuentry_id_option 'gnulinux-6.11.0-1016-nvidia-advanced-0b3c' {
\t}
}
"""


def _grub(tmp_path, release, cfg=GRUB_CFG):
    """``boot_kernel_command(release)`` run by sh over a grub.cfg and pin of tmp_path, with an
    update-grub that records its call."""
    import subprocess

    (tmp_path / "grub.cfg").write_text(cfg)
    (tmp_path / "bin").mkdir(exist_ok=True)
    (tmp_path / "bin/update-grub").write_text(f"#!/bin/sh\necho ran >> {tmp_path}/updated\n")
    (tmp_path / "bin/update-grub").chmod(0o755)
    command = (stack.boot_kernel_command(release).replace("/boot/grub/grub.cfg", str(tmp_path / "grub.cfg"))
               .replace(stack.KERNEL_PIN, str(tmp_path / "grub.d/pin.cfg"))
               .replace("/etc/default/grub.d", str(tmp_path / "grub.d")))
    import os
    return subprocess.run(["sh", "-c", command], capture_output=True, text=True,
                          env={**os.environ, "PATH": f"{tmp_path}/bin:{os.environ['PATH']}"})


def test_going_back_from_a_kernel_makes_grub_boot_the_one_before(tmp_path):
    done = _grub(tmp_path, "6.11.0-1016-nvidia")
    assert done.returncode == 0, done.stderr
    pin = (tmp_path / "grub.d/pin.cfg").read_text()
    assert 'GRUB_DEFAULT="gnulinux-advanced-0b3c>gnulinux-6.11.0-1016-nvidia-advanced-0b3c"' in pin
    assert (tmp_path / "updated").read_text() == "ran\n"
    # The next upgrade boots the newest again: the pin goes, GRUB's own default is back.
    assert _grub(tmp_path, None).returncode == 0 and not (tmp_path / "grub.d/pin.cfg").exists()
    assert (tmp_path / "updated").read_text() == "ran\nran\n"
    assert _grub(tmp_path, None).returncode == 0 and (tmp_path / "updated").read_text() == "ran\nran\n"


def test_without_grubs_submenu_the_entry_alone_is_the_default(tmp_path):
    flat = "\n".join(line.lstrip("\t") for line in GRUB_CFG.splitlines() if not line.startswith(("submenu", "}")))
    done = _grub(tmp_path, "6.11.0-1016-nvidia", cfg=flat)
    assert done.returncode == 0, done.stderr
    assert 'GRUB_DEFAULT="gnulinux-6.11.0-1016-nvidia-advanced-0b3c"' in (tmp_path / "grub.d/pin.cfg").read_text()


def test_a_kernel_grub_does_not_list_is_not_pinned(tmp_path):
    done = _grub(tmp_path, "6.8.0-1001-nvidia")  # a prefix of no entry, and no entry of its own
    assert done.returncode == 1 and "GRUB lists no entry for kernel 6.8.0-1001-nvidia" in done.stderr
    assert not (tmp_path / "grub.d/pin.cfg").exists() and not (tmp_path / "updated").exists()


def test_an_undone_kernel_upgrade_must_boot_the_kernel_before_it(monkeypatch):
    s = settings(stack_versions={"kernel": {"linux-nvidia-hwe-24.04": "6.14.0-1013.13"}})
    moved = {"linux-nvidia-hwe-24.04": ("6.11.0-1016.16", "6.14.0-1013.13")}
    change = stack.change_of(s, moved, kernel="6.11.0-1016-nvidia")
    assert change.apply.keywords["kernel"] is None  # the upgrade: GRUB's newest
    assert change.undo.keywords["kernel"] == "6.11.0-1016-nvidia"
    asked, booted = [], {"release": "6.14.0-1013-nvidia"}

    def run(target, command, timeout=None, **kwargs):
        asked.append(command)
        if command == "uname -r":
            return remote.Result(True, [booted["release"]], [])
        return remote.Result(True, ["NVIDIA GB10, 12.1, 580.126.09"] if command == Gpu().command() else [], [])

    monkeypatch.setattr(stack.remote, "run", run)
    monkeypatch.setattr(stack, "_rebooted", lambda target: None)
    # GRUB still boots the new kernel: not "went back", whatever else answers.
    said = change.undo(None)
    assert said.startswith("the host booted kernel 6.14.0-1013-nvidia, not 6.11.0-1016-nvidia"), said
    assert stack.boot_kernel_command("6.11.0-1016-nvidia") in asked
    booted["release"] = "6.11.0-1016-nvidia"
    assert change.undo(None) is None
    # A toolkit's change leaves GRUB alone and asks no kernel.
    asked.clear()
    toolkit = stack.change_of(settings(), {"nvidia-container-toolkit": ("1.17.8-1", "1.17.9-1")})
    assert toolkit.undo(None) is None and "uname -r" not in asked and not any("grub" in c for c in asked)
    assert any("try-restart" in c for c in asked)  # no reboot: the engine restarts on the new stack
    # A driver reboots: the new boot starts the engine, and no restart follows it.
    asked.clear()
    driver = stack.change_of(settings(), {"nvidia-driver-580-open": ("580.95.05-0ubuntu1", "580.126.09-0ubuntu1")})
    assert driver.apply(None) is None and not any("try-restart" in c for c in asked), asked

# --- read with the host's snapshot, on a @fake host -------------------------------------------


def test_the_stacks_packages_are_read_with_the_hosts_snapshot_not_asked_apart():
    s = settings(stack_versions={"toolkit": {"nvidia-container-toolkit": "1.17.9-1"}, "docker": {"docker.io": None}})
    key, _ = snapshot._fact_entry(stack.StackPackages, {"packages": stack.packages(s)})
    have = ["ii |nvidia-container-toolkit|1.17.8-1", "hi |docker.io|26.1.5+dfsg1-1"]
    # The snapshot answers first; dpkg-query asked on its own would fail the test.
    responses = {"python3 -c": json.dumps({"facts": {key: have}}), "dpkg-query": {"success": False}}
    inventory = Inventory((["@fake/spark-1"], {"fake_responses": responses, "fake_delay": 0, "fake_delay_jitter": 0}))
    state = State(inventory, Config())
    with ctx_state.use(state):
        connect_all(state)
        target = inventory.get_host("@fake/spark-1")
        with ctx_host.use(target):
            stack.held(s)  # the deploy's first step: before the preflight reads the rest
            stack.upgraded(s)
    asked = target.connector.executed_commands
    assert asked and all(command.startswith("python3 -c") for command in asked), asked  # the snapshot's only
    planned = [state.get_op_meta(h).names for h in state.get_op_order()]
    assert planned == [{"Stack | driver, toolkit, Docker, kernel held (apt-mark hold)"},
                       {"Stack | the stack runs the declared versions"}], planned


@pytest.mark.parametrize("endpoint_host, driver_moves, warned", [
    ("@fake/spark-1", True, True), ("@fake/spark-2", True, False), ("@fake/spark-1", False, False)])
def test_a_reboot_of_the_endpoints_own_host_is_said_while_planning(monkeypatch, caplog, endpoint_host, driver_moves,
                                                                    warned):
    from sparkfleet import endpoint, rollout

    component = "driver" if driver_moves else "toolkit"
    package = {"driver": "nvidia-driver-580-open", "toolkit": "nvidia-container-toolkit"}[component]
    s = settings(stack_versions={component: {package: "2.0-1"}})
    key, _ = snapshot._fact_entry(stack.StackPackages, {"packages": stack.packages(s)})
    responses = {"python3 -c": json.dumps({"facts": {key: [f"hi |{package}|1.0-1"]}})}
    inventory = Inventory((["@fake/spark-1"], {"fake_responses": responses, "fake_delay": 0, "fake_delay_jitter": 0}))
    state = State(inventory, Config())
    monkeypatch.setattr(rollout, "applies", lambda *a, **k: True)  # a serving host that rolls
    monkeypatch.setattr(rollout, "planned", lambda *a, **k: None)
    monkeypatch.setattr(endpoint, "endpoint_name", lambda *a, **k: endpoint_host)
    with ctx_state.use(state):
        connect_all(state)
        with ctx_host.use(inventory.get_host("@fake/spark-1")):
            stack.upgraded(s)
    said = "serves the fleet endpoint: its reboot takes the endpoint down" in caplog.text
    assert said == warned, caplog.text
