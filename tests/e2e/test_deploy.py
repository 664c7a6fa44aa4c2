"""The real deploy over real SSH on three simulated Sparks.

The tests run in file order and build on each other's fleet state, as a user would:
deploy from scratch, re-run, switch profile, break hosts in the ways Sparks break.
"""

from __future__ import annotations

import json
import re
import time

import pytest
from support.failures import changed_hosts, changes

from sparkfleet.hostpaths import SERVE_ENV
from sparkfleet.ready import READY_PROMPT

pytestmark = pytest.mark.e2e


def completion(testbed, name: str, timeout: float = 20) -> str | None:
    """The served model's answer on ``name``, asked on the host with the deployed key."""
    body = json.dumps({"model": "qwen", "prompt": READY_PROMPT,
                       "max_tokens": 8, "temperature": 0})
    result = testbed.exec(
        name,
        f"curl -s -m 10 -H @/etc/sparkfleet/api-auth.header -H 'Content-Type: application/json' "
        f"-d '{body}' http://127.0.0.1:8000/v1/completions",
        timeout=timeout,
    )
    try:
        return json.loads(result.stdout)["choices"][0]["text"]
    except (ValueError, KeyError, IndexError):
        return None


def unit(testbed, name: str) -> dict[str, str]:
    out = testbed.exec(name, "systemctl show sparkfleet-serve -p ActiveState -p ExecMainStartTimestampMonotonic "
                             "-p NRestarts -p UnitFileState").stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def wait_for_answer(testbed, name: str, timeout: float = 180) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        answer = completion(testbed, name)
        if answer is not None:
            return answer
        time.sleep(2)
    raise AssertionError(f"{name} did not answer within {timeout} s: {unit(testbed, name)}")


def test_from_scratch_to_ready_on_every_host(testbed, run_pyinfra):
    result = run_pyinfra("deploy.py")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    out = result.stdout + result.stderr
    for name in testbed.names:
        assert re.search(rf"\[{name}(?:\.local)?\] READY in \d+ s", out), out[-3000:]
        assert "Paris" in completion(testbed, name)
        assert unit(testbed, name)["UnitFileState"] == "enabled"


def test_secrets_stay_private(testbed, run_pyinfra):
    key = testbed.api_key_file.read_text().strip()
    for name in testbed.names:
        mode = testbed.exec(name, "stat -c %a /etc/sparkfleet/secrets.env").stdout.strip()
        assert mode == "600"
        unit_text = testbed.exec(name, "cat /etc/systemd/system/sparkfleet-serve.service; cat " + SERVE_ENV).stdout
        assert key not in unit_text
        argv = testbed.exec(name, "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '").stdout
        assert key not in argv
        # Mounted, not an --env-file: the container's configuration does not carry it.
        assert key not in testbed.exec(name, "docker inspect sparkfleet-serve").stdout
    # Without the key the API refuses.
    denied = testbed.exec(testbed.names[0], "curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:8000/v1/models")
    assert denied.stdout.strip() == "401"


def test_hf_token_reaches_hosts_only_in_the_private_file(testbed, run_pyinfra):
    token = "hf_e2eSecretToken0123456789"
    result = run_pyinfra("deploy.py", "-v", env={"HF_TOKEN": token})
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert token not in out
    assert changed_hosts(out) == set(testbed.names)  # written once, no restart: serving starts offline
    for name in testbed.names:
        assert testbed.exec(name, "stat -c %a /etc/sparkfleet/hf.env").stdout.strip() == "600"
        assert testbed.exec(name, "grep -c '^HF_TOKEN=' /etc/sparkfleet/hf.env").stdout.strip() == "1"
        public = testbed.exec(name, "cat /etc/systemd/system/sparkfleet-serve.service /etc/sparkfleet/serve.env; "
                                    "journalctl -u sparkfleet-serve --no-pager -o cat | tail -n 200").stdout
        assert token not in public
        assert testbed.exec(name, "grep -c HF_TOKEN /etc/sparkfleet/secrets.env || true").stdout.strip() == "0"
    # A controller without the token leaves it; an explicit empty hf_token removes it.
    again = run_pyinfra("deploy.py")
    assert again.returncode == 0 and changes(again.stdout + again.stderr) == []
    assert run_pyinfra("deploy.py", "--data", "hf_token=").returncode == 0
    assert testbed.exec(testbed.names[0], "grep -c '^HF_TOKEN=' /etc/sparkfleet/hf.env || true").stdout.strip() == "0"


def test_second_run_changes_nothing_and_restarts_nothing(testbed, run_pyinfra):
    before = {name: unit(testbed, name)["ExecMainStartTimestampMonotonic"] for name in testbed.names}
    result = run_pyinfra("deploy.py")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert changes(out) == [], out[-4000:]
    after = {name: unit(testbed, name)["ExecMainStartTimestampMonotonic"] for name in testbed.names}
    assert after == before


def test_dry_run_changes_nothing(testbed, run_pyinfra):
    before = testbed.exec(testbed.names[0], f"md5sum {SERVE_ENV}").stdout
    result = run_pyinfra("deploy.py", "--dry", "--data", "profile=base")
    assert result.returncode == 0
    assert testbed.exec(testbed.names[0], f"md5sum {SERVE_ENV}").stdout == before


def test_profile_switch_changes_only_what_differs_and_restarts_once(testbed, run_pyinfra):
    before = {name: unit(testbed, name) for name in testbed.names}
    result = run_pyinfra("deploy.py", "--data", "profile=dflash")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    for name in testbed.names:
        now = unit(testbed, name)
        assert now["ExecMainStartTimestampMonotonic"] != before[name]["ExecMainStartTimestampMonotonic"]
        assert now["NRestarts"] == before[name]["NRestarts"]  # a clean restart, not a crash
        env = testbed.exec(name, f"cat {SERVE_ENV}").stdout
        assert "SF_PROFILE=dflash" in env and "SF_MODEL=Intel/Qwen3.5-122B-A10B-int4-AutoRound" in env
        assert "Paris" in completion(testbed, name)
        # One start for the switch: the journal shows a single new container start.
    # Only what differs changed: no docker restart, no pull, no unit rewrite or daemon-reload.
    for unchanged in ("restart docker for its new runtime", "serving image present",
                      "systemd unit sparkfleet-serve.service", "systemd reload for the new unit"):
        assert re.search(rf"{re.escape(unchanged)}\s+3\s+-\s+-\s+3", out), (unchanged, out[-3000:])
    assert re.search(r"serving settings \(serve.env\)\s+3\s+3\s+-\s+-", out)
    # Back to the default for the following tests, and it converges.
    assert run_pyinfra("deploy.py").returncode == 0


def test_crashed_engine_is_restarted_by_systemd(testbed):
    name = testbed.names[0]
    restarts = int(unit(testbed, name)["NRestarts"])
    testbed.exec(name, "docker kill --signal KILL sparkfleet-serve")
    deadline = time.monotonic() + 120
    while int(unit(testbed, name)["NRestarts"]) == restarts and time.monotonic() < deadline:
        time.sleep(1)
    assert int(unit(testbed, name)["NRestarts"]) == restarts + 1
    assert "Paris" in wait_for_answer(testbed, name)


def test_rebooted_host_serves_again_without_a_deploy(testbed):
    name = testbed.names[1]
    testbed.restart_host(name)
    assert "Paris" in wait_for_answer(testbed, name)


def test_wrong_gpu_fails_clearly_while_the_others_stay_ready(testbed, run_pyinfra):
    bad = testbed.names[2]
    with testbed.switched(bad, gpu="NVIDIA H100 80GB HBM3"):
        result = run_pyinfra("deploy.py")
    out = result.stdout + result.stderr
    assert result.returncode != 0
    assert "GPU is NVIDIA H100 80GB HBM3" in out and "force=true" in out
    for name in testbed.names[:2]:
        assert not re.search(rf"\[{name}(?:\.local)?\] Error", out)
        assert "Paris" in completion(testbed, name)


def test_unreachable_host_does_not_stop_the_others(testbed, run_pyinfra):
    gone = testbed.names[2]
    with testbed.unreachable(gone):
        result = run_pyinfra("deploy.py", "--data", "max_num_seqs=2")
    out = result.stdout + result.stderr
    assert result.returncode != 0, out[-3000:]
    for name in testbed.names[:2]:
        assert "SF_MAX_NUM_SEQS=2" in testbed.exec(name, f"cat {SERVE_ENV}").stdout
        assert "Paris" in completion(testbed, name)
    assert run_pyinfra("deploy.py").returncode == 0


def test_serving_false_stops_and_keeps_image_and_weights(testbed, run_pyinfra):
    name = testbed.names[0]
    result = run_pyinfra("deploy.py", "--data", "serving=false")
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    state = unit(testbed, name)
    assert state["ActiveState"] == "inactive" and state["UnitFileState"] == "disabled"
    assert testbed.exec(name, "docker image ls -q | wc -l").stdout.strip() != "0"
    assert testbed.exec(name, "ls /var/lib/sparkfleet/hf/sparkfleet/complete | wc -l").stdout.strip() != "0"
    result = run_pyinfra("deploy.py")
    assert result.returncode == 0
    assert "Paris" in completion(testbed, name)


def test_host_without_nvidia_runtime_gets_the_toolkit_from_the_signed_repo(testbed, run_pyinfra):
    name = testbed.names[1]
    with testbed.switched(name, no_nvidia_runtime=True):
        assert testbed.exec(name, "command -v nvidia-container-runtime-hook || echo missing").stdout.strip() == "missing"
        result = run_pyinfra("deploy.py")
        out = result.stdout + result.stderr
        assert result.returncode == 0, out[-4000:]
        assert testbed.exec(name, "dpkg -s nvidia-container-toolkit | grep -c 'Status: install ok'").stdout.strip() == "1"
        assert "nvidia" in testbed.exec(name, "docker info --format '{{json .Runtimes}}'").stdout
        assert "Paris" in wait_for_answer(testbed, name)
        # Only that host installed anything; the results table counts 3 hosts, 1 change.
        assert re.search(r"NVIDIA container toolkit installed\s+3\s+1\s+-\s+2", out), out[-3000:]


def test_preflight_stops_each_wrong_host_before_any_change(testbed, run_pyinfra):
    # Two wrong hosts in one deploy: each is stopped with its own problem, the good one changes.
    good, full, x86 = testbed.names
    with testbed.switched(x86, arch="x86_64"), testbed.switched(full, disk_full=True):
        before = {name: testbed.exec(name, f"md5sum {SERVE_ENV}").stdout for name in (full, x86)}
        result = run_pyinfra("deploy.py", "--data", "max_num_seqs=2")
        out = result.stdout + result.stderr
        assert result.returncode != 0
        for name, message in ((x86, "processor is x86_64"), (full, "GiB free")):
            # pyinfra prefixes each line of a failed command with its host.
            for said in (message, "nothing was changed on this host"):
                assert re.search(rf"^.*\b{name}(?:\.local)?\b.*{said}", out, re.M), (name, said, out[-3000:])
            assert testbed.exec(name, f"md5sum {SERVE_ENV}").stdout == before[name]
        assert "SF_MAX_NUM_SEQS=2" in testbed.exec(good, f"cat {SERVE_ENV}").stdout
    assert run_pyinfra("deploy.py").returncode == 0


def test_hybrid_build_on_the_host_is_served_as_the_dense_checkpoint(testbed, run_pyinfra):
    result = run_pyinfra("deploy.py", "--data", "build_hybrid=true")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    for name in testbed.names:
        info = testbed.exec(name, "cat /var/lib/sparkfleet/hybrid-int4-fp8/config.json").stdout
        assert "sparkfleet_hybrid" in json.loads(info)
        assert "SF_MODEL=/model" in testbed.exec(name, f"cat {SERVE_ENV}").stdout
        assert "Paris" in completion(testbed, name)
    # A second run builds nothing again.
    again = run_pyinfra("deploy.py", "--data", "build_hybrid=true")
    assert again.returncode == 0 and changes(again.stdout + again.stderr) == []
    assert run_pyinfra("deploy.py").returncode == 0


def test_every_profile_reaches_ready(testbed, run_pyinfra):
    for profile in ("base", "mtp"):  # dense and dflash: the tests above
        result = run_pyinfra("deploy.py", "--data", f"profile={profile}")
        assert result.returncode == 0, (profile, (result.stdout + result.stderr)[-4000:])
        for name in testbed.names:
            assert f"SF_PROFILE={profile}" in testbed.exec(name, f"cat {SERVE_ENV}").stdout
            assert "Paris" in completion(testbed, name)
    assert run_pyinfra("deploy.py").returncode == 0
