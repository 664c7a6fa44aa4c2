"""runtime/fetch_weights.py's failures as the deploy shows them: one ``error:`` line that
says what went wrong and what to do, exit 2, no traceback; driven through the real
huggingface_hub against the testbed's hub."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from sparkfleet.testbed.hub import HubServer

FETCH = Path(__file__).resolve().parents[2] / "runtime" / "fetch_weights.py"
REPO, GATED, REV = "acme/tiny", "acme/locked", "1" * 40
TOKEN = "hf_testbed_secret"


def repos(root: Path) -> Path:
    for repo in (REPO, GATED):
        (root / repo / REV).mkdir(parents=True)
        (root / repo / REV / "config.json").write_text("{}")
        (root / repo / "refs.json").write_text(json.dumps({"main": REV}))
    (root / GATED / ".gated").touch()
    return root


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    with HubServer(repos(tmp_path_factory.mktemp("repos")), "127.0.0.1", 0, token=TOKEN) as server:
        yield server


def fetch(endpoint: str, tmp_path: Path, repo: str, revision: str, token: str | None = None,
          fallback: str | None = None, also: tuple[str, ...] = (), round_waits: str = "0.1,0.1",
          start: bool = False):
    env = {**os.environ, "HF_ENDPOINT": endpoint, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_DISABLE_XET": "1",
           "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_ETAG_TIMEOUT": "3", "HF_HUB_DOWNLOAD_TIMEOUT": "3"}
    env.pop("HF_TOKEN", None)
    if token:
        env["HF_TOKEN"] = token
    more = ["--fallback-endpoint", fallback] if fallback else []
    more += [arg for each in also for arg in ("--also-endpoint", each)]
    more += ["--round-waits", round_waits]
    argv = [sys.executable, str(FETCH), repo, "--revision", revision, *more]
    if start:  # running, its output read as it comes
        return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("case,needle,key", [
    ("revision", "has no revision 'v9'", "model_revisions"),
    ("gone", "has no revision 'v9'", "fleet_lock_update"),
    ("repo", "acme/missing does not exist", "hf_token"),
    ("gated", "is gated and the HF token has no access", "hf_token"),
    ("token", "refused the HF token", "hf_token"),
    ("network", "did not answer", "network"),
])
def test_an_expected_failure_is_one_line_with_its_fix(hub, tmp_path, case, needle, key):
    endpoint = f"http://127.0.0.1:{closed_port()}" if case == "network" else hub.url
    repo = {"repo": "acme/missing", "gated": GATED}.get(case, REPO)
    revision = "v9" if case in ("revision", "gone") else "main"
    token = "hf_wrong_token_0123456789" if case == "token" else None
    done = fetch(endpoint, tmp_path, repo, revision, token)
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    errors = [line for line in done.stdout.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and needle in errors[0] and key in errors[0] and " — " in errors[0], out
    assert "Traceback" not in out
    if token:
        assert token not in out


def test_a_complete_download_still_succeeds(hub, tmp_path):
    done = fetch(hub.url, tmp_path, REPO, "main")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "complete: acme/tiny@" in done.stdout


def test_a_revision_upstream_deleted_comes_from_the_fallback_and_says_so(tmp_path):
    """The mirror's offline endpoint stands in (here a second hub that still holds it)."""
    gone, kept = tmp_path / "upstream", tmp_path / "mirror"
    for root in (gone, kept):
        (root / REPO / REV).mkdir(parents=True)
        (root / REPO / REV / "config.json").write_text('{"a": 1}')
    with HubServer(gone, "127.0.0.1", 0) as upstream, HubServer(kept, "127.0.0.1", 0) as mirror:
        upstream.move_ref(REPO)
        upstream.delete_revision(REPO, REV)  # a force-push: the locked commit is gone upstream
        done = fetch(upstream.url, tmp_path, REPO, REV, fallback=mirror.url)
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"report: {REPO}@{REV} is gone from {upstream.url} (RevisionNotFoundError): fetching it " \
               f"from the mirror's cache, {mirror.url}" in done.stdout
        assert f"complete: {REPO}@{REV}" in done.stdout
        # Not there either: one line, with the fix.
        mirror.move_ref(REPO)
        mirror.delete_revision(REPO, REV)
        failed = fetch(upstream.url, tmp_path / "again", REPO, REV, fallback=mirror.url)
        assert failed.returncode == 2 and "Traceback" not in failed.stdout + failed.stderr
        assert f"error: {REPO}@{REV} is gone from {upstream.url}, and the mirror does not hold it either" in failed.stdout
        assert f"--data fleet_lock_update={REPO}" in failed.stdout


def test_a_relay_that_does_not_answer_costs_a_retry_at_the_mirror_above(hub, tmp_path):
    dead = f"http://127.0.0.1:{closed_port()}"
    done = fetch(dead, tmp_path, REPO, REV, also=(f"http://127.0.0.1:{closed_port()}", hub.url))
    assert done.returncode == 0, done.stdout + done.stderr
    retries = [line for line in done.stdout.splitlines() if line.startswith("report: ")]
    assert len(retries) == 2 and retries[-1].endswith(f"fetching from {hub.url}"), done.stdout
    # Told at once, not after huggingface_hub's backoff on a refused connection (~23 s each).
    assert "Retrying in" not in done.stdout + done.stderr
    assert (tmp_path / "hf" / "hub" / "models--acme--tiny" / "snapshots" / REV / "config.json").exists()


def test_a_revision_refused_is_not_asked_of_the_relays_above(hub, tmp_path):
    done = fetch(hub.url, tmp_path, REPO, "v9", also=(f"http://127.0.0.1:{closed_port()}",))
    assert done.returncode == 2 and "has no revision 'v9'" in done.stdout
    assert "report: " not in done.stdout  # the same bytes above it: asking there changes nothing


def test_a_source_back_after_a_pause_is_asked_again(tmp_path):
    """No source answers (the mirror restarting; huggingface_hub's own retries spent): every
    source again after a pause, and the download completes once one answers."""
    port = closed_port()
    cmd = fetch(f"http://127.0.0.1:{port}", tmp_path, REPO, REV, round_waits="5,5", start=True)
    server = None
    try:
        for line in cmd.stdout:  # the first round failed: the source comes back during the pause
            if "no source answered" in line:
                server = HubServer(repos(tmp_path / "repos"), "127.0.0.1", port, token=TOKEN).start()
                break
        out = line + cmd.stdout.read()
        assert cmd.wait(timeout=120) == 0, out
    finally:
        cmd.kill()
        if server is not None:
            server.stop()
    assert "every source again in 5 s" in out and out.count("no source answered") == 1, out
    assert "complete: acme/tiny@" in out
    assert (tmp_path / "hf" / "hub" / "models--acme--tiny" / "snapshots" / REV / "config.json").exists()


def test_a_source_is_probed_directly_unless_a_proxy_stands_between(monkeypatch):
    from runtime.fetch_weights import refuses

    dead = f"http://127.0.0.1:{closed_port()}"
    assert isinstance(refuses(dead), ConnectionError)
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen(1)
        assert refuses(f"http://127.0.0.1:{listening.getsockname()[1]}") is None
    monkeypatch.setenv("http_proxy", "http://proxy.example:3128")
    monkeypatch.setenv("no_proxy", "")
    assert refuses(dead) is None  # only the proxy can say whether the source answers
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    assert isinstance(refuses(dead), ConnectionError)
