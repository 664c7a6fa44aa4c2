"""A host never loses a working server: one deploy converges it from any state, a change
that does not get READY is rolled back on that host, crash loops end, and docker's own
stop/start brings the server back.

The tests share the session's fleet and leave it serving the defaults. (The module runs
after test_deploy.py, whose first test wants a fleet nothing was deployed to.)
"""

from __future__ import annotations

import re
import socket
import time

import pytest
from support.failures import changed_hosts, changes

from sparkfleet.testbed.proc import wait_until
from tests.e2e.test_deploy import SERVE_ENV, completion, unit
from tests.e2e.test_image_patches import serving_state

pytestmark = pytest.mark.e2e
# Passes validation and the image's argument check, but the engine refuses it at start:
# the model's config.json allows 262144 tokens.
TOO_LONG = '["--max-model-len", "300000"]'


def test_the_fleet_serves_the_defaults(testbed, run_pyinfra):
    result = run_pyinfra("deploy.py")
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]


@pytest.mark.parametrize(("data", "key", "said"), [
    ("tool_call_parser=bogus", "tool_call_parser", "invalid tool call parser: bogus"),
    ('extra_serve_args=["--max-loras", "2", "stray"]', "extra_serve_args", "unrecognized arguments: stray"),
])
def test_a_value_the_images_vllm_refuses_fails_every_host_before_anything_changes(testbed, run_pyinfra, data, key,
                                                                                   said):
    before = {name: serving_state(testbed, name) for name in testbed.names}
    result = run_pyinfra("deploy.py", "--data", data, "--data", "rollout=all")
    out = result.stdout + result.stderr
    assert result.returncode != 0
    for name in testbed.names:
        assert re.search(rf"\[{name}(?:\.local)?\] vLLM 0\.23\.0 in \S+ refuses the serving command: "
                         rf"{re.escape(said)}.* key: {key} .*Fix: ", out), out[-4000:]
        # The old server, its unit and serve.env are untouched: same container, same start.
        assert serving_state(testbed, name) == before[name]
        assert "Paris" in (completion(testbed, name) or "")


def test_a_change_that_breaks_the_engine_is_rolled_back_on_every_host(testbed, run_pyinfra):
    result = run_pyinfra("deploy.py", "--data", f"extra_serve_args={TOO_LONG}", "--data", "ready_timeout_s=120",
                         "--data", "rollout=all")
    out = result.stdout + result.stderr
    assert result.returncode != 0
    for name in testbed.names:
        # Named: the host, the change, the outcome; the old settings serve again.
        assert re.search(rf"\[{name}(?:\.local)?\].*rolled back: the last good settings serve again", out), out[-4000:]
        assert f"SF_EXTRA_ARGS '' -> {TOO_LONG!r}" in out
        assert "SF_EXTRA_ARGS=\n" in testbed.exec(name, f"cat {SERVE_ENV}").stdout
        assert "Paris" in (completion(testbed, name) or "")
        assert unit(testbed, name)["ActiveState"] == "active"
    # What is on disk is what serves: the next deploy has nothing to do.
    again = run_pyinfra("deploy.py")
    assert again.returncode == 0 and changes(again.stdout + again.stderr) == [], again.stdout[-3000:]


def test_a_host_with_nothing_good_before_is_left_stopped_not_crash_looping(testbed, run_pyinfra):
    fresh = testbed.names[2]
    testbed.exec(fresh, "rm -rf /var/lib/sparkfleet/last-good")  # as on a first deploy
    result = run_pyinfra("deploy.py", "--data", f"extra_serve_args={TOO_LONG}", "--data", "ready_timeout_s=120",
                         "--data", "rollout=all")
    out = result.stdout + result.stderr
    assert result.returncode != 0
    assert re.search(rf"\[{fresh}(?:\.local)?\].*nothing else got READY on this host before, so sparkfleet-serve.service "
                     r"is stopped", out), out[-4000:]
    time.sleep(15)  # longer than RestartSec: a crash loop would have started again
    assert unit(testbed, fresh)["ActiveState"] in ("inactive", "failed")
    for name in testbed.names[:2]:
        assert "Paris" in (completion(testbed, name) or "")
    result = run_pyinfra("deploy.py")
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "Paris" in (completion(testbed, fresh) or "")
    assert testbed.exec(fresh, "test -f /var/lib/sparkfleet/last-good/serving.rev && echo kept").stdout.strip() == "kept"


def test_a_crash_loop_ends_and_one_deploy_converges_the_host(testbed, run_pyinfra):
    name = testbed.names[1]
    # Something else takes the port while our server is down: the engine cannot bind.
    testbed.exec(name, "systemctl stop sparkfleet-serve && systemd-run --unit=sf-test-squatter "
                       "python3 -m http.server 8000 && sleep 1 && systemctl start sparkfleet-serve", check=True)
    # Bounded: after StartLimitBurst starts systemd gives up and shows failed.
    wait_until(lambda: unit(testbed, name)["ActiveState"] == "failed", 180, 2, "the crash loop to end as failed")
    assert int(unit(testbed, name)["NRestarts"]) <= 5
    testbed.exec(name, "systemctl stop sf-test-squatter", check=True)
    # The deploy's own start is not blocked by that limit, and one run converges the host.
    result = run_pyinfra("deploy.py")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert "Paris" in (completion(testbed, name) or "")
    again = run_pyinfra("deploy.py")
    assert again.returncode == 0 and changes(again.stdout + again.stderr) == [], again.stdout[-3000:]


def test_a_host_restarting_on_its_own_runs_the_settings_on_disk_after_one_deploy(testbed, run_pyinfra):
    name = testbed.names[0]
    # The engine dies while a new setting is deployed: systemd's own restart races the deploy.
    testbed.exec(name, "docker kill --signal KILL sparkfleet-serve")
    result = run_pyinfra("deploy.py", "--data", "max_num_seqs=2")
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    argv = testbed.exec(name, "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '").stdout
    assert "--max-num-seqs 2" in argv
    started = unit(testbed, name)["ExecMainStartTimestampMonotonic"]
    again = run_pyinfra("deploy.py", "--data", "max_num_seqs=2")
    assert again.returncode == 0 and changes(again.stdout + again.stderr) == []
    assert unit(testbed, name)["ExecMainStartTimestampMonotonic"] == started
    assert run_pyinfra("deploy.py").returncode == 0


def test_docker_stopped_and_started_brings_the_server_back_without_a_deploy(testbed):
    name = testbed.names[2]
    testbed.exec(name, "systemctl stop docker.socket docker", check=True, timeout=120)
    assert unit(testbed, name)["ActiveState"] in ("inactive", "failed")
    testbed.exec(name, "systemctl start docker", check=True, timeout=120)
    assert "Paris" in wait_until(lambda: completion(testbed, name), 180, 2, "the server to answer after docker start")


def _biggest_blob(testbed, name: str) -> str:
    """The biggest blob of the checkpoint the default profile serves (other tests may have
    cached other repositories, which a deploy of the default profile does not look at)."""
    repo = "/var/lib/sparkfleet/hf/hub/models--bleysg--Qwen3.5-122B-A10B-int4-fp8-hybrid"
    return testbed.exec(name, f"ls -S {repo}/blobs/* | head -n 1").stdout.strip()


def _blob_matches(testbed, name: str, blob: str) -> bool:
    digest = testbed.exec(name, f"sha256sum {blob} | cut -d' ' -f1").stdout.strip()
    return blob.rsplit("/", 1)[-1] == digest


def test_a_truncated_weight_blob_is_seen_and_downloaded_again(testbed, run_pyinfra):
    name = testbed.names[0]
    blob = _biggest_blob(testbed, name)
    assert len(blob.rsplit("/", 1)[-1]) == 64, blob  # an LFS blob, named by its sha256
    testbed.exec(name, f"truncate -s -4096 {blob}", check=True)
    result = run_pyinfra("deploy.py")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert _blob_matches(testbed, name, blob)
    # The step reported it: in the deploy's output, else (seen once with three shards on two
    # cores, cause not found) in the host's journal.
    journal = testbed.exec(name, "journalctl -o cat --no-pager | grep -c 'report: corrupt' || true").stdout.strip()
    assert re.search(rf"\[{name}(?:\.local)?\].*corrupt: .* downloading again", out) or int(journal or 0) > 0
    for other in testbed.names[1:]:  # their caches were fine
        assert not re.search(rf"\[{other}(?:\.local)?\].*corrupt", out)


def test_a_bit_flip_is_found_with_verify_weights(testbed, run_pyinfra):
    name = testbed.names[1]
    blob = _biggest_blob(testbed, name)
    testbed.exec(name, f"printf X | dd of={blob} bs=1 seek=100 conv=notrunc status=none", check=True)
    assert not _blob_matches(testbed, name, blob)
    # Same size: a normal run trusts the verified record ...
    plain = run_pyinfra("deploy.py")
    assert plain.returncode == 0 and "corrupt" not in plain.stdout + plain.stderr
    # ... and verify_weights=true re-hashes every blob, finds it and repairs it.
    result = run_pyinfra("deploy.py", "--data", "verify_weights=true")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert _blob_matches(testbed, name, blob)
    # The step reported it (the deploy prints a step's report lines; the journal keeps them).
    journal = testbed.exec(name, "journalctl -o cat --no-pager | grep -c 'report: corrupt' || true").stdout.strip()
    assert re.search(rf"\[{name}(?:\.local)?\].*corrupt: .* downloading again", out) or int(journal or 0) > 0


def test_a_checkout_without_the_fleet_key_stops_instead_of_rekeying(testbed, run_pyinfra):

    key_file = testbed.api_key_file
    key = key_file.read_text()
    aside = key_file.with_name("api-key.aside")
    key_file.rename(aside)
    try:
        result = run_pyinfra("deploy.py")
        out = result.stdout + result.stderr
        assert result.returncode != 0
        for name in testbed.names:
            assert re.search(rf"\[{name}(?:\.local)?\].*already serves with an API key", out), out[-3000:]
        assert not key_file.exists()  # no new key made
        assert key.strip() in testbed.exec(testbed.names[0], "cat /etc/sparkfleet/secrets.env").stdout
    finally:
        aside.rename(key_file)
    assert run_pyinfra("deploy.py").returncode == 0


def failures(out: str) -> str:
    """The lines of a deploy's output that say what failed, and what came just before."""
    lines = out.splitlines()
    keep = {i + d for i, line in enumerate(lines) if re.search(r"Error|error|failed|Traceback", line)
            and "|" not in line for d in range(-3, 4)}
    return "\n".join(lines[i] for i in sorted(keep) if 0 <= i < len(lines))[-6000:]


def registry_pid(testbed, name: str) -> str:
    return testbed.exec(name, "systemctl show docker-registry -p MainPID --value").stdout.strip()


def trusted_registries(testbed, name: str) -> set[str]:
    return set(testbed.exec(name, "ls /etc/docker/certs.d").stdout.split())


def test_a_checkout_without_the_mirror_certificate_adopts_the_mirrors(testbed, run_pyinfra):

    tls_dir = testbed.mirror_tls_dir
    before = {p.name: p.read_bytes() for p in tls_dir.iterdir()}
    aside = tls_dir.with_name("mirror-tls.aside")
    tls_dir.rename(aside)
    pid = registry_pid(testbed, testbed.names[0])
    try:
        result = run_pyinfra("deploy.py")
        out = result.stdout + result.stderr
        assert result.returncode == 0, out[-4000:]
        # The same certificate and key, not new ones: nothing to restart or re-trust anywhere.
        adopted = {p.name: p.read_bytes() for p in tls_dir.iterdir()}
        assert len(adopted) == 2 and all(before.get(name) == data for name, data in adopted.items()), adopted.keys()
        assert all(p.stat().st_mode & 0o077 == 0 for p in tls_dir.glob("*.key"))
        assert registry_pid(testbed, testbed.names[0]) == pid
        assert changed_hosts(out) <= {testbed.names[0]}, out[-3000:]  # only the adoption ran, on the mirror
    finally:
        import shutil

        shutil.rmtree(tls_dir, ignore_errors=True)
        aside.rename(tls_dir)


def test_an_unreachable_mirror_host_hands_the_mirror_to_a_reachable_one(testbed, run_pyinfra):
    first, second, third = testbed.names
    started = {n: unit(testbed, n)["ExecMainStartTimestampMonotonic"] for n in testbed.names}
    with testbed.unreachable(first):
        moved = run_pyinfra("deploy.py")
    out = moved.stdout + moved.stderr
    assert moved.returncode != 0  # the unreachable host fails; the others go on with another mirror
    assert re.search(rf"{first}(?:\.local)? is unreachable, so {second}(?:\.local)? serves the mirror", out), out[-4000:]
    for name in (second, third):
        assert not re.search(rf"\[{name}(?:\.local)?\] Error", out), failures(out)
        assert "Paris" in completion(testbed, name)
    second_registry = next(iter(trusted_registries(testbed, second) - trusted_registries(testbed, first)))
    assert testbed.exec(second, "systemctl is-active docker-registry sparkfleet-hf-mirror").stdout.split() == \
        ["active", "active"]
    # Hosts run the image by a local name: where it is pulled from is not part of what runs.
    assert {n: unit(testbed, n)["ExecMainStartTimestampMonotonic"] for n in testbed.names} == started

    back = run_pyinfra("deploy.py")
    out = back.stdout + back.stderr
    assert back.returncode == 0, out[-4000:]
    # The first host serves the mirror again; the stand-in stopped its services only once
    # it answered, and no host keeps trusting the stand-in's address.
    state = testbed.exec(second, "systemctl is-active docker-registry sparkfleet-hf-mirror; "
                                 "systemctl is-enabled docker-registry sparkfleet-hf-mirror").stdout.split()
    assert state == ["inactive", "inactive", "disabled", "disabled"], state
    for name in testbed.names:
        assert second_registry not in trusted_registries(testbed, name), name
        assert "Paris" in completion(testbed, name)
    assert {n: unit(testbed, n)["ExecMainStartTimestampMonotonic"] for n in testbed.names} == started
    again = run_pyinfra("deploy.py")
    assert again.returncode == 0 and changes(again.stdout + again.stderr) == []


def test_a_revision_that_does_not_exist_is_one_line_with_its_fix(testbed, run_pyinfra):
    """The controller resolves it for sparkfleet.lock before any host is touched."""
    import json

    from sparkfleet.profiles import PROFILES

    repo = PROFILES["dense"].model
    revisions = {**testbed.data["model_revisions"], repo: "v9"}
    started = {n: unit(testbed, n)["ExecMainStartTimestampMonotonic"] for n in testbed.names}
    result = run_pyinfra("deploy.py", "--data", f"model_revisions={json.dumps(revisions)}")
    out = result.stdout + result.stderr
    assert result.returncode != 0
    assert re.search(rf"{repo}@v9: {repo} has no revision 'v9' at \S+\. Fix: set model_revisions to a branch, tag "
                     "or commit of it", out), out[-4000:]
    assert "nothing was changed on any host" in out
    assert "Traceback" not in out and "Unexpected error" not in out
    # Nothing that serves was touched.
    assert {n: unit(testbed, n)["ExecMainStartTimestampMonotonic"] for n in testbed.names} == started
    assert all("Paris" in completion(testbed, n) for n in testbed.names)


def test_every_route_of_the_engine_needs_the_key(testbed):
    name = testbed.names[1]

    def status(path: str, key: bool) -> str:
        auth = "-H @/etc/sparkfleet/api-auth.header " if key else ""
        return testbed.exec(name, f"curl -s -m 5 -o /dev/null -w '%{{http_code}}' {auth}"
                                  f"http://127.0.0.1:8000{path}").stdout.strip()

    # vLLM's own check guards /v1 only; runtime/key_guard.py (--middleware) the rest.
    for path in ("/metrics", "/health", "/version", "/v1/models"):
        assert (status(path, key=False), status(path, key=True)) == ("401", "200"), path


def test_the_mirror_answers_fleet_hosts_only(testbed):
    mirror, peer = testbed.names[0], testbed.names[1]
    address = testbed.host(mirror).address
    for port in (5000, 8090):  # the registry, the HF mirror
        reached = testbed.exec(peer, f"timeout 5 bash -c '</dev/tcp/{address}/{port}' && echo open").stdout
        assert reached.strip() == "open", (port, reached)
        # The controller's side of the testbed is no fleet host: reset.
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((address, port), timeout=5).close()
