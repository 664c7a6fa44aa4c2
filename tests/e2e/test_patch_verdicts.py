"""Runtime patches checked against the image before the service starts, on three simulated Sparks.

An image whose vLLM lacks a patch's anchor (sparkfleet/testbed/variants.py pushes one:
the sim image plus a layer that rewrites kv_unify's anchor) fails the deploy at the
patch check, naming the patch, the file and the fix, before the unit or serve.env
changes, and the running servers keep serving; dropping the patch as data deploys it.
The tests run in file order and build on each other's fleet state.
"""

from __future__ import annotations

import json
import re

import pytest

from sparkfleet.testbed import variants

pytestmark = pytest.mark.e2e

VERDICTS = "/var/lib/sparkfleet/patch-verdicts"
SERVED = ("/etc/systemd/system/sparkfleet-serve.service", "/etc/sparkfleet/serve.env")
KV_FILE = "vllm/v1/core/kv_cache_utils.py"


def completion(testbed, name: str) -> str | None:
    body = json.dumps({"model": "qwen", "prompt": "What is the capital of France? Answer in one word.",
                       "max_tokens": 8, "temperature": 0})
    result = testbed.exec(
        name,
        "curl -s -m 10 -H @/etc/sparkfleet/api-auth.header -H 'Content-Type: application/json' "
        f"-d '{body}' http://127.0.0.1:8000/v1/completions",
    )
    try:
        return json.loads(result.stdout)["choices"][0]["text"]
    except (ValueError, KeyError, IndexError):
        return None


def serving_state(testbed, name: str) -> dict[str, str]:
    """What must not move when the check fails: unit, serve.env, the running container."""
    out = testbed.exec(name, "systemctl show sparkfleet-serve -p ActiveState -p ExecMainStartTimestampMonotonic "
                             "-p NRestarts").stdout
    state = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    state["files"] = testbed.exec(name, "md5sum " + " ".join(SERVED)).stdout
    state["container"] = testbed.exec(name, "docker inspect -f '{{.Id}} {{.Config.Image}}' sparkfleet-serve").stdout
    return state


def cached_verdicts(testbed, name: str) -> list[dict]:
    out = testbed.exec(name, f"cat {VERDICTS}/*.json 2>/dev/null || true").stdout
    return [json.loads(doc) for doc in re.split(r"(?m)^(?=\{)", out) if doc.strip()]


@pytest.fixture(scope="module")
def broken_image(testbed) -> dict:
    return variants.push_variant("0.23.0-no-kv-anchor", variants.MISSING_KV_UNIFY_ANCHOR)


def test_deploy_checks_the_patches_and_caches_the_verdict(testbed, run_pyinfra):
    result = run_pyinfra("deploy.py")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    for name in testbed.names:
        assert "Paris" in completion(testbed, name)
        verdicts = cached_verdicts(testbed, name)
        assert verdicts and all(v["ok"] for v in verdicts), verdicts
        plan = {p["name"]: p["verdict"] for p in verdicts[-1]["patches"]}
        assert plan["kv_unify"] == "would-apply" and verdicts[-1]["vllm"]["version"] == "0.23.0"
    # Converged: the cached verdict is read, no check container runs.
    again = run_pyinfra("deploy.py")
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-3000:]
    assert re.search(r"runtime patches apply to the image\s+3\s+-\s+-\s+3", out), out[-3000:]


def test_missing_anchor_fails_before_the_unit_changes(testbed, run_pyinfra, broken_image):
    before = {name: serving_state(testbed, name) for name in testbed.names}
    result = run_pyinfra("deploy.py", "--data", f"image={broken_image['pinned']}")
    out = result.stdout + result.stderr
    assert result.returncode != 0, out[-4000:]
    rest = "inc_fp8_shared,int8_lmhead,fla_shmem"  # the dense profile's plan without kv_unify
    for name in testbed.names:
        assert re.search(rf"\[{name}\].*runtime patch kv_unify cannot apply to {re.escape(KV_FILE)}", out), out[-4000:]
        assert f"--data patches={rest}" in out and "--data image=name@sha256:" in out
        assert "missing anchor" in out
        # Nothing that feeds the service moved; the old server still answers.
        assert serving_state(testbed, name) == before[name]
        assert "Paris" in completion(testbed, name)
        failed = [v for v in cached_verdicts(testbed, name) if not v["ok"]]
        assert len(failed) == 1 and {p["name"]: p["verdict"] for p in failed[0]["patches"]}["kv_unify"] == "cannot-apply"
    assert "serving settings (serve.env)" not in out.split("runtime patches apply to the image", 1)[1]


def test_dropping_the_patch_as_data_deploys_the_image(testbed, run_pyinfra, broken_image):
    rest = "inc_fp8_shared,int8_lmhead,fla_shmem"
    result = run_pyinfra("deploy.py", "--data", f"image={broken_image['pinned']}", "--data", f"patches={rest}")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    for name in testbed.names:
        assert re.search(rf"\[{name}\] READY in \d+ s", out), out[-3000:]
        assert f"SF_PATCHES={rest}\n" in testbed.exec(name, "cat /etc/sparkfleet/serve.env").stdout
        assert broken_image["digest"] in testbed.exec(
            name, "docker inspect -f '{{.Image}} {{.Config.Image}}' sparkfleet-serve").stdout
        assert "Paris" in completion(testbed, name)
    # Back to the default image and plan for whatever runs next.
    restored = run_pyinfra("deploy.py")
    assert restored.returncode == 0, (restored.stdout + restored.stderr)[-3000:]
