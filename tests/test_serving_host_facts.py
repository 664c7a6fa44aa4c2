"""What the serving host's and the mirror's facts make of what hosts answer (the e2e suite runs them for real)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from sparkfleet.facts import CachedSnapshot, ContainerdRoot, ManifestSize, NewLines
from sparkfleet.gpu import CDI_ALL, GPUS_ALL, GpuAccess
from sparkfleet.hostpaths import repo_cache_dir, snapshot_marker
from sparkfleet.image import store_of
from sparkfleet.oomguard import earlyoom_args

SPEC = ["docker=28.5.2", 'cdi_dirs=["/etc/cdi","/var/run/cdi"]', "cdi_spec=/etc/cdi/nvidia.yaml",
        "cdi_hook=/usr/bin/nvidia-cdi-hook", "hook="]


def test_a_probe_is_the_truth_whatever_the_evidence():
    out = GpuAccess().process([*SPEC, "probed=yes", f"works={CDI_ALL}"])
    assert out["probed"] and out["works"] == [CDI_ALL]
    assert GpuAccess().process(["hook=/usr/bin/nvidia-container-runtime-hook", "hook_registered=yes",
                                "probed=yes"])["works"] == []


def test_without_the_image_the_evidence_decides():
    # Docker 28 with CDI only: --device, not --gpus (measured on the testbed).
    assert GpuAccess().process(SPEC)["works"] == [CDI_ALL]
    # Docker 29 maps --gpus to CDI when nvidia-cdi-hook is there.
    assert GpuAccess().process(["docker=29.1.0", *SPEC[1:]])["works"] == [GPUS_ALL, CDI_ALL]
    # The legacy hook counts only if dockerd started after it appeared.
    legacy = ["docker=28.5.2", "cdi_dirs=[]", "hook=/usr/bin/nvidia-container-runtime-hook"]
    assert GpuAccess().process(legacy)["works"] == []
    assert GpuAccess().process([*legacy, "hook_registered=yes"])["works"] == [GPUS_ALL]
    # A spec with CDI off in docker gives nothing.
    assert GpuAccess().process(["docker=28.5.2", "cdi_dirs=null", "cdi_spec=/etc/cdi/nvidia.yaml"])["works"] == []


def test_the_image_store_is_read_from_docker_info():
    classic = {"DockerRootDir": "/var/lib/docker", "DriverStatus": [["Backing Filesystem", "extfs"]]}
    assert store_of(classic, lambda: "unused") == {"containerd": False, "path": "/var/lib/docker"}
    c8d = {"DockerRootDir": "/var/lib/docker", "DriverStatus": [["driver-type", "io.containerd.snapshotter.v1"]]}
    assert store_of(c8d, lambda: "/data/containerd") == {"containerd": True, "path": "/data/containerd"}
    assert store_of({}, lambda: "unused") is None
    assert ContainerdRoot().process(["/data/containerd"]) == "/data/containerd"
    assert ContainerdRoot().process([]) == "/var/lib/containerd"


def test_manifest_size_needs_the_scripts_answer():
    assert ManifestSize().process(["compressed 22548578304"]) == 22548578304
    assert ManifestSize().process(["Traceback (most recent call last):"]) is None


def test_new_kills_and_the_guard_line():
    assert NewLines().process(["total 2", "T1 killed a", "T2 killed b"]) == {"lines": ["T1 killed a", "T2 killed b"],
                                                                          "total": 2}
    assert NewLines().process(["total 2"])["lines"] == []

    args = earlyoom_args(4.0)
    assert args.startswith("-M 4194304 -s 100,100 ") and "--avoid" in args and "sshd" in args


def _answer(fact, **kwargs) -> list[str]:
    command = fact().command(**kwargs)
    return subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True).stdout.splitlines()


def test_a_cached_snapshot_is_complete_only_while_every_blob_has_its_verified_size(tmp_path):
    hf, repo, commit = str(tmp_path), "org/model", "c0ffee" * 6 + "c0fe"
    blobs = Path(repo_cache_dir(hf, repo)) / "blobs"
    snap = Path(repo_cache_dir(hf, repo)) / "snapshots" / commit
    (snap / "sub").mkdir(parents=True)
    blobs.mkdir()
    records = tmp_path / "sparkfleet" / "verified"
    records.mkdir(parents=True)
    for name, body in (("a" * 64, b"weights"), ("b" * 40, b"{}")):
        (blobs / name).write_bytes(body)
        (records / name).write_text(f"{len(body)}\n")
    (snap / "model.safetensors").symlink_to(f"../../blobs/{'a' * 64}")
    (snap / "sub" / "config.json").symlink_to(f"../../../blobs/{'b' * 40}")
    ask = {"hf_home": hf, "repo_id": repo, "revision": "main"}
    assert CachedSnapshot().process(_answer(CachedSnapshot, **ask)) is None  # no marker yet
    marker = Path(snapshot_marker(hf, repo, "main"))
    marker.parent.mkdir(parents=True)
    marker.write_text(commit + "\n")
    assert CachedSnapshot().process(_answer(CachedSnapshot, **ask)) == commit
    (blobs / ("a" * 64)).write_bytes(b"weight")  # truncated since it was verified
    assert CachedSnapshot().process(_answer(CachedSnapshot, **ask)) is None
    (blobs / ("a" * 64)).unlink()  # gone
    assert CachedSnapshot().process(_answer(CachedSnapshot, **ask)) is None


def test_new_lines_are_the_lines_past_the_count_reported(tmp_path):
    log, reported = tmp_path / "oom-guard.log", tmp_path / "oom-guard.reported"
    read = lambda: NewLines().process(_answer(NewLines, log=str(log), reported=str(reported)))  # noqa: E731
    assert read() == {"lines": [], "total": 0}  # neither file yet
    log.write_text("T1 killed a\nT2 killed b\nT3 killed c\n")
    assert read() == {"lines": ["T1 killed a", "T2 killed b", "T3 killed c"], "total": 3}
    reported.write_text("2")  # no newline: as a count is written
    assert read() == {"lines": ["T3 killed c"], "total": 3}
    reported.write_text("3\n")
    assert read() == {"lines": [], "total": 3}


def test_held_artifacts_name_each_marker_with_its_first_line(tmp_path):
    from sparkfleet.facts import HeldArtifacts
    from sparkfleet.hostpaths import snapshot_markers_dir

    markers = Path(snapshot_markers_dir(str(tmp_path)))
    assert _answer(HeldArtifacts, hf_home=str(tmp_path), images=[]) == []
    markers.mkdir(parents=True)
    (markers / "org--a").write_text("0123abcd\nsecond line\n")
    (markers / "org--b").write_text("  spaced")  # kept as written, no newline needed
    (markers / "dir").mkdir()
    assert sorted(_answer(HeldArtifacts, hf_home=str(tmp_path), images=[])) == ["marker org--a 0123abcd", "marker org--b   spaced"]


def test_mirror_trust_names_each_registry_with_sparkfleets_marker(tmp_path, monkeypatch):
    from sparkfleet import hostpaths
    from sparkfleet.mirror.facts import MirrorTrust

    monkeypatch.setattr(hostpaths, "DOCKER_CERTS_DIR", str(tmp_path))
    for registry, marked in (("10.0.0.1:5000", True), ("[fd00::1]:5000", True), ("other:443", False)):
        (tmp_path / registry).mkdir()
        if marked:
            (tmp_path / registry / hostpaths.MIRROR_TRUST_MARKER).write_text("placed\n")
    assert sorted(MirrorTrust().process(_answer(MirrorTrust))) == ["10.0.0.1:5000", "[fd00::1]:5000"]
