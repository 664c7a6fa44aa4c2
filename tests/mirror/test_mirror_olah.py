"""huggingface_hub through olah (mirror_olah), installed from the wheelhouse the deploy
uses, against the testbed's hub: byte-identical, resumed, served from olah's cache."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.fleetdata import defaults, free_port

# The controller resolves olah's wheels with pip from its index, like a deploy does.
pytestmark = pytest.mark.network

@pytest.fixture(scope="module")
def olah_lib(tmp_path_factory):
    """olah (mirror_olah) installed into a directory, from the wheelhouse the deploy uses."""
    import platform

    from sparkfleet.mirror.hf import controller_wheelhouse

    python = {"major": sys.version_info[0], "minor": sys.version_info[1], "machine": platform.machine(),
              "glibc": platform.libc_ver()[1] or "-"}
    try:
        wheels = controller_wheelhouse(defaults()["mirror_olah"], python)
    except Exception as exc:  # noqa: BLE001 - no index reachable: this test needs the network
        pytest.fail(f"olah wheels unavailable (this test needs the package index): {exc}")
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
    port = free_port()
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
