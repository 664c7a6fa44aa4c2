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

from runtime import serve_args
from sparkfleet.patchcheck import plan_key
from sparkfleet.testbed import variants
from tests.e2e.test_deploy import completion

pytestmark = pytest.mark.e2e

VERDICTS = "/var/lib/sparkfleet/patch-verdicts"
SERVED = ("/etc/systemd/system/sparkfleet-serve.service", "/etc/sparkfleet/serve.env")
KV_FILE = "vllm/v1/core/kv_cache_utils.py"
DENSE = "kv_unify,inc_fp8_shared,int8_lmhead,fla_shmem"  # the default profile's patch plan
REST = "inc_fp8_shared,int8_lmhead,fla_shmem"  # the same without kv_unify


def serving_state(testbed, name: str) -> dict[str, str]:
    """What must not move when the check fails: unit, serve.env, the running container."""
    out = testbed.exec(name, "systemctl show sparkfleet-serve -p ActiveState -p ExecMainStartTimestampMonotonic "
                             "-p NRestarts").stdout
    state = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    state["files"] = testbed.exec(name, "md5sum " + " ".join(SERVED)).stdout
    state["container"] = testbed.exec(name, "docker inspect -f '{{.Id}} {{.Config.Image}}' sparkfleet-serve").stdout
    return state


def cached_verdict(testbed, name: str, image_id: str, patches: str) -> dict | None:
    """The verdict cached on ``name`` for image ``image_id`` (sha256:...), plan ``patches``
    and the serving command of the host's serve.env."""
    env = dict(line.split("=", 1) for line in testbed.exec(name, "cat /etc/sparkfleet/serve.env").stdout.splitlines()
               if "=" in line and not line.startswith("#"))
    path = f"{VERDICTS}/{image_id.split(':')[1]}-{plan_key(patches, serve_args.build_serve_argv(env))}.json"
    out = testbed.exec(name, f"cat {path} 2>/dev/null || true").stdout
    return json.loads(out) if out.strip() else None


def running_image(testbed, name: str) -> str:
    return testbed.exec(name, "docker inspect -f '{{.Image}}' sparkfleet-serve").stdout.strip()


@pytest.fixture(scope="module")
def broken_image(testbed) -> dict:
    return variants.push_variant("0.23.0-no-kv-anchor", variants.MISSING_KV_UNIFY_ANCHOR)


def test_deploy_checks_the_patches_and_caches_the_verdict(testbed, run_pyinfra):
    result = run_pyinfra("deploy.py")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    for name in testbed.names:
        assert "Paris" in completion(testbed, name)
        verdict = cached_verdict(testbed, name, running_image(testbed, name), DENSE)
        assert verdict is not None and verdict["ok"] is True, verdict
        plan = {p["name"]: p["verdict"] for p in verdict["patches"]}
        assert plan == {"kv_unify": "would-apply", "inc_fp8_shared": "would-apply",
                        "int8_lmhead": "would-apply", "fla_shmem": "would-apply"}, plan
        assert verdict["vllm"]["version"] == "0.23.0"
    # Converged: the cached verdict is read, no check container runs.
    again = run_pyinfra("deploy.py")
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-3000:]
    assert re.search(r"runtime patches and serve flags fit the image\s+3\s+-\s+-\s+3", out), out[-3000:]


def test_missing_anchor_fails_before_the_unit_changes(testbed, run_pyinfra, broken_image):
    before = {name: serving_state(testbed, name) for name in testbed.names}
    result = run_pyinfra("deploy.py", "--data", f"image={broken_image['pinned']}")
    out = result.stdout + result.stderr
    assert result.returncode != 0, out[-4000:]
    for name in testbed.names:
        assert re.search(rf"\[{name}(?:\.local)?\].*runtime patch kv_unify cannot apply to {re.escape(KV_FILE)}", out), out[-4000:]
        assert f"--data patches={REST}" in out and "--data image=name@sha256:" in out
        assert "missing anchor" in out
        # Nothing that feeds the service moved; the old server still answers.
        assert serving_state(testbed, name) == before[name]
        assert "Paris" in completion(testbed, name)
        failed = cached_verdict(testbed, name, broken_image["id"], DENSE)
        assert failed is not None and failed["ok"] is False
        assert {p["name"]: p["verdict"] for p in failed["patches"]}["kv_unify"] == "cannot-apply"
    assert "serving settings (serve.env)" not in out.split("runtime patches and serve flags fit the image", 1)[1]


def test_dropping_the_patch_as_data_deploys_the_image(testbed, run_pyinfra, broken_image):
    result = run_pyinfra("deploy.py", "--data", f"image={broken_image['pinned']}", "--data", f"patches={REST}")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    for name in testbed.names:
        assert re.search(rf"\[{name}(?:\.local)?\] READY in \d+ s", out), out[-3000:]
        assert f"SF_PATCHES={REST}\n" in testbed.exec(name, "cat /etc/sparkfleet/serve.env").stdout
        assert broken_image["id"] in testbed.exec(
            name, "docker inspect -f '{{.Image}} {{.Config.Image}}' sparkfleet-serve").stdout
        assert "Paris" in completion(testbed, name)
    # Back to the default image and plan for whatever runs next.
    restored = run_pyinfra("deploy.py")
    assert restored.returncode == 0, (restored.stdout + restored.stderr)[-3000:]
