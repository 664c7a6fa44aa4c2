"""The fleet source, without a fleet: which host serves whom, image references, and the
image copy tool against two real local registries (Debian's docker-registry)."""

from __future__ import annotations

import hashlib
import json
import os
import runpy
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from sparkfleet.config import ConfigError, FleetSource, fleet_sources, validate_fleet, validate_host_data
from sparkfleet.distribution import ImageName, image_reference

ROOT = Path(__file__).resolve().parents[1]
COPY_TOOL = ROOT / "templates" / "sparkfleet-copy-image.py"


def defaults() -> dict:
    data = runpy.run_path(str(ROOT / "group_data" / "all.py"))
    return {k: v for k, v in data.items() if not k.startswith("__")}


def fleet(*hosts: tuple[str, dict], groups: dict[str, list[str]] | None = None):
    out = []
    for name, data in hosts:
        merged = {**defaults(), **data}
        out.append(SimpleNamespace(name=name, groups=[g for g, members in (groups or {}).items() if name in members],
                                   data=SimpleNamespace(dict=lambda m=merged: m, get=merged.get)))
    return out


def sources(hosts) -> dict:
    return fleet_sources(hosts, validate_fleet(hosts))


def test_auto_is_the_first_host_and_everyone_uses_it():
    hosts = fleet(("spark-1", {"ssh_hostname": "10.0.0.11"}), ("spark-2", {}), ("spark-3", {}))
    got = sources(hosts)
    assert got["spark-1"] == FleetSource("spark-1", "10.0.0.11", 8090, 5000, True)
    assert got["spark-2"] == FleetSource("spark-1", "10.0.0.11", 8090, 5000, False)
    assert got["spark-3"].hf_endpoint == "http://10.0.0.11:8090" and got["spark-3"].registry == "10.0.0.11:5000"


def test_a_mirror_group_or_a_name_picks_the_host():
    hosts = fleet(("spark-1", {}), ("spark-2", {}), ("spark-3", {"mirror_address": "fast.lan"}),
                  groups={"mirror": ["spark-3"]})
    assert {s.host for s in sources(hosts).values()} == {"spark-3"}
    assert sources(hosts)["spark-1"].address == "fast.lan"
    named = fleet(*[(n, {"fleet_mirror": "spark-2"}) for n in ("spark-1", "spark-2")])
    assert sources(named)["spark-1"].host == "spark-2" and sources(named)["spark-2"].is_self


def test_none_turns_it_off_for_every_host_or_one():
    off = fleet(("spark-1", {"fleet_mirror": "none"}), ("spark-2", {"fleet_mirror": None}))
    assert sources(off) == {"spark-1": None, "spark-2": None}
    one = fleet(("spark-1", {}), ("spark-2", {"fleet_mirror": "off"}))
    assert sources(one)["spark-2"] is None and sources(one)["spark-1"].is_self


def test_an_unknown_mirror_or_a_mirror_that_does_not_use_itself_is_refused():
    with pytest.raises(ConfigError, match=r"spark-2: `fleet_mirror` = 'spark-9' is not a host"):
        validate_fleet(fleet(("spark-1", {}), ("spark-2", {"fleet_mirror": "spark-9"})))
    with pytest.raises(ConfigError, match=r"spark-2: serves the fleet source for spark-1, so it must use it too"):
        validate_fleet(fleet(("spark-1", {"fleet_mirror": "spark-2"}), ("spark-2", {"fleet_mirror": None})))


@pytest.mark.parametrize("key,value,needle", [
    ("mirror_olah", "olah==0.5.4; rm -rf /", "not a pip requirement"),
    ("mirror_address", "spark 1", "host name or an IPv4 address"),
    ("mirror_dir", "relative/dir", "absolute path"),
    ("mirror_hf_port", 0, "greater than or equal to 1"),
    ("mirror_apt_repo", "http://apt.lan/", "both mirror_apt_repo and mirror_apt_key_url"),
])
def test_mirror_settings_are_validated(key, value, needle):
    with pytest.raises(ConfigError, match=needle):
        validate_host_data("spark-1", {**defaults(), key: value})


@pytest.mark.parametrize("reference,expected", [
    ("ghcr.io/aeon-7/vllm:2026-06-18", ("ghcr.io", "aeon-7/vllm", "2026-06-18", None)),
    ("10.213.0.1:5000/sparkfleet/vllm-sim:0.23.0@sha256:" + "a" * 64,
     ("10.213.0.1:5000", "sparkfleet/vllm-sim", "0.23.0", "sha256:" + "a" * 64)),
    ("vllm/vllm-openai", ("docker.io", "vllm/vllm-openai", "latest", None)),
    ("ubuntu@sha256:" + "b" * 64, ("docker.io", "library/ubuntu", None, "sha256:" + "b" * 64)),
    ("localhost:5000/x:1", ("localhost:5000", "x", "1", None)),
])
def test_image_names(reference, expected):
    name = ImageName.parse(reference)
    assert (name.registry, name.path, name.tag, name.digest) == expected


def test_hosts_run_the_fleet_registrys_copy_with_the_same_pin():
    settings = validate_host_data("spark-2", {**defaults(), "image": "ghcr.io/a/b:1@sha256:" + "c" * 64})
    source = FleetSource("spark-1", "10.0.0.11", 8090, 5000, False)
    assert image_reference(settings, source) == "10.0.0.11:5000/a/b:1@sha256:" + "c" * 64


# --- the copy tool against real registries -------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def registries(tmp_path):
    """Two empty docker-registry servers on localhost: (source URL, fleet URL)."""
    if not shutil.which("docker-registry"):
        pytest.skip("docker-registry is not installed (apt-get install docker-registry)")
    procs, urls = [], []
    for name in ("upstream", "fleet"):
        port = _free_port()
        config = tmp_path / f"{name}.json"
        config.write_text(json.dumps({
            "version": 0.1, "log": {"level": "error", "accesslog": {"disabled": False}},
            "storage": {"filesystem": {"rootdirectory": str(tmp_path / name)}},
            "http": {"addr": f"127.0.0.1:{port}"},
        }))
        log = open(tmp_path / f"{name}.log", "w")
        procs.append(subprocess.Popen(["docker-registry", "serve", str(config)], stdout=log, stderr=subprocess.STDOUT))
        urls.append(f"http://127.0.0.1:{port}")
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.05)
    yield urls[0], urls[1], tmp_path
    for proc in procs:
        proc.terminate()
        proc.wait(timeout=10)


def _push(url: str, repo: str, tag: str, blobs: list[bytes]) -> str:
    from sparkfleet.testbed.registry import RegistryClient, manifest_bytes

    client = RegistryClient(url)
    config = json.dumps({"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers", "diff_ids": []}}).encode()
    layers = []
    for blob in blobs:
        digest = "sha256:" + hashlib.sha256(blob).hexdigest()
        client.push_blob(repo, blob, digest)
        layers.append((None, digest, len(blob)))
    client.push_blob(repo, config, "sha256:" + hashlib.sha256(config).hexdigest())
    return client.put_manifest(repo, tag, manifest_bytes(config, layers))


def _copy(src: str, repo: str, ref: str, dst: str, *extra: str) -> dict:
    done = subprocess.run([sys.executable, str(COPY_TOOL), src, repo, ref, dst, *extra],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "HOME": "/nonexistent"})
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1].removeprefix("RESULT "))


def test_the_copy_keeps_the_digest_and_reads_each_blob_once(registries):
    upstream, fleet_url, _ = registries
    blobs = [os.urandom(3_000_000), os.urandom(1_000_000)]
    digest = _push(upstream, "org/img", "1.0", blobs)
    first = _copy(upstream, "org/img", digest, fleet_url, "--tag", "1.0")
    assert first["digest"] == digest
    assert sum(len(b) for b in blobs) <= first["upstream_bytes"] < sum(len(b) for b in blobs) + 1000  # + config
    from sparkfleet.testbed.registry import RegistryClient

    manifest, served = RegistryClient(fleet_url).get_manifest("org/img", "1.0")
    assert served == digest and len(manifest["layers"]) == 2
    again = _copy(upstream, "org/img", digest, fleet_url, "--tag", "1.0")
    assert again["upstream_bytes"] == 0 and again["present_bytes"] == first["upstream_bytes"]


def test_a_copy_interrupted_after_some_blobs_continues_with_the_rest(registries):
    upstream, fleet_url, _ = registries
    blobs = [os.urandom(2_000_000), os.urandom(2_000_000)]
    digest = _push(upstream, "org/img", "2", blobs)
    # The fleet registry already holds the first layer (as after a cut-off copy).
    from sparkfleet.testbed.registry import RegistryClient

    RegistryClient(fleet_url).push_blob("org/img", blobs[0], "sha256:" + hashlib.sha256(blobs[0]).hexdigest())
    result = _copy(upstream, "org/img", digest, fleet_url)
    assert result["present_bytes"] == len(blobs[0])
    assert len(blobs[1]) <= result["upstream_bytes"] < len(blobs[1]) + 1000


def test_a_wrong_pin_is_refused(registries):
    upstream, fleet_url, _ = registries
    _push(upstream, "org/img", "3", [os.urandom(1000)])
    done = subprocess.run([sys.executable, str(COPY_TOOL), upstream, "org/img", "sha256:" + "0" * 64, fleet_url],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "404" in (done.stdout + done.stderr)


# --- huggingface_hub through olah, against the testbed's hub --------------------------------


@pytest.fixture(scope="module")
def olah_lib(tmp_path_factory):
    """olah (mirror_olah) installed into a directory, from the wheelhouse the deploy uses."""
    import platform

    from sparkfleet.distribution import _controller_wheelhouse

    python = {"major": sys.version_info[0], "minor": sys.version_info[1], "machine": platform.machine(),
              "glibc": platform.libc_ver()[1] or "-"}
    try:
        wheels = _controller_wheelhouse(defaults()["mirror_olah"], python)
    except Exception as exc:  # noqa: BLE001 - no index reachable: nothing to test against
        pytest.skip(f"olah wheels unavailable: {exc}")
    target = tmp_path_factory.mktemp("olah")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(target),
                    *[str(w) for w in wheels.glob("*.whl") if not w.name.startswith("pip-")]],  # as the host does
                   check=True, timeout=300, capture_output=True)
    return target


def test_huggingface_hub_resumes_through_olah_and_the_hub_sees_each_byte_once(olah_lib, tmp_path):
    """The sim image's huggingface_hub, HF_ENDPOINT at olah, olah at the testbed hub: the
    files are byte-identical, a dropped connection is resumed with a Range request that
    olah answers (206), and a second client is served from olah's cache."""
    from huggingface_hub import constants, hf_hub_download

    from sparkfleet.testbed.hub import HubServer

    repo, rev = "acme/big", "1" * 40
    chunk = constants.DOWNLOAD_CHUNK_SIZE
    data = os.urandom(3 * chunk + 12345)
    (tmp_path / "repos" / repo / rev).mkdir(parents=True)
    (tmp_path / "repos" / repo / rev / "big.safetensors").write_bytes(data)
    port = _free_port()
    with HubServer(tmp_path / "repos", "127.0.0.1", 0) as hub:
        config = tmp_path / "olah.toml"
        config.write_text(
            f'[basic]\nhost = "127.0.0.1"\nport = {port}\nrepos-path = "{tmp_path / "cache"}"\n'
            f'hf-scheme = "http"\nhf-netloc = "127.0.0.1:{hub.port}"\nhf-lfs-netloc = "127.0.0.1:{hub.port}"\n'
            f'mirror-netloc = "127.0.0.1:{port}"\nmirror-lfs-netloc = "127.0.0.1:{port}"\n'
        )
        log = tmp_path / "olah.log"
        olah = subprocess.Popen(
            [sys.executable, "-m", "olah.server", "--config", str(config), "--log-path", str(tmp_path / "logs")],
            env={**os.environ, "PYTHONPATH": str(olah_lib), "GIT_PYTHON_REFRESH": "quiet"},
            stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=tmp_path,
        )
        try:
            for _ in range(300):
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                    break
                except OSError:
                    time.sleep(0.1)
            hub.inject_abort(repo, "big.safetensors", after_bytes=2 * chunk + 5)  # the WAN drops once
            mirror = f"http://127.0.0.1:{port}"
            first = hf_hub_download(repo, "big.safetensors", revision=rev, cache_dir=tmp_path / "a", endpoint=mirror)
            second = hf_hub_download(repo, "big.safetensors", revision=rev, cache_dir=tmp_path / "b", endpoint=mirror)
            assert Path(first).read_bytes() == data and Path(second).read_bytes() == data
            served = [line for line in log.read_text().splitlines() if '"GET /acme/big/resolve/' in line]
            assert any("206 Partial Content" in line for line in served), served
            # Upstream: the file once, plus what olah had of the block the drop cut (olah keeps
            # whole blocks only, so a cut block is fetched again from its start).
            gets = [r for r in hub.requests() if r["method"] == "GET"]
            assert [g["bytes"] for g in gets] == [2 * chunk + 5, len(data)]
        finally:
            olah.terminate()
            olah.wait(timeout=10)
