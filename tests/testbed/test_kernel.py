"""The simulated kernel (simhw/kernel.py), run as the hosts run it over a root of files: GRUB
boots the newest image, or the one the deploy pins when it undoes a kernel upgrade
(sparkfleet.stack.boot_kernel_command, run over the simulated update-grub's grub.cfg); and
a kernel without the NVIDIA module leaves nvidia-smi failing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from sparkfleet import stack
from sparkfleet.gpu import Gpu
from sparkfleet.testbed import simhw

KERNEL = simhw.HERE / "kernel.py"
OLD, NEW = "6.11.0-1016-nvidia", "6.17.0-1008-nvidia"


def kernel(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(KERNEL), *args], capture_output=True, text=True, timeout=30,
                          env={"SPARKFLEET_SIM_ROOT": str(root), "PATH": os.environ["PATH"]})


def install(root: Path, *releases: str) -> None:
    for release in releases:
        (root / "boot").mkdir(exist_ok=True)
        (root / f"boot/vmlinuz-{release}").write_text(release)
    assert kernel(root, "update-grub").returncode == 0


def boot(root: Path) -> str:
    (root / "run/sparkfleet-sim/kernel.release").unlink(missing_ok=True)  # a new boot: /run is empty
    assert kernel(root, "boot").returncode == 0
    return kernel(root, "release").stdout.strip()


def test_grub_boots_the_newest_kernel_installed(tmp_path):
    install(tmp_path, OLD)
    assert boot(tmp_path) == OLD
    install(tmp_path, NEW)  # 6.17 after 6.11, by version, not by name
    assert boot(tmp_path) == NEW
    (tmp_path / "boot" / f"vmlinuz-{NEW}").unlink()
    install(tmp_path)
    assert boot(tmp_path) == OLD


def test_going_back_pins_the_kernel_before_and_the_next_upgrade_unpins_it(tmp_path):
    """The deploy's own commands over the simulated GRUB: the pin it writes names an entry of
    the grub.cfg update-grub wrote, and the host then boots that kernel."""
    install(tmp_path, OLD, NEW)
    pin = tmp_path / stack.KERNEL_PIN.lstrip("/")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "update-grub").write_text(f"#!/bin/sh\nexec {sys.executable} {KERNEL} update-grub\n")
    (bin_dir / "update-grub").chmod(0o755)

    def deploy_runs(release: str | None) -> subprocess.CompletedProcess:
        command = (stack.boot_kernel_command(release)
                   .replace("/boot/grub/grub.cfg", str(tmp_path / "boot/grub/grub.cfg"))
                   .replace("/etc/default/grub.d", str(pin.parent)))
        return subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=30,
                              env={"SPARKFLEET_SIM_ROOT": str(tmp_path), "PATH": f"{bin_dir}:{os.environ['PATH']}"})

    done = deploy_runs(OLD)
    assert done.returncode == 0, done.stderr
    assert f"gnulinux-{OLD}-advanced-" in pin.read_text()
    assert boot(tmp_path) == OLD  # the newer image stays installed; GRUB boots the one before
    done = deploy_runs(None)
    assert done.returncode == 0 and not pin.exists(), done.stderr
    assert boot(tmp_path) == NEW


def test_a_boot_keeps_its_kernel_until_the_next_boot(tmp_path):
    install(tmp_path, OLD)
    assert boot(tmp_path) == OLD
    install(tmp_path, NEW)
    assert kernel(tmp_path, "boot").returncode == 0  # apply-switches run again: the same boot
    assert kernel(tmp_path, "release").stdout.strip() == OLD


def test_without_a_simulated_kernel_the_machines_release_stands(tmp_path):
    assert kernel(tmp_path, "boot").returncode == 0
    assert kernel(tmp_path, "release").returncode == 1


def test_a_kernel_without_the_nvidia_module_leaves_nvidia_smi_failing(tmp_path, monkeypatch, capsys):
    from sparkfleet.testbed.simhw import nvidia_smi

    module = tmp_path / "module.version"
    module.write_text("none\n")  # apply-switches' note for a boot without the module
    monkeypatch.setattr(nvidia_smi, "MODULE_FILE", str(module))
    fact = Gpu()
    assert nvidia_smi.main(fact.command().split(" 2>")[0].split()[1:]) == nvidia_smi.NOT_LOADED_STATUS
    said = capsys.readouterr().out
    assert "couldn't communicate with the NVIDIA driver" in said
    assert fact.process(said.splitlines()) is None  # the deploy reads no GPU there
